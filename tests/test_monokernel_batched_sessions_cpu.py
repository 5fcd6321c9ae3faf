"""Agent-session KV reuse of the batched monokernel engine (replicas/monokernel_batched_sessions.py), on
the CPU: the real scheduler thread on the numpy stand-in GPU of tests/test_monokernel_batch_cpu.py,
whose tokens are a hash of the KV rows in the slot's cache, so a session's prefix restored wrongly
(wrong rows, too many, another session's, into the wrong slot) changes the output, and a KV copy
taken while a launch runs is an error (fixture teardown). Every check is against what a fresh
request with the full prompt gives. The CUDA side is
tests/test_monokernel_batch_gpu.py (test_a_sessions_turn_two_equals_a_fresh_request).
"""

from __future__ import annotations

import inspect
import time

import grpc
import numpy as np
import pytest
from monoserve.v1 import common_pb2, replica_pb2, replica_pb2_grpc

from replicas.engine import FinishReason, SamplingParams, accepts_session_id
from replicas.engine_group import EngineGroup
from replicas.monokernel import MonokernelEngine
from replicas.monokernel_batched import BatchedMonokernelEngine
from replicas.server import ReplicaServer
from replicas.session_cache import DEFAULT_MAX_BYTES, DEFAULT_MAX_SESSIONS
from tests.test_monokernel_batch_cpu import CFG, FakeBatchGpu, FakePrefill, expected, make  # noqa: F401 (fixture)

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
ROW_BYTES = 16  # K and V of one position in the stand-in cache: 2 x (2 layers x 1 head x 2 dims) x 2 bytes


def words(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, CFG.vocab_size, n).tolist()


def run(eng, prompt, params=GREEDY, session_id=None):
    gen = eng.generate(prompt, params, session_id=session_id)
    return list(gen), gen


def prefilled(gpu, k: int = 1) -> list[int]:
    """Tokens each of the last k prefills computed (the rest of its prompt came from a session's KV)."""
    return [len(ids) - start for ids, start in zip(gpu.prefilled[-k:], gpu.prefill_starts[-k:])]


def assert_fresh(out, gen, prompt, params):
    """What a fresh request with the full prompt gives (tokens, finish reason, stop id)."""
    want, reason, stop = expected(prompt, params)
    assert out == want
    assert (gen.finish_reason, gen.stop_token_id) == (reason, stop)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_turn_two_prefills_only_the_suffix_and_equals_a_fresh_request(make, params):
    eng, gpu = make(4)
    assert accepts_session_id(eng)
    prompt = words(30, 1)
    out1, gen = run(eng, prompt, params, "a")
    assert gen.reused_tokens == 0 and prefilled(gpu) == [30]
    assert_fresh(out1, gen, prompt, params)
    run(eng, words(50, 2))  # another request overwrites slot 0's cache meanwhile
    turn2 = prompt + out1 + words(9, 3)
    out2, gen = run(eng, turn2, params, "a")
    n = len(prompt) + len(out1) - 1  # the last emitted token was never fed back
    assert gen.reused_tokens == n and prefilled(gpu) == [len(turn2) - n] == [10]
    assert_fresh(out2, gen, turn2, params)
    assert out2 == run(eng, turn2, params)[0]  # the same engine, no session
    turn3 = turn2 + out2 + words(4, 4)
    out3, gen = run(eng, turn3, params, "a")
    assert gen.reused_tokens == len(turn2) + len(out2) - 1
    assert_fresh(out3, gen, turn3, params)
    s = eng.session_stats()
    assert (s.hits, s.misses, s.evictions, s.sessions) == (2, 1, 0, 1)
    assert s.reused_tokens == n + len(turn2) + len(out2) - 1
    assert s.bytes == (len(turn3) + len(out3) - 1) * ROW_BYTES
    other, gen = run(eng, turn3, params, "b")  # another session does not reuse
    assert gen.reused_tokens == 0 and other == out3


def test_a_stop_keeps_every_emitted_token(make):
    eng, gpu = make(2)
    prompt = words(30, 5)
    out = expected(prompt, GREEDY)[0]
    j = next(i for i in range(1, len(out)) if out[i] not in out[:i])
    q = SamplingParams(max_tokens=12, stop_token_ids=[out[j]], ignore_eos=True)
    got, gen = run(eng, prompt, q, "s")
    assert got == out[:j] and gen.finish_reason is FinishReason.STOP
    assert eng.sessions._entries["s"].tokens.tolist() == prompt + got  # every emitted token was fed back
    nxt = prompt + got + words(5, 6)
    out2, gen = run(eng, nxt, GREEDY, "s")
    assert gen.reused_tokens == len(prompt) + len(got) and prefilled(gpu) == [5]
    assert_fresh(out2, gen, nxt, GREEDY)


