"""The monokernel's own CUDA source, run on the CPU (replicas/monokernel_emu.py, csrc/emu/cuda_on_cpu.h):
the tiny model on a 4-block grid, teacher-forced and greedy, against the numpy reference engine.

What it catches without a GPU: wrong indices, a phase reading a buffer another phase laid out
differently, a missing barrier between blocks' hand-offs (the fibers interleave at every sync point).
Tolerances: the default layout keeps fp32 activations and bf16 weights/KV like the reference's bf16
checkpoint path, so the kernel matches the reference to 5e-3 of the largest logit (measured 1e-3);
layout option mma rounds every matvec input to bf16 as well (measured 2.3e-3; the GPU tests allow 2e-2).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulation needs g++")

TOL = 5e-3


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    from replicas.model import ModelConfig
    from replicas.reference import ReferenceEngine
    from replicas.weights import load_weights

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    return cfg, load_weights(tiny_checkpoint, cfg, dtype="raw"), ReferenceEngine.from_pretrained(tiny_checkpoint)


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("options", [None, {"mma": True}], ids=["default", "mma"])
def test_teacher_forced_logits_and_greedy_tokens_match_the_reference(tiny, options):
    from replicas.engine import SamplingParams
    from replicas.monokernel_emu import EmuModel

    cfg, tensors, ref = tiny
    m = EmuModel(cfg, tensors, layout_options=options)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, 28).tolist()
    got, want = m.forward_logits(ids), ref.forward_logits(ids)
    assert got.shape == want.shape == (28, cfg.vocab_size) and np.abs(want).max() > 0
    assert rel(got[16:], want[16:]) <= TOL  # the positions the kernel decoded (the rest: the prefill)
    prompt = ids[:12]
    toks = m.generate_greedy(prompt, 10)
    oracle = list(ref.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
    # greedy tokens equal the oracle's wherever its top-2 margin is clear of the tolerance
    seq = list(prompt)
    for mine, theirs in zip(toks, oracle):
        logits = ref.forward_logits(seq)[-1]
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] > 2 * TOL * np.abs(logits).max():
            assert mine == theirs, (len(seq), mine, theirs)
        if mine != theirs:
            break
        seq.append(mine)
    assert len(toks) == 10


def test_the_kernel_writes_the_prefills_kv_rows(tiny):
    """K/V rows the kernel appends equal what a prefill of the whole sequence computes for them (within
    bf16 rounding: 1e-2, mma 2e-2), rows it was given stay, and nothing else is written."""
    from replicas.monokernel_emu import EmuModel
    from replicas.monokernel_weights import to_f32

    cfg, tensors, _ = tiny
    ids = np.random.default_rng(8).integers(0, cfg.vocab_size, 20).tolist()
    full = EmuModel(cfg, tensors)
    full.prefill(ids)
    for options, tol in ((None, 1e-2), ({"mma": True}, 2e-2)):
        m = EmuModel(cfg, tensors, layout_options=options)
        x_last, _ = m.prefill(ids[:16])
        before = m.k_cache[:, :, :16].copy(), m.v_cache[:, :, :16].copy()
        m.launch(x_last, 16, 5, forced=ids[16:20], logits=np.zeros((5, cfg.vocab_size), np.float32))
        for cache, want, kept in ((m.k_cache, full.k_cache, before[0]), (m.v_cache, full.v_cache, before[1])):
            got, exp = to_f32(np, cache[:, :, 16:20]), to_f32(np, want[:, :, 16:20])
            assert rel(got, exp) <= tol, options
            assert np.array_equal(cache[:, :, :16], kept)  # the prefill's rows are left alone
            assert not cache[:, :, 20:].any()  # and nothing past the last fed position is written
