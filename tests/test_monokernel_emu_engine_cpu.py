"""The batched engine's real scheduler driving the real batch kernel, on the CPU emulation
(replicas/monokernel_emu_batch.py): joins (the running launch yields at a step boundary, the newcomer
is prefilled, every slot resumes from its handed-over hidden state), a lone slot moving to the B = 1
build and back, and an agent session's turn 2 restored into a slot. Every request must get exactly
the tokens the single-sequence kernel of the same layout gives it alone (tiny, greedy; default and mma).
A session's turn 2 must equal a fresh request exactly on the default layout, whose kernel K/V rows equal
the prefill's bit for bit (tests/test_monokernel_emu_cpu.py); with mma they differ at bf16 level.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulation needs g++")


@pytest.fixture(scope="module", params=[{}, {"mma": True}], ids=["default", "mma"])
def emu(request, tiny_checkpoint):
    from replicas.model import ModelConfig
    from replicas.monokernel_batched import BatchedMonokernelEngine
    from replicas.monokernel_emu import EmuModel
    from replicas.monokernel_emu_batch import EmuBatchGpu
    from replicas.monokernel_prefill import Prefill
    from replicas.weights import load_weights

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    tensors = load_weights(tiny_checkpoint, cfg, dtype="raw")
    gpu = EmuBatchGpu(cfg, tensors, 4, layout_options=request.param)
    eng = BatchedMonokernelEngine.around(cfg, gpu, lambda view: Prefill(view, np))
    yield cfg, EmuModel(cfg, tensors, layout_options=request.param or None), gpu, eng
    eng.close()


def greedy(n):
    from replicas.engine import SamplingParams
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_joins_and_single_build_handovers_keep_every_request_exact(emu):
    cfg, one, gpu, eng = emu
    rng = np.random.default_rng(31)
    long_p, short_p = rng.integers(0, cfg.vocab_size, 18).tolist(), rng.integers(0, cfg.vocab_size, 9).tolist()
    launches, singles = gpu.launches, eng.single_launches
    long_g = eng.generate(long_p, greedy(56))
    head = [next(long_g) for _ in range(4)]  # decoding alone: the single-sequence build
    short_out = list(eng.generate(short_p, greedy(6)))  # joins: batch launch, then the long one is alone again
    long_out = head + list(long_g)
    assert long_out == one.generate_greedy(long_p, 56)
    assert short_out == one.generate_greedy(short_p, 6)
    assert gpu.launches - launches >= 3 and eng.single_launches - singles >= 2  # single -> batch -> single


def test_a_sessions_second_turn_restores_its_kv_and_equals_a_fresh_request(emu):
    cfg, one, gpu, eng = emu
    rng = np.random.default_rng(32)
    prompt = rng.integers(0, cfg.vocab_size, 20).tolist()
    other = eng.generate(rng.integers(0, cfg.vocab_size, 15).tolist(), greedy(40))  # decodes throughout
    next(other)
    g1 = eng.generate(prompt, greedy(8), session_id="emu")
    out1 = list(g1)
    turn2 = prompt + out1 + rng.integers(0, cfg.vocab_size, 5).tolist()
    g2 = eng.generate(turn2, greedy(8), session_id="emu")
    out2 = list(g2)
    list(other)
    assert g1.reused_tokens == 0 and g2.reused_tokens == len(prompt) + len(out1) - 1
    assert out1 == one.generate_greedy(prompt, 8)
    if not gpu.layout.mma:  # (mma: the kernel's K/V rows carry its bf16 inputs, a fresh prefill's do not)
        assert out2 == one.generate_greedy(turn2, 8)
    else:
        assert len(out2) == 8
