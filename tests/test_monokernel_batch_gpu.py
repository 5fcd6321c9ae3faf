"""The batched monokernel (layout option batch, replicas/monokernel_batched.py) on a GPU: B slots
decoded in one weight pass must give each request what the single-sequence engine gives it.

Oracles: the B = 1 engine (same kernel math per slot; only int64 fixed-point sums, which are exact,
change order, so logits agree to fp32 rounding: 1e-4) and Hugging Face transformers in fp32
(TOL = 2e-2, as tests/test_monokernel_gpu.py). Fresh random prompts of different lengths; tokens
compared exactly. Marked `gpu` (CI deselects it).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TOL = 2e-2
SAME = 1e-4  # batch slot vs the single-sequence kernel: the same math up to fp32 rounding (fewer attention
# splits per slot when several are live round the softmax combine differently)
SAME_MMA = 5e-3  # layout mma: that fp32 difference can flip the bf16 rounding of an O input (CPU emulation:
# up to 1.2e-3 at B = 8, tests/test_monokernel_emu_cpu.py)
# layout act_bf16: the batch slots' matvec inputs are bf16, the single engine's fp32: as far apart as bf16
# rounding puts them (CPU emulation, random weights: up to 1.7e-2), so the transformers tolerance
# (mma_mlp too: its MLP inputs and h are bf16, the single engine's CUDA-core MLP keeps them fp32)
BF16_INPUTS = TOL


def slot_tolerance(layout) -> float:
    return BF16_INPUTS if layout.act_bf16 or layout.mma_mlp else SAME_MMA if layout.mma else SAME


def bf16_inputs(layout) -> bool:
    """Whether a batch slot may part from the single engine at a near tie (bf16 matvec inputs somewhere)."""
    return layout.mma or layout.act_bf16 or layout.mma_mlp or layout.mma_lm


def assert_tokens(many, one, prompt, got, want):
    """A slot's greedy tokens are the single engine's: exactly, or with bf16 matvec inputs in the batch build
    up to where they part at a near tie of the single engine's logits (then the rest is not compared)."""
    if not bf16_inputs(many.gpu.layout):
        assert got == want
        return
    j = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), None)
    if j is None:
        assert len(got) == len(want)
        return
    row = one.forward_logits(prompt + want[:j])[-1]
    gaps = [(row.max() - row[t]) / np.max(np.abs(row)) for t in (got[j], want[j])]
    assert max(gaps) <= TOL, f"token {j}: {got[j]} vs {want[j]}, below the best logit by {gaps}"
# MK_BATCH_TEST_SLOTS=8: the engine under test has 8 slots (its B = 2 and 4 builds for partial occupancy); the tests
# that fill every slot (teacher forcing, concurrent greedy, joins, stop/cancel/busy) then run its B = 8 build
BATCH = int(os.environ.get("MK_BATCH_TEST_SLOTS", "4"))


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# MK_BATCH_TEST_PRESETS="llama-3.1-8b": other models (e.g. one whose batch default differs: pair_norm from hidden 4,096)
@pytest.fixture(scope="module", params=os.environ.get("MK_BATCH_TEST_PRESETS", "tiny llama-3.2-1b").split())
def engines(request, tmp_path_factory):
    pytest.importorskip("cupy")
    from replicas.checkpoint import make_checkpoint
    from replicas.monokernel import MonokernelEngine
    from replicas.monokernel_batch import BATCH_ONLY_OPTIONS
    from replicas.monokernel_batched import BatchedMonokernelEngine

    from tests.test_monokernel_gpu import _layout_from_env

    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=0, dtype="bf16")
    # MK_BATCH_TEST_LAYOUT=ao_slots=1: the batch build under test gets these layout options; the single
    # engine (the oracle of each slot's numbers) gets those a single-sequence build takes (e.g. mma=1:
    # both on tensor cores with bf16 inputs, so slot and single engine agree to SAME_MMA)
    opts = _layout_from_env(os.environ.get("MK_BATCH_TEST_LAYOUT", ""))
    one = MonokernelEngine.from_pretrained(path, max_context=1024, layout_options={
        k: v for k, v in opts.items() if k not in BATCH_ONLY_OPTIONS} or None)
    # the engine's default: the smaller builds for partial occupancy (the 2-request launches use B=2);
    # MK_BATCH_SUB_BUILDS=0 tests the largest build alone
    sub = os.environ.get("MK_BATCH_SUB_BUILDS", "1") == "1"
    many = BatchedMonokernelEngine.from_pretrained(path, batch=BATCH, max_context=1024, layout_options=opts,
                                                   sub_builds=sub)
    assert sorted(many.gpu.builds) == ([n for n in (2, 4) if n < BATCH] + [BATCH] if sub else [BATCH])
    assert all(getattr(many.gpu.layout, k) == v for k, v in opts.items()), opts
    yield path, one, many
    many.close()


