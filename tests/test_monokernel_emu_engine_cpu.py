"""The batched engine's real scheduler driving the real batch kernel, on the CPU emulation
(replicas/monokernel_emu_batch.py): joins (the running launch yields at a step boundary, the newcomer
is prefilled, every slot resumes from its handed-over hidden state), a lone slot moving to the B = 1
build and back, and an agent session's turn 2 restored into a slot. Every request must get exactly
the tokens the single-sequence kernel of the same layout gives it alone (tiny, greedy; default, mma, and the batched engine's
default layout_tuned.TUNED_BATCH, whose single-sequence build keeps the CUDA-core MLP and LM head).
A session's turn 2 must equal a fresh request exactly on the default layout, whose kernel K/V rows equal
the prefill's bit for bit (tests/test_monokernel_emu_cpu.py); with mma they differ at bf16 level.
"""

from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest

from replicas.layout_tuned import TUNED_BATCH

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or platform.machine() not in ("x86_64", "AMD64"),
                                reason="the CPU emulation needs g++ on x86-64 (its fiber switch is x86-64 assembly)")


# (the defaults' fold_x: the handover reads the accumulators, two slots per word since session 14 (fx_pack);
# unfolded: the residual beside them in int64 words of one slot, as before session 12. pair_norm, off by default
# since it lost on 1B in session 13, keeps its joins, handovers and sessions checked in tests/test_pair_norm_cpu.py
# and tests/test_monokernel_resident_cpu.py.)
LAYOUTS = {"default": {}, "mma": {"mma": True}, "tensor-core-batch": TUNED_BATCH,
           "unfolded": {**TUNED_BATCH, "fold_x": False, "fx_pack": False}}


@pytest.fixture(scope="module", params=list(LAYOUTS.values()), ids=list(LAYOUTS))
def emu(request, tiny_checkpoint):
    from replicas.model import ModelConfig
    from replicas.monokernel_batch import BATCH_ONLY_OPTIONS
    from replicas.monokernel_batched import BatchedMonokernelEngine
    from replicas.monokernel_emu import EmuModel
    from replicas.monokernel_emu_batch import EmuBatchGpu
    from replicas.monokernel_prefill import Prefill
    from replicas.weights import load_weights

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    tensors = load_weights(tiny_checkpoint, cfg, dtype="raw")
    gpu = EmuBatchGpu(cfg, tensors, 4, layout_options=request.param)
    eng = BatchedMonokernelEngine.around(cfg, gpu, lambda view: Prefill(view, np))
    single = {k: v for k, v in request.param.items() if k not in BATCH_ONLY_OPTIONS}  # what the B = 1 build takes
    yield cfg, EmuModel(cfg, tensors, layout_options=single or None), gpu, eng
    eng.close()


def greedy(n):
    from replicas.engine import SamplingParams
    return SamplingParams(max_tokens=n, ignore_eos=True)


def same_greedy(gpu, one, prompt, got, want):
    """Exactly the single kernel's tokens, or (batch layouts with bf16 matvec inputs the single build lacks:
    layout_tuned.TUNED_BATCH) up to where they part at a near tie of its logits (2e-2 of the largest)."""
    if got == want:
        return True
    if not (gpu.layout.mma_mlp or gpu.layout.mma_lm) or len(got) != len(want):
        return False
    j = next(i for i in range(len(got)) if got[i] != want[i])
    row = one.forward_logits(prompt + want[:j])[-1]
    return max(row.max() - row[t] for t in (got[j], want[j])) <= 2e-2 * np.max(np.abs(row))


def test_joins_and_single_build_handovers_keep_every_request_exact(emu):
    cfg, one, gpu, eng = emu
    rng = np.random.default_rng(31)
    long_p, short_p = rng.integers(0, cfg.vocab_size, 18).tolist(), rng.integers(0, cfg.vocab_size, 9).tolist()
    launches, singles = gpu.launches, eng.single_launches
    long_g = eng.generate(long_p, greedy(48))  # 4 alone, then beside the joiner (its wait included), then alone
    head = [next(long_g) for _ in range(4)]  # decoding alone: the single-sequence build
    short_out = list(eng.generate(short_p, greedy(6)))  # joins: batch launch, then the long one is alone again
    long_out = head + list(long_g)
    assert same_greedy(gpu, one, long_p, long_out, one.generate_greedy(long_p, 48))
    assert same_greedy(gpu, one, short_p, short_out, one.generate_greedy(short_p, 6))
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
    assert same_greedy(gpu, one, prompt, out1, one.generate_greedy(prompt, 8))
    if not (gpu.layout.mma or gpu.layout.mma_mlp or gpu.layout.mma_lm):  # (the kernel's K/V rows carry its bf16 inputs, a fresh prefill's not)
        assert out2 == one.generate_greedy(turn2, 8)
    else:
        assert len(out2) == 8