def test_the_stand_in_reads_the_restored_rows(make):
    """A sanity check of the tests: one wrong row in the stored KV changes turn 2's output."""
    eng, gpu = make(2)
    prompt = words(30, 7)
    out1 = run(eng, prompt, session_id="x")[0]
    eng.sessions._entries["x"].kv.k[1, 0, 17] += 1
    turn2 = prompt + out1 + words(6, 8)
    out2, gen = run(eng, turn2, session_id="x")
    assert gen.reused_tokens > 17 and out2 != expected(turn2, GREEDY)[0]


def test_concurrent_requests_of_one_session_the_second_prefills_in_full(make):
    eng, gpu = make(4)
    prompt = words(30, 9)
    out1 = run(eng, prompt, session_id="s")[0]
    first, second = prompt + out1 + words(6, 10), prompt + out1 + words(8, 11)
    q, q2 = SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=10, ignore_eos=True)
    g1, g2 = eng.generate(first, q, session_id="s"), eng.generate(second, q2, session_id="s")
    outs = [list(g1), list(g2)]
    assert (g1.reused_tokens, g2.reused_tokens) == (len(prompt) + len(out1) - 1, 0)
    assert sorted(prefilled(gpu, 2)) == sorted([7, len(second)])
    assert_fresh(outs[0], g1, first, q)
    assert_fresh(outs[1], g2, second, q2)
    # the second ended while the first held the session: the entry is the first's, and it continues
    assert eng.sessions._entries["s"].tokens.tolist() == (first + outs[0])[:len(first) + 29]
    turn3 = first + outs[0] + words(2, 12)
    out3, gen = run(eng, turn3, session_id="s")
    assert gen.reused_tokens == len(first) + 29
    assert_fresh(out3, gen, turn3, GREEDY)
    s = eng.session_stats()
    assert (s.hits, s.misses, s.sessions) == (2, 2, 1)


def test_sessions_in_different_slots_at_once_each_restore_their_own_kv(make):
    eng, gpu = make(4)
    sids = ["a", "b", "c"]
    turns = {sid: words(20 + 5 * i, 20 + i) for i, sid in enumerate(sids)}
    for round_ in range(3):
        order = sids if round_ % 2 == 0 else sids[::-1]  # each turn 2 lands in a slot another session used
        gens = {sid: eng.generate(turns[sid], GREEDY, session_id=sid) for sid in order}
        outs = {sid: list(g) for sid, g in gens.items()}
        for sid, g in gens.items():
            assert_fresh(outs[sid], g, turns[sid], GREEDY)
            assert g.reused_tokens == (0 if round_ == 0 else len(turns[sid]) - 4)  # 3 new + last output
            turns[sid] = turns[sid] + outs[sid] + words(3, 100 * round_ + ord(sid))
    s = eng.session_stats()
    assert (s.hits, s.misses, s.sessions) == (6, 3, 3)


def test_a_session_ending_mid_launch_is_kept_and_the_others_resume_exactly(make):
    eng, gpu = make(3, step_s=2e-3)
    long_q = SamplingParams(max_tokens=400, ignore_eos=True)
    others, prompt = [words(25, 30), words(35, 33)], words(30, 31)
    longs = [eng.generate(p, long_q) for p in others]  # two, so that no lone slot moves to the single build
    heads = [[next(g) for _ in range(5)] for g in longs]
    t0 = time.monotonic()
    out1, gen = run(eng, prompt, session_id="m")  # joins the long requests' launch, ends inside it
    turn2 = prompt + out1 + words(5, 32)
    out2, gen2 = run(eng, turn2, session_id="m")
    assert time.monotonic() - t0 < 0.5  # not after the long requests (~0.8 s of steps)
    assert not any(tuple(p) in gpu.finished for p in others)  # the long requests still decode
    assert gen2.reused_tokens == len(prompt) + len(out1) - 1
    assert_fresh(out1, gen, prompt, GREEDY)
    assert_fresh(out2, gen2, turn2, GREEDY)
    for g, h, p in zip(longs, heads, others):
        assert_fresh(h + list(g), g, p, long_q)
    # per turn only its join made the long requests' launch yield: keeping turn 1's KV cost no relaunch
    # (it was copied at turn 2's join, before turn 2 was admitted)
    assert gpu.yields == 2


