"""Agent-session KV reuse: the LRU's rules, and the reference engine's outputs with reuse equal a
fresh full-prompt request (greedy and seeded), whatever the next prompt does to the stored prefix."""

import threading

import numpy as np
import pytest

from replicas.engine import SamplingParams, accepts_session_id
from replicas.reference import ReferenceEngine
from replicas.session_cache import SessionCache
from replicas.testing import PacedEngine

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


# ---- the LRU on its own ----------------------------------------------------------------------

def test_reuses_the_longest_common_prefix_and_leaves_one_token_to_prefill():
    cache = SessionCache()
    assert cache.acquire("s", [1, 2, 3]).kv is None  # nothing stored yet: a miss
    cache.release(cache.acquire("s", [1, 2, 3]), "kv-a", [1, 2, 3, 4], 10)
    lease = cache.acquire("s", [1, 2, 3, 4, 5, 6])
    assert (lease.kv, lease.reused) == ("kv-a", 4)  # extends the stored tokens
    cache.release(lease, "kv-b", [1, 2, 3, 4, 5], 10)
    lease = cache.acquire("s", [1, 2, 3, 4, 5])  # same prompt again: the last position is recomputed
    assert lease.reused == 4
    cache.release(lease, "kv-c", [1, 2, 3, 4, 5], 10)
    lease = cache.acquire("s", [1, 2, 9, 9])  # diverges after two tokens
    assert (lease.kv, lease.reused) == ("kv-c", 2)
    cache.release(lease, "kv-d", [1, 2, 9], 10)
    lease = cache.acquire("s", [7, 8])  # nothing in common: fresh, the old entry is gone
    assert lease.kv is None and cache.resident() == []
    s = cache.stats()
    assert (s.hits, s.misses, s.reused_tokens) == (3, 3, 4 + 4 + 2)


def test_reusable_says_what_acquire_would_reuse_without_claiming_or_counting():
    cache = SessionCache()
    assert cache.reusable("s", [1, 2, 3]) == 0  # nothing stored
    cache.release(cache.acquire("s", [1, 2, 3]), "kv", [1, 2, 3, 4], 10)
    before = cache.stats()
    assert cache.reusable("s", [1, 2, 3, 4, 5, 6]) == 4
    assert cache.reusable("s", [1, 2, 3, 4]) == 3  # one position is always left to prefill
    assert cache.reusable("s", [7]) == 0 and cache.reusable("other", [1, 2]) == 0
    assert cache.stats() == before and cache.resident() == ["s"]  # no hit, miss or eviction counted
    lease = cache.acquire("s", [1, 2, 3, 4, 5])
    assert lease.reused == 4 and cache.reusable("s", [1, 2, 3, 4, 5]) == 0  # lent out: not reusable now


def test_lru_bounds_by_count_and_bytes_never_evicting_a_session_in_use():
    cache = SessionCache(max_bytes=100, max_sessions=2)
    held = cache.acquire("busy", [1, 2])
    cache.release(held, "kv", [1, 2], 40)
    held = cache.acquire("busy", [1, 2, 3])  # lent to a running generation now
    for sid in ("a", "b", "c"):
        cache.release(cache.acquire(sid, [1, 2]), sid, [1, 2], 40)
    assert set(cache.resident()) == {"busy", "c"}  # a, b evicted (LRU) though busy is the oldest
    cache.release(cache.acquire("big", [1]), "big", [1], 101)  # larger than the whole budget
    assert "big" not in cache.resident()
    cache.release(held, "kv2", [1, 2, 3], 60)
    assert cache.resident() == ["busy"]  # 60 + 40 + ... > 100: c went, busy (most recent) stays
    assert cache.stats().evictions == 4 and cache.stats().bytes == 60


def test_a_second_concurrent_request_of_a_session_does_not_overwrite_the_lent_entry():
    cache = SessionCache()
    cache.release(cache.acquire("s", [1]), "old", [1, 2, 3], 1)
    first = cache.acquire("s", [1, 2, 3, 4])
    second = cache.acquire("s", [1, 2, 3, 4])
    assert first.kv == "old" and second.kv is None  # the entry is lent once
    cache.release(second, "second", [1, 2, 3, 4], 1)  # ends first: skipped
    cache.release(first, "first", [1, 2, 3, 4, 5], 1)
    assert cache.acquire("s", [1, 2, 3, 4, 5, 6]).kv == "first"


def test_a_failed_generation_drops_its_entry_and_zero_sessions_turns_reuse_off():
    cache = SessionCache()
    cache.release(cache.acquire("s", [1]), "kv", [1, 2], 1)
    cache.discard(cache.acquire("s", [1, 2, 3]))
    assert cache.resident() == []
    off = SessionCache(max_sessions=0)
    off.release(off.acquire("s", [1]), "kv", [1, 2], 1)
    assert off.acquire("s", [1, 2, 3]).kv is None and off.stats().misses == 2
    with pytest.raises(ValueError, match="max_bytes"):
        SessionCache(max_bytes=-1)


