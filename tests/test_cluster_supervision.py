"""The supervision rules as a pure function: snapshots in, actions out (no Ray, no clock)."""

from cluster.supervision import (
    Drain,
    Memory,
    Phase,
    Policy,
    Register,
    Remove,
    ReplicaView,
    Snapshot,
    Start,
    plan,
)

POLICY = Policy(min_replicas=1, max_replicas=3, scale_up_after_s=5, scale_down_idle_s=30,
                health_timeout_s=10, start_timeout_s=100)


def ready(name, busy=0, registered=True, healthy_at=None, started_at=0.0):
    return ReplicaView(name, Phase.READY, started_at, address=f"{name}:1", registered=registered, busy=busy,
                       last_healthy_at=healthy_at)


def run(replicas, now, memory=None, queue=0, policy=POLICY):
    memory = memory or Memory(target=policy.min_replicas)
    return plan(Snapshot(now=now, replicas=tuple(replicas), queue_depth=queue), memory, policy)


def test_starts_min_replicas_from_nothing():
    actions, mem = run([], now=0, policy=Policy(min_replicas=2, max_replicas=4))
    assert actions == [Start(2)] and mem.target == 2


def test_steady_state_does_nothing():
    actions, _ = run([ready("a", healthy_at=9)], now=10)
    assert actions == []


def test_registers_ready_replicas_the_router_does_not_know():
    actions, _ = run([ready("a", registered=False, healthy_at=1)], now=1)
    assert actions == [Register("a")]


def test_dead_replica_is_removed_and_replaced():
    dead = ReplicaView("a", Phase.DEAD, 0.0, address="a:1", registered=True)
    actions, mem = run([dead, ready("b", healthy_at=5)], now=5, memory=Memory(target=2))
    assert actions == [Remove("a", "died"), Start(1)] and mem.target == 2


def test_unresponsive_and_stuck_replicas_are_removed():
    silent = ready("a", healthy_at=1.0)
    stuck = ReplicaView("b", Phase.STARTING, started_at=0.0)
    actions, mem = run([silent, stuck], now=150, memory=Memory(target=2))
    assert Remove("a", "no healthy answer for 149s") in actions
    assert Remove("b", "not ready after 100s") in actions
    assert not any(isinstance(a, Start) for a in actions)  # a stuck start backs off first
    actions, _ = run([], now=151, memory=mem)
    assert actions == [Start(2)]


def test_scale_up_only_after_queue_stayed_busy_long_enough():
    reps = [ready("a", busy=1, healthy_at=4)]
    actions, mem = run(reps, now=0, queue=2)
    assert actions == [] and mem.queue_busy_since == 0
    actions, mem = run(reps, now=4.9, memory=mem, queue=2)
    assert actions == []
    actions, mem = run(reps, now=5.0, memory=mem, queue=1)
    assert actions == [Start(1)] and mem.target == 2


def test_queue_emptying_resets_the_scale_up_timer():
    reps = [ready("a", busy=1, healthy_at=0)]
    _, mem = run(reps, now=0, queue=1)
    _, mem = run(reps, now=3, memory=mem, queue=0)
    assert mem.queue_busy_since is None
    actions, mem = run(reps, now=6, memory=mem, queue=1)
    assert actions == []


def test_no_second_scale_up_while_one_is_starting_and_never_above_max():
    reps = [ready("a", busy=1, healthy_at=20), ReplicaView("b", Phase.STARTING, started_at=10)]
    actions, mem = run(reps, now=20, memory=Memory(target=2, queue_busy_since=0), queue=3)
    assert actions == [] and mem.target == 2
    full = [ready(n, busy=1, healthy_at=20) for n in "abc"]
    actions, mem = run(full, now=20, memory=Memory(target=3, queue_busy_since=0), queue=3)
    assert actions == [] and mem.target == 3


def test_scale_down_drains_the_longest_idle_then_retires_it_when_empty():
    reps = [ready("a", healthy_at=29), ready("b", healthy_at=29)]
    _, mem = run(reps, now=0, memory=Memory(target=2, idle_since={"b": 0.0}))
    assert mem.idle_since == {"a": 0.0, "b": 0.0}
    actions, mem = run(reps, now=29, memory=Memory(target=2, idle_since={"a": 5.0, "b": 0.0}))
    assert actions == []
    actions, mem = run(reps, now=30, memory=mem)  # `a` idle since 5, `b` since 0
    assert actions == [Drain("b")] and mem.target == 1
    # while it finishes a request it stays; once empty it is removed, and never restarted
    draining = ReplicaView("b", Phase.DRAINING, 0.0, address="b:1", busy=1, last_healthy_at=31)
    actions, mem = run([ready("a", healthy_at=31), draining], now=31, memory=mem)
    assert actions == []
    actions, mem = run([ready("a", healthy_at=32), replace_busy(draining, 0)], now=32, memory=mem)
    assert actions == [Remove("b", "drained")]


def replace_busy(view, busy):
    from dataclasses import replace

    return replace(view, busy=busy)


def test_never_scales_below_min_or_while_requests_wait():
    reps = [ready("a", healthy_at=100)]
    actions, _ = run(reps, now=100, memory=Memory(target=1, idle_since={"a": 0.0}))
    assert actions == []
    two = [ready("a", healthy_at=100), ready("b", healthy_at=100)]
    actions, _ = run(two, now=100, memory=Memory(target=2, idle_since={"a": 0.0, "b": 0.0}), queue=1)
    assert not any(isinstance(a, Drain) for a in actions)


def test_busy_replica_is_not_idle():
    reps = [ready("a", busy=1, healthy_at=100), ready("b", busy=1, healthy_at=100)]
    actions, mem = run(reps, now=100, memory=Memory(target=2, idle_since={"a": 0.0}))
    assert actions == [] and mem.idle_since == {}


def test_autoscale_off_keeps_min():
    policy = Policy(min_replicas=1, max_replicas=3, autoscale=False, scale_up_after_s=0)
    actions, mem = run([ready("a", busy=1, healthy_at=99)], now=100, memory=Memory(target=1, queue_busy_since=0),
                       queue=5, policy=policy)
    assert actions == [] and mem.target == 1


def test_failed_starts_are_retried_with_growing_backoff_until_one_gets_ready():
    def failed(name, started_at):
        return ReplicaView(name, Phase.DEAD, started_at)  # never got an address

    actions, mem = run([failed("a", 0)], now=10)
    assert actions == [Remove("a", "died")] and mem.start_failures == 1  # no restart before 11
    actions, mem = run([], now=10.5, memory=mem)
    assert actions == []
    actions, mem = run([], now=11, memory=mem)
    assert actions == [Start(1)]
    actions, mem = run([failed("b", 11)], now=12, memory=mem)
    assert actions == [Remove("b", "died")] and mem.start_not_before == 14  # backoff doubled
    actions, mem = run([], now=14, memory=mem)
    assert actions == [Start(1)]
    actions, mem = run([ready("c", started_at=14, healthy_at=15)], now=15, memory=mem)
    assert mem.start_failures == 0


def test_a_replica_dying_after_it_was_ready_is_replaced_at_once():
    dead = ReplicaView("a", Phase.DEAD, 0.0, address="a:1")
    actions, mem = run([dead], now=50)
    assert actions == [Remove("a", "died"), Start(1)] and mem.start_failures == 0