def test_the_byte_bound_evicts_least_recently_used_sessions(make):
    eng, gpu = make(2, session_cache_bytes=1000)
    a, b = words(30, 40), words(30, 41)  # 30 + 8 - 1 = 37 rows each: 592 bytes, one fits
    q = SamplingParams(max_tokens=8, ignore_eos=True)
    out_a = run(eng, a, q, "a")[0]
    out_b = run(eng, b, q, "b")[0]
    assert eng.sessions.resident() == ["b"]
    s = eng.session_stats()
    assert (s.evictions, s.sessions, s.bytes) == (1, 1, 37 * ROW_BYTES)
    turn2 = a + out_a + words(3, 42)
    out, gen = run(eng, turn2, q, "a")
    assert gen.reused_tokens == 0 and prefilled(gpu) == [len(turn2)]  # evicted: a full prefill
    assert_fresh(out, gen, turn2, q)
    assert eng.sessions.resident() == ["a"]  # 48 rows: b had to go
    turn2 = b + out_b + words(3, 43)
    assert run(eng, turn2, q, "b")[1].reused_tokens == 0
    tiny, gpu2 = make(2, session_cache_bytes=100)  # an entry larger than the whole budget is not kept
    out, gen = run(tiny, a, q, "a")
    assert_fresh(out, gen, a, q)
    assert tiny.session_stats().sessions == 0 and run(tiny, a + out, q, "a")[1].reused_tokens == 0


def test_cancel_or_close_mid_turn_drops_the_session_and_the_next_turn_is_a_correct_miss(make):
    eng, gpu = make(2)
    prompt = words(40, 50)
    out1 = run(eng, prompt, session_id="c")[0]
    turn2 = prompt + out1 + words(6, 51)
    gen = eng.generate(turn2, SamplingParams(max_tokens=400, ignore_eos=True), session_id="c")
    got = [next(gen) for _ in range(3)]
    assert gen.reused_tokens == len(prompt) + len(out1) - 1
    gen.cancel()
    got += list(gen)
    assert gen.finish_reason is FinishReason.CANCELLED and got == expected(turn2, GREEDY)[0][:len(got)]
    assert "c" not in eng.sessions.resident()
    turn3 = turn2 + got + words(4, 52)
    out3, gen = run(eng, turn3, session_id="c")
    assert gen.reused_tokens == 0 and prefilled(gpu) == [len(turn3)]
    assert_fresh(out3, gen, turn3, GREEDY)
    closed = eng.generate(turn3 + out3 + [5], SamplingParams(max_tokens=400, ignore_eos=True), session_id="c")
    next(closed)
    closed.close()  # the client went away
    end = time.monotonic() + 2
    while eng.session_stats().sessions:
        assert time.monotonic() < end, "a closed turn's session entry was kept"
        time.sleep(1e-3)


def test_a_failed_turn_drops_the_session(make):
    eng, gpu = make(2)
    prompt = words(30, 60)
    out1 = run(eng, prompt, session_id="f")[0]
    pf = eng._prefill[0]
    real = pf.run

    def broken(ids, all_logits=False, start=0):
        pf.run = real
        raise RuntimeError("the GPU fell over")

    pf.run = broken
    turn2 = prompt + out1 + words(4, 61)
    with pytest.raises(RuntimeError, match="fell over"):
        run(eng, turn2, session_id="f")
    assert eng.session_stats().sessions == 0
    out, gen = run(eng, turn2, session_id="f")
    assert gen.reused_tokens == 0
    assert_fresh(out, gen, turn2, GREEDY)


def test_a_gpu_failure_before_a_kept_copy_ends_that_turn_normally_and_drops_its_entry(make):
    """Turn 1 ends mid-launch (its KV waits for the launch's end); the launch then fails: turn 1 had
    already ended with all its tokens, the requests in the launch get the error (the newcomer whose join
    ended it was not in it and is served), and the session's next turn is a correct miss."""
    eng, gpu = make(3, step_s=2e-3)
    long_q = SamplingParams(max_tokens=400, ignore_eos=True)
    longs = [eng.generate(p, long_q) for p in (words(25, 80), words(35, 81))]
    for g in longs:
        next(g)
    prompt = words(30, 82)
    out1, gen = run(eng, prompt, session_id="g")
    assert_fresh(out1, gen, prompt, GREEDY)
    assert eng.session_stats().sessions == 0  # not copied yet: the long requests' launch still runs
    real = gpu.synchronize

    def broken():
        gpu.synchronize = real
        real()
        raise RuntimeError("the GPU fell over")

    gpu.synchronize = broken
    newcomer = words(10, 83)
    out_n, gen_n = run(eng, newcomer)  # its join ends the launch, which fails; it was not in it yet
    assert_fresh(out_n, gen_n, newcomer, GREEDY)
    for g in longs:
        with pytest.raises(RuntimeError, match="fell over"):
            list(g)
    turn2 = prompt + out1 + words(4, 84)
    out, gen2 = run(eng, turn2, session_id="g")
    assert gen2.reused_tokens == 0 and eng.session_stats().sessions == 1
    assert_fresh(out, gen2, turn2, GREEDY)