# ---- the reference engine ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return ReferenceEngine.from_pretrained(tiny_checkpoint, max_batch=2)


def words(n, seed):
    return np.random.default_rng(seed).integers(3, 2000, n).tolist()


def run(engine, prompt, params, session_id=None):
    gen = engine.generate(prompt, params, session_id=session_id) if session_id else engine.generate(prompt, params)
    return list(gen), gen


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_three_turns_reuse_kv_and_equal_fresh_full_prompt_requests(engine, params):
    sid = f"agent-{params.temperature}"
    prompt = words(700, 1)  # longer than one prefill chunk
    before = engine.session_stats()
    new: list[int] = []
    for turn in range(3):
        out, gen = run(engine, prompt, params, sid)
        fresh, _ = run(engine, prompt, params)
        assert out == fresh, f"turn {turn + 1} differs from a fresh request"
        if turn == 0:
            assert gen.reused_tokens == 0
        else:  # everything but the new message and the previous turn's last output token (never fed)
            assert gen.reused_tokens == len(prompt) - len(new) - 1
        new = words(40, turn + 10)
        prompt = prompt + out + new
    after = engine.session_stats()
    assert after.hits - before.hits == 2 and after.misses - before.misses == 1


def test_a_prompt_that_rewrites_history_reuses_only_the_common_prefix(engine):
    base = words(300, 2)
    run(engine, base, GREEDY, "edit")
    edited = base[:100] + words(50, 3)  # the agent rewrote its context after token 100
    got, gen = run(engine, edited, GREEDY, "edit")
    assert gen.reused_tokens == 100 and got == run(engine, edited, GREEDY)[0]
    retry, gen = run(engine, edited, GREEDY, "edit")  # the same prompt again
    assert gen.reused_tokens == len(edited) - 1 and retry == got


def test_a_cancelled_turn_leaves_usable_kv(engine):
    prompt = words(200, 4)
    gen = engine.generate(prompt, SamplingParams(max_tokens=50, ignore_eos=True), session_id="cut")
    partial = [next(gen) for _ in range(5)]
    gen.close()  # the client went away after 5 tokens
    nxt = prompt + partial + words(20, 5)
    out, gen = run(engine, nxt, GREEDY, "cut")
    assert gen.reused_tokens == len(prompt) + 4 and out == run(engine, nxt, GREEDY)[0]


def test_eviction_under_pressure_only_costs_a_fresh_prefill(tiny_checkpoint):
    small = ReferenceEngine.from_pretrained(tiny_checkpoint, max_sessions=1)
    prompts = {"a": words(100, 6), "b": words(100, 7)}
    for _ in range(2):
        for sid, p in prompts.items():
            out, gen = run(small, p, GREEDY, sid)
            assert gen.reused_tokens == 0 and out == run(small, p, GREEDY)[0]
            prompts[sid] = p + out
    s = small.session_stats()
    assert (s.hits, s.misses, s.evictions, s.sessions) == (0, 4, 3, 1)


def test_concurrent_turns_of_one_session_are_both_correct(engine):
    prompt = words(150, 8)
    run(engine, prompt, GREEDY, "twin")
    results = {}

    def turn(i):
        results[i] = run(engine, prompt + [100 + i], GREEDY, "twin")[0]

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert results[i] == run(engine, prompt + [100 + i], GREEDY)[0]


def test_engines_without_sessions_are_recognised():
    assert not accepts_session_id(PacedEngine())
    assert accepts_session_id(ReferenceEngine.__new__(ReferenceEngine))


def test_bounds_and_leases_hold_under_any_sequence_of_turns():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ops = st.lists(st.tuples(st.sampled_from("abcd"), st.booleans(), st.integers(1, 40), st.integers(0, 3)),
                   max_size=60)

    @settings(max_examples=100, deadline=None)
    @given(ops)
    def check(steps):
        cache = SessionCache(max_bytes=100, max_sessions=3)
        open_leases = {}
        for sid, finish, nbytes, extra in steps:
            if sid in open_leases and finish:  # a running turn ends and hands its KV back
                lease, prompt = open_leases.pop(sid)
                cache.release(lease, (sid, len(prompt) + extra), prompt + [7] * extra, nbytes)
            elif sid not in open_leases:  # a turn starts
                prompt = list(range(1 + extra * 5))
                lease = cache.acquire(sid, prompt)
                assert 0 <= lease.reused < len(prompt)
                assert lease.kv is None or lease.kv[0] == sid  # never another session's KV
                open_leases[sid] = (lease, prompt)
            idle = [s for s in cache.resident() if s not in open_leases]
            stats = cache.stats()
            for s, (lease, _) in open_leases.items():  # lent entries are never dropped
                assert lease._entry is None or s in cache.resident()
            # only KV lent to running turns may keep the cache past its bounds: no idle entry then
            assert (stats.bytes <= 100 and stats.sessions <= 3) or not idle

    check()
