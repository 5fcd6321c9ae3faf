"""Resident batch launches on a GPU (layout option resident, replicas/monokernel_resident.py): requests
join a running batch kernel while it decodes, their prefill on the SMs the resident builds leave free.

Oracles as tests/test_monokernel_batch_gpu.py: the single-sequence engine on every SM (each request's
greedy tokens exactly, or up to a near tie where the batch builds round matvec inputs to bf16 as the
tensor-core defaults do: assert_tokens; teacher-forced logits within the batch tests' slot_tolerance,
at least GRID) and transformers in fp32 (TOL = 2e-2). The resident engine's batch builds
run on `132 - PREFILL_SMS` SMs with their own fused-down packing, its single build on all of them with
the other: both packings are checked. Marked `gpu` (CI deselects it; the CPU side is
tests/test_monokernel_resident_cpu.py).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from replicas.monokernel_resident import JOIN_MODE_TOL

# The resident batch grid (132 - 16 SMs) splits attention and the fused down's partials differently from the
# single engine's 132: fp32 sums in another order, measured 1.5e-4 of the max logit on llama-3.2-1b over 180
# positions (same grid: SAME = 1e-4); still 25x below bf16's step, and transformers is checked at TOL.
GRID = 3e-4
from tests.test_monokernel_batch_gpu import (BATCH, SAME, TOL, assert_tokens, rel,  # the batch tests' oracles
                                             slot_tolerance)


@pytest.fixture(scope="module", params=["tiny", "llama-3.2-1b"])
def engines(request, tmp_path_factory):
    pytest.importorskip("cupy")
    from replicas.checkpoint import make_checkpoint
    from replicas.monokernel import MonokernelEngine
    from replicas.monokernel_batched import BatchedMonokernelEngine
    from replicas.monokernel_resident import PREFILL_SMS

    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=0, dtype="bf16")
    one = MonokernelEngine.from_pretrained(path, max_context=2048)
    # idle_s: a launch whose slots all ended waits for the next join (tiny decodes 900 tokens in tens of ms,
    # so "running" requests alone could not keep the launch up for the joins below)
    # MK_RESIDENT_TEST_LAYOUT=fx_pack=1: the resident batch builds get these layout options (bench A/B candidates)
    from tests.test_monokernel_gpu import _layout_from_env
    opts = _layout_from_env(os.environ.get("MK_RESIDENT_TEST_LAYOUT", "")) or None
    res = BatchedMonokernelEngine.from_pretrained(path, batch=BATCH, max_context=2048, resident=True, idle_s=2.0,
                                                  layout_options=opts)
    sms = one.gpu.layout.num_sms
    assert res.gpu.layout.num_sms == sms - PREFILL_SMS and res.gpu.single_layout.num_sms == sms
    yield path, one, res
    res.close()


def greedy(n):
    from replicas.engine import SamplingParams
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_teacher_forced_slots_on_the_resident_grid_match_single_and_transformers(engines):
    from tests.test_monokernel_gpu import hf_logits

    path, one, res = engines
    rng = np.random.default_rng(61)
    seqs = [rng.integers(0, one.config.vocab_size, n).tolist() for n in (180, 64, 120, 33)]
    got = res.forward_logits_slots(seqs)
    for s, g in zip(seqs, got):
        assert g.shape == (len(s), one.config.vocab_size) and np.isfinite(g).all()
        # (the batched engine's tensor-core defaults round their matvec inputs to bf16: slot_tolerance)
        assert rel(g, one.forward_logits(s)) <= max(GRID, slot_tolerance(res.gpu.layout))
    assert rel(got[0], hf_logits(path, seqs[0])) <= TOL


def test_requests_join_the_running_launch_and_get_the_single_engines_tokens(engines):
    _, one, res = engines
    rng = np.random.default_rng(62)
    ps = [rng.integers(0, one.config.vocab_size, int(rng.integers(8, 60))).tolist() for _ in range(6)]
    lens = [900, 880, 860, 12, 10, 8]  # the running three outlast the joins (tiny decodes fast)
    gens = [res.generate(ps[0], greedy(lens[0]))]
    heads = [[next(gens[0])]]  # alone: the single build (every SM, its own down packing)
    for k in (1, 2):  # the first two joins relaunch (no free slot in the running build)
        gens.append(res.generate(ps[k], greedy(lens[k])))
        heads.append([next(gens[k])])
    launches, joins = res.launches, res.resident_joins
    t0 = time.perf_counter()
    outs_late = []
    seen = []
    for k in (3, 4, 5):  # each joins the running 4-slot launch (slot 3, freed by the last one each time)
        outs_late.append(list(res.generate(ps[k], greedy(lens[k]))))
        seen.append((len(ps[k]), res.launches - launches, res.resident_joins - joins,
                     round((time.perf_counter() - t0) * 1e3, 1)))
    joined_s = time.perf_counter() - t0
    # (counted now: when the running three end, the last one alone moves to the single build, a relaunch)
    assert [x[1:3] for x in seen] == [(0, 1), (0, 2), (0, 3)], \
        f"the joins relaunched the kernel: (prompt, relaunches, joins, ms) after each: {seen}"
    outs = [h + list(g) for h, g in zip(heads, gens)]
    from tests.test_monokernel_sessions_gpu import assert_same_greedy

    for p, n, o in zip(ps, lens, outs):  # exactly, or up to a near tie with bf16 matvec inputs (assert_tokens)
        assert_tokens(res, one, p, o, list(one.generate(p, greedy(n))))
    for p, n, o in zip(ps[3:], lens[3:], outs_late):
        want = list(one.generate(p, greedy(n)))
        if res._joiner.mode != "tensor":  # mma / SIMT join GEMMs sum in another order: may part at a near tie
            assert_same_greedy(one, p, o, want)
        else:
            assert_tokens(res, one, p, o, want)
    print(f"three joins into a running launch and their {sum(lens[3:])} tokens: {joined_s * 1e3:.1f} ms")


def test_a_sessions_turns_join_the_running_launch_and_turn_two_equals_a_fresh_request(engines):
    from tests.test_monokernel_sessions_gpu import assert_same_greedy

    _, one, res = engines
    rng = np.random.default_rng(63)
    vocab = one.config.vocab_size
    # long enough to outlast both turns on tiny (else the last turn alone moves to the single build)
    running = [res.generate(rng.integers(0, vocab, 20).tolist(), greedy(1900 + 10 * k)) for k in range(3)]
    for g in running:
        next(g)
    launches, joins = res.launches, res.resident_joins
    # the mma / fp32 join modes (where cuBLAS's tensor-core GEMMs do not run beside a launch) join prompts of
    # up to max_join_tokens to prefill: turn 1 fits it; turn 2 prefills only its 40 new tokens either way
    n1 = min(300, (res._joiner.max_join_tokens or 300) - 8)
    prompt = rng.integers(0, vocab, n1).tolist()
    t0 = time.perf_counter()
    g1 = res.generate(prompt, greedy(16), session_id="agent")
    out1 = list(g1)
    t1 = time.perf_counter()
    turn2 = prompt + out1 + rng.integers(0, vocab, 40).tolist()
    g2 = res.generate(turn2, greedy(16), session_id="agent")
    out2 = list(g2)
    t2 = time.perf_counter()
    assert (res.launches, res.resident_joins) == (launches, joins + 2), (
        f"single launches {res.single_launches}; turns took {t1 - t0:.3f} / {t2 - t1:.3f} s; join latencies (s) "
        f"{[round(v, 4) for v in list(res.join_latencies)[-3:]]}")
    assert g2.reused_tokens == len(prompt) + len(out1) - 1
    assert_tokens(res, one, prompt, out1, list(one.generate(prompt, greedy(16))))
    # turn 2's first rows come from the kernel's own K/V, a fresh prefill's from cuBLAS: bf16-level apart
    assert_same_greedy(one, turn2, out2, list(one.generate(turn2, greedy(16))))
    for g in running:
        g.cancel()
        list(g)


@pytest.mark.parametrize("mode", ["mma", "fp32"])
def test_join_gemm_modes_compute_the_tensor_core_prefills_numbers(engines, mode):
    """The joins' other GEMM modes (used where cuBLAS's tensor-core GEMMs wait for a running launch): our
    mma.sync GEMM on the same bf16 operands, cuBLAS's SIMT kernels on fp32 copies of them, against the
    default bf16 tensor-core prefill. The products are the same, the sums run in another order, and a bf16
    re-rounding of an activation between GEMMs can then land one ulp apart and spread through the layers:
    JOIN_MODE_TOL (1e-2 of the max logit, half of TOL, the transformers bound; 6.2e-3 / 7.0e-3 measured on
    llama-3.2-1b), the same bound the engine checks at start."""
    from replicas.monokernel_blas import use_gemm_mode

    _, one, res = engines
    cp = res.gpu.cp
    ids = np.random.default_rng(64).integers(0, one.config.vocab_size, 200).tolist()
    pre = res._prefill[0]
    with cp.cuda.Device(res.gpu.device):
        _, tensor = pre.run(ids, all_logits=True)
        use_gemm_mode(mode)
        try:
            _, other = pre.run(ids, all_logits=True)
        finally:
            use_gemm_mode("tensor")
        tensor, other = cp.asnumpy(tensor), cp.asnumpy(other)
    assert np.isfinite(other).all() and other.shape == tensor.shape
    assert rel(other, tensor) <= JOIN_MODE_TOL