def prompts(vocab: int, seed: int, n: int = BATCH) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(5, 60))).tolist() for _ in range(n)]


def test_teacher_forced_slots_match_single_engine_and_transformers(engines):
    from tests.test_monokernel_gpu import hf_logits

    path, one, many = engines
    rng = np.random.default_rng(11)
    seqs = [rng.integers(0, one.config.vocab_size, n).tolist() for n in (200, 96, 150, 40, 120, 64, 180, 30)[:BATCH]]
    got = many.forward_logits_slots(seqs)
    for s, g in zip(seqs, got):
        assert g.shape == (len(s), one.config.vocab_size) and np.isfinite(g).all()
        assert rel(g, one.forward_logits(s)) <= slot_tolerance(many.gpu.layout)
    assert rel(got[0], hf_logits(path, seqs[0])) <= TOL


def test_concurrent_greedy_requests_equal_single_requests(engines):
    from replicas.engine import FinishReason, SamplingParams

    _, one, many = engines
    ps = prompts(one.config.vocab_size, 3)
    lens = [64, 17, 40, 33, 25, 50, 12, 38][:BATCH]
    gens = [many.generate(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(ps, lens)]
    outs = [list(g) for g in gens]
    for p, n, g, o in zip(ps, lens, gens, outs):
        assert_tokens(many, one, p, o, list(one.generate(p, SamplingParams(max_tokens=n, ignore_eos=True))))
        assert len(o) == n and g.finish_reason is FinishReason.LENGTH


def test_seeded_sampling_per_slot_equals_single(engines):
    from replicas.engine import SamplingParams

    _, one, many = engines
    ps = prompts(one.config.vocab_size, 4)
    params = [SamplingParams(max_tokens=30, seed=7, temperature=1.3, ignore_eos=True),
              SamplingParams(max_tokens=30, seed=8, temperature=0.9, top_k=40, top_p=0.9, ignore_eos=True),
              SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=30, seed=9, temperature=0.7, top_p=0.8, ignore_eos=True)]
    outs = [list(g) for g in [many.generate(p, q) for p, q in zip(ps, params)]]
    if not bf16_inputs(many.gpu.layout):
        for p, q, o in zip(ps, params, outs):
            assert o == list(one.generate(p, q))
        return
    # bf16 matvec inputs in the batch build only (mma_mlp, act_bf16): a near tie of the Gumbel keys may part a
    # slot from the fp32 single engine, so: seeded slots repeat exactly, greedy and top-k tokens are the
    # single engine's choices on the slot's own text (greedy: or a near tie; top-k: among its top 40)
    again = [list(g) for g in [many.generate(p, q) for p, q in zip(ps, params)]]
    assert again == outs
    assert_tokens(many, one, ps[2], outs[2], list(one.generate(ps[2], params[2])))
    rows = one.forward_logits(ps[1] + outs[1][:-1])[len(ps[1]) - 1:]
    for row, t in zip(rows, outs[1]):
        assert row[t] >= np.sort(row)[-40] - TOL * np.max(np.abs(row))


def test_joins_resume_running_slots_exactly(engines):
    """Two requests decode; two more join mid-way (each join: the launch yields, the newcomers are
    prefilled, every slot resumes): all four outputs equal their single-engine outputs."""
    from replicas.engine import SamplingParams

    _, one, many = engines
    ps = prompts(one.config.vocab_size, 5)
    q = SamplingParams(max_tokens=120, ignore_eos=True)
    launches = many.launches
    first = [many.generate(p, q) for p in ps[:2]]
    heads = [[next(g) for _ in range(10)] for g in first]
    late = [many.generate(p, q) for p in ps[2:]]
    t0 = time.perf_counter()
    late_first = [next(g) for g in late]
    join_s = time.perf_counter() - t0
    outs = [h + list(g) for h, g in zip(heads, first)] + [[f] + list(g) for f, g in zip(late_first, late)]
    for p, o in zip(ps, outs):
        assert_tokens(many, one, p, o, list(one.generate(p, q)))
    assert many.launches - launches >= 2  # the joins really relaunched
    assert join_s < 5.0