def test_max_sessions_zero_turns_reuse_off(make):
    eng, gpu = make(2, max_sessions=0)
    prompt = words(30, 70)
    out1 = run(eng, prompt, session_id="z")[0]
    turn2 = prompt + out1 + words(5, 71)
    out2, gen = run(eng, turn2, session_id="z")
    assert gen.reused_tokens == 0 and prefilled(gpu) == [len(turn2)]
    assert_fresh(out2, gen, turn2, GREEDY)
    s = eng.session_stats()
    assert (s.hits, s.misses, s.sessions, s.max_sessions) == (0, 2, 0, 0)


def test_session_bounds_default_like_the_single_engine_and_bad_ones_are_refused():
    for name, default in (("session_cache_bytes", DEFAULT_MAX_BYTES), ("max_sessions", DEFAULT_MAX_SESSIONS)):
        for f in (BatchedMonokernelEngine.__init__, BatchedMonokernelEngine.from_pretrained,
                  MonokernelEngine.__init__, MonokernelEngine.from_pretrained):
            assert inspect.signature(f).parameters[name].default == default, (f, name)
    gpu = FakeBatchGpu(2)
    for bad in ({"session_cache_bytes": -1}, {"max_sessions": -1}):
        with pytest.raises(ValueError, match="session cache bounds must be >= 0"):
            BatchedMonokernelEngine(CFG, None, batch=2, **bad)  # before the GPU work (no tensors needed)
        with pytest.raises(ValueError, match="session cache bounds must be >= 0"):
            BatchedMonokernelEngine.from_pretrained("/no/such/checkpoint", batch=2, **bad)  # before reading
        with pytest.raises(ValueError, match="session cache bounds must be >= 0"):
            BatchedMonokernelEngine.around(CFG, gpu, lambda view: FakePrefill(gpu, view), **bad)
    eng = BatchedMonokernelEngine.around(CFG, gpu, lambda view: FakePrefill(gpu, view))
    try:
        s = eng.session_stats()
        assert (s.max_bytes, s.max_sessions, s.sessions) == (DEFAULT_MAX_BYTES, DEFAULT_MAX_SESSIONS, 0)
    finally:
        eng.close()


def test_the_replica_server_serves_and_reports_batched_sessions(make):
    """Over gRPC, as a replica with one batched engine per GPU (an EngineGroup) serves it: turn 2's
    usage counts the reused prompt tokens and WatchLoad's session stats count the hit."""
    (e0, _), (e1, _) = make(2), make(2)
    server = ReplicaServer(EngineGroup([e0, e1]))
    server.start()
    try:
        def ask(ids):
            req = replica_pb2.ReplicaGenerateRequest(prompt_token_ids=ids, session_id="g",
                                                     sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True))
            with grpc.insecure_channel(server.address) as ch:
                msgs = list(replica_pb2_grpc.ReplicaStub(ch).Generate(req, timeout=10))
            return [t for m in msgs[:-1] for t in m.chunk.token_ids], msgs[-1].final.usage

        q = SamplingParams(max_tokens=8, ignore_eos=True)
        prompt = words(30, 80)
        out1, usage = ask(prompt)
        assert out1 == expected(prompt, q)[0] and usage.cached_prompt_tokens == 0
        turn2 = prompt + out1 + words(4, 81)
        out2, usage = ask(turn2)
        assert out2 == expected(turn2, q)[0] and usage.cached_prompt_tokens == len(prompt) + len(out1) - 1
        load = server.load().session_cache
        assert (load.hits, load.misses, load.sessions) == (1, 1, 1)
        assert load.max_sessions == 2 * DEFAULT_MAX_SESSIONS  # the members' bounds, summed
    finally:
        server.stop(grace=0)