# The samplers and control words are one code path (csrc/mk_sample.cuh) whatever the layout; what a layout changes
# is the logits they read: the CUDA-core LM head (default) or the tensor-core one (the batch defaults).
@pytest.mark.parametrize("emu", [LAYOUTS["default"], LAYOUTS["tensor-core-batch"]], ids=["default", "tensor-core-batch"],
                         indirect=True)
def test_sampling_stop_and_cancel_in_the_kernel(emu, tiny_checkpoint):
    """The kernel's samplers and control words, through the engine: seeded top-k / top-p tokens come from
    the allowed set of the oracle's logits (reference engine; boundary ties within 1e-2 allowed), the
    same seed repeats itself, a stop id ends the generation before it is yielded, and a cancel ends a
    running slot within a step while another keeps decoding."""
    from replicas.engine import FinishReason, SamplingParams
    from replicas.reference import ReferenceEngine

    cfg, one, gpu, eng = emu
    ref = ReferenceEngine.from_pretrained(tiny_checkpoint)
    rng = np.random.default_rng(33)
    prompt = rng.integers(0, cfg.vocab_size, 14).tolist()
    for q, name in ((SamplingParams(max_tokens=6, temperature=0.9, top_k=5, seed=4, ignore_eos=True), "top_k"),
                    (SamplingParams(max_tokens=6, temperature=0.7, top_p=0.6, seed=5, ignore_eos=True), "top_p")):
        out = list(eng.generate(prompt, q))
        assert out == list(eng.generate(prompt, q)) and len(out) == 6  # seeded: reproducible
        seq = list(prompt)
        for tok in out:
            z = ref.forward_logits(seq)[-1].astype(np.float64)
            order = np.argsort(-z)
            if name == "top_k":
                allowed = set(order[:5]) | {i for i in order[5:] if z[order[4]] - z[i] <= 1e-2}
            else:
                p = np.exp((z - z.max()) / q.temperature)
                p = p[order] / p.sum()
                n = int(np.searchsorted(np.cumsum(p), q.top_p - 1e-2)) + 1  # the nucleus, with slack
                allowed = set(order[:n + 1])
            assert tok in allowed, (name, len(seq), tok)
            seq.append(tok)
    plain = one.generate_greedy(prompt, 12)
    j = next(i for i in range(1, 12) if plain[i] not in plain[:i])
    g = eng.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=[plain[j]], ignore_eos=True))
    assert list(g) == plain[:j] and (g.finish_reason, g.stop_token_id) == (FinishReason.STOP, plain[j])
    other_p = rng.integers(0, cfg.vocab_size, 10).tolist()
    other = eng.generate(other_p, SamplingParams(max_tokens=20, ignore_eos=True))
    long_g = eng.generate(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    got = [next(long_g) for _ in range(3)]
    long_g.cancel()
    rest = list(long_g)
    assert long_g.finish_reason is FinishReason.CANCELLED and len(got) + len(rest) < 200
    assert same_greedy(gpu, one, prompt, got + rest, one.generate_greedy(prompt, len(got) + len(rest)))
    assert same_greedy(gpu, one, other_p, list(other), one.generate_greedy(other_p, 20))


@pytest.mark.parametrize("option", ["block_best", "best_max"])
def test_other_argmax_merges_pick_the_same_tokens(tiny_checkpoint, option):
    """Layout option block_best merges the LM head's warp bests per block before the grid-wide choice; best_max
    merges them as 64-bit keys with one atomicMax per warp and slot (two key sets by step parity, cleared by block 0
    and by the host before each launch: several launches here, joins included). Both: the same greedy and seeded
    tokens as the batch defaults, bit for bit, for requests decoding together in a batch launch."""
    from replicas.engine import SamplingParams
    from replicas.model import ModelConfig
    from replicas.monokernel_batched import BatchedMonokernelEngine
    from replicas.monokernel_emu_batch import EmuBatchGpu
    from replicas.monokernel_prefill import Prefill
    from replicas.weights import load_weights

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    tensors = load_weights(tiny_checkpoint, cfg, dtype="raw")
    rng = np.random.default_rng(34)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (16, 11, 13)]
    qs = [greedy(30), greedy(12), SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)]
    outs = []
    for extra in ({}, {option: True}):  # (against the defaults without best_max, a default since session 16)
        gpu = EmuBatchGpu(cfg, tensors, 4, layout_options={**TUNED_BATCH, "best_max": False, **extra})
        assert getattr(gpu.layout, option) == bool(extra)
        gpu.work["best_val"].view(np.uint32)[:] = 0xFFFFFFFF  # stale memory: the largest key (each launch clears it)
        eng = BatchedMonokernelEngine.around(cfg, gpu, lambda view: Prefill(view, np))
        try:
            first = eng.generate(prompts[0], qs[0])
            head = [next(first) for _ in range(2)]
            others = [eng.generate(p, q) for p, q in zip(prompts[1:], qs[1:])]
            got = [list(g) for g in others]  # (decoded beside the first: batch launches)
            outs.append([head + list(first)] + got)
            assert gpu.launches >= 2
        finally:
            eng.close()
    assert outs[0] == outs[1] and [len(o) for o in outs[0]] == [30, 12, 12]