def test_stop_cancel_and_busy_are_per_slot(engines):
    from replicas.engine import EngineBusy, FinishReason, SamplingParams

    _, one, many = engines
    ps = prompts(one.config.vocab_size, 6)
    q = SamplingParams(max_tokens=48, ignore_eos=True)
    ref = [list(one.generate(p, q)) for p in ps]
    j = next((i for i in range(1, 48) if ref[0][i] not in ref[0][:i]), None)
    stop_q = SamplingParams(max_tokens=48, stop_token_ids=[ref[0][j]], ignore_eos=True) if j else q
    gens = [many.generate(ps[0], stop_q)] + [many.generate(p, q) for p in ps[1:]]
    with pytest.raises(EngineBusy):
        many.generate(ps[0], q)
    got1 = [next(gens[1]) for _ in range(3)]
    gens[1].cancel()
    rest = [list(g) for g in [gens[0]] + gens[2:]]
    list(gens[1])
    assert gens[1].finish_reason is FinishReason.CANCELLED
    assert_tokens(many, one, ps[1], got1, ref[1][:3])
    if j:
        assert_tokens(many, one, ps[0], rest[0], ref[0][:j])
        assert gens[0].finish_reason is FinishReason.STOP or rest[0] != ref[0][:j]  # (parted at a near tie)
    for k, got in enumerate(rest[1:], start=2):
        assert_tokens(many, one, ps[k], got, ref[k])
    assert_tokens(many, one, ps[1], list(many.generate(ps[1], q)), ref[1])  # the cancelled slot is free and clean


def test_lone_slot_runs_the_single_build_and_switches_exactly(engines):
    """A lone request runs the single-sequence build; a join moves it to the batch build and, when the
    other finishes, back: a seeded sampled request stays token-for-token the single engine's."""
    from replicas.engine import SamplingParams

    _, one, many = engines
    ps = prompts(one.config.vocab_size, 7, 2)
    long_q = SamplingParams(max_tokens=150, seed=21, temperature=1.1, top_k=50, ignore_eos=True)
    short_q = SamplingParams(max_tokens=30, seed=22, temperature=1.2, ignore_eos=True)
    if bf16_inputs(many.gpu.layout):  # (sampled tokens may part at a near tie of Gumbel keys: compare greedy ones)
        long_q, short_q = SamplingParams(max_tokens=150, ignore_eos=True), SamplingParams(max_tokens=30, ignore_eos=True)
    singles = many.single_launches
    gen = many.generate(ps[0], long_q)
    head = [next(gen) for _ in range(20)]
    assert many.single_launches == singles + 1  # alone: the single build
    other = list(many.generate(ps[1], short_q))  # joins: batch launch, then back to single
    out = head + list(gen)
    assert_tokens(many, one, ps[0], out, list(one.generate(ps[0], long_q)))
    assert_tokens(many, one, ps[1], other, list(one.generate(ps[1], short_q)))
    assert many.single_launches >= singles + 2


def test_a_sessions_turn_two_equals_a_fresh_request(engines):
    """Agent-session reuse per slot (tests/test_monokernel_sessions_gpu.py does the single engine): turn 2
    restores the stored prefix into its slot and prefills only the rest, and outputs what a fresh
    full-prompt request does (up to a near tie: reused KV was written by the kernel, a fresh request's by
    the prefill GEMMs), while another slot decodes through both turns and stays the single engine's."""
    from replicas.engine import SamplingParams

    from tests.test_monokernel_sessions_gpu import assert_same_greedy, words

    _, one, many = engines
    before = many.session_stats()
    other, long_q = words(many, 50, 3), SamplingParams(max_tokens=600, ignore_eos=True)
    background = many.generate(other, long_q)
    head = [next(background) for _ in range(3)]
    q = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = words(many, 200, 2)
    gen = many.generate(prompt, q, session_id="b2")
    out1 = list(gen)
    assert gen.reused_tokens == 0
    turn2 = prompt + out1 + words(many, 30, 4)
    gen = many.generate(turn2, q, session_id="b2")
    out2 = list(gen)
    assert gen.reused_tokens == len(prompt) + len(out1) - 1  # the last output token was never fed back
    assert_tokens(many, one, other, head + list(background), list(one.generate(other, long_q)))
    after = many.session_stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (1, 1)
    assert after.reused_tokens - before.reused_tokens == gen.reused_tokens
    assert_same_greedy(many, prompt, out1, list(many.generate(prompt, q)))
    assert_same_greedy(many, turn2, out2, list(many.generate(turn2, q)))
