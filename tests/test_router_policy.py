"""Dispatch policy: pure decisions over fake replica snapshots (no I/O, injected clock)."""

from router.policy import ReplicaState, RequestShape, Snapshot, estimate_wait_s, pick_replica


def rep(address, busy=0, capacity=1, **kw):
    return ReplicaState(address=address, capacity=capacity, busy=busy, **kw)


REQ = RequestShape(prompt_tokens=10, max_tokens=100)


def test_idle_replica_beats_busy_one_with_free_slot():
    snap = Snapshot((rep("a", busy=1, capacity=4, tokens_remaining=1, tpot_s=0.001), rep("b", tpot_s=0.05)))
    assert pick_replica(snap, REQ, now=0.0) == "b"


def test_lowest_expected_completion_among_busy_replicas():
    fast_but_loaded = rep("a", busy=1, capacity=2, tokens_remaining=1000, tpot_s=0.01)
    lightly_loaded = rep("b", busy=1, capacity=2, tokens_remaining=10, tpot_s=0.01)
    assert pick_replica(Snapshot((fast_but_loaded, lightly_loaded)), REQ, now=0.0) == "b"


def test_tpot_by_occupancy_is_used_when_reported():
    # a slows down sharply with a second request; b barely does
    a = rep("a", busy=1, capacity=2, tokens_remaining=10, tpot_by_busy=(0.01, 0.10))
    b = rep("b", busy=1, capacity=2, tokens_remaining=10, tpot_by_busy=(0.01, 0.012))
    assert pick_replica(Snapshot((a, b)), REQ, now=0.0) == "b"


def test_unhealthy_draining_and_full_replicas_are_skipped():
    snap = Snapshot((rep("sick", healthy=False), rep("leaving", draining=True), rep("full", busy=1)))
    assert pick_replica(snap, REQ, now=0.0) is None
    snap = Snapshot(snap.replicas + (rep("ok", busy=1, capacity=2),))
    assert pick_replica(snap, REQ, now=0.0) == "ok"


def test_excluded_replica_is_not_picked():
    snap = Snapshot((rep("a"), rep("b")))
    assert pick_replica(snap, REQ, now=0.0, exclude={"a"}) == "b"
    assert pick_replica(snap, REQ, now=0.0, exclude={"a", "b"}) is None


def test_session_affinity_wins_when_within_saved_prefill():
    req = RequestShape(prompt_tokens=4000, max_tokens=10, session_id="s1")
    # sticky replica is busier by less than the prefill it saves (4000 * 0.5 ms = 2 s)
    sticky = rep("sticky", busy=1, capacity=2, tokens_remaining=100, tpot_s=0.01, prefill_s_per_token=0.0005)
    other = rep("other", busy=1, capacity=2, tokens_remaining=10, tpot_s=0.01, prefill_s_per_token=0.0005)
    assert pick_replica(Snapshot((sticky, other), {"s1": "sticky"}), req, now=0.0) == "sticky"
    # ... but not when it is worse by more than that
    swamped = rep("sticky", busy=1, capacity=2, tokens_remaining=10_000, tpot_s=0.01, prefill_s_per_token=0.0005)
    assert pick_replica(Snapshot((swamped, other), {"s1": "sticky"}), req, now=0.0) == "other"
    # an unknown session falls back to the normal ranking
    assert pick_replica(Snapshot((sticky, other), {"s2": "sticky"}), req, now=0.0) == "other"


def test_backlog_ages_with_the_injected_clock():
    a = rep("a", busy=1, capacity=2, expected_idle_s=10.0, reported_at=0.0)
    b = rep("b", busy=1, capacity=2, expected_idle_s=5.0, reported_at=8.0)
    # at t=8: a has 2 s left, b has 5 s left
    assert pick_replica(Snapshot((a, b)), REQ, now=8.0) == "a"
    assert pick_replica(Snapshot((a, b)), REQ, now=0.0) == "b"


def test_estimate_wait_simulates_the_queue():
    one = [rep("a", busy=1, tokens_remaining=100, tpot_s=0.01, prefill_s_per_token=0.0)]
    assert estimate_wait_s(one, [], now=0.0) == 1.0  # slot frees after 100 tokens
    ahead = [RequestShape(prompt_tokens=0, max_tokens=50)]
    assert estimate_wait_s(one, ahead, now=0.0) == 1.5
    assert estimate_wait_s([rep("a"), rep("b")], [REQ], now=0.0) == 0.0  # a second slot is idle
    assert estimate_wait_s([rep("a", healthy=False)], [], now=0.0) is None
