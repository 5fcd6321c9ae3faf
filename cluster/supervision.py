"""Supervision and autoscaling decisions: a pure function over a snapshot of the cluster.

`plan(snapshot, memory, policy)` looks at the replicas the supervisor manages and the router's
queue, and returns the actions to take plus the updated memory (timers). It does no I/O and
reads no clock (`snapshot.now` is the clock), so every rule is unit-testable with fakes; the
loop in `cluster/supervisor.py` only gathers snapshots and executes actions.

Rules, in order:
1. A replica that died, stopped answering health checks for `health_timeout_s`, or did not get
   ready within `start_timeout_s` is removed (its running requests fail over in the router).
2. A ready replica that the router does not know yet is registered.
3. Fewer live replicas than the target -> start the missing ones (this is how a dead replica
   gets replaced). Replicas that fail to start (bad checkpoint, no GPUs) are retried with
   exponential backoff until one gets ready again.
4. Router queue non-empty for `scale_up_after_s` (and nothing already starting) -> target + 1,
   up to max.
5. Queue empty and a replica idle for `scale_down_idle_s` -> target - 1 (down to min), drain
   the replica idle longest (the router stops sending to it, running requests finish).
6. A draining replica with nothing running is retired (actor stopped, GPUs released).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class Phase(str, enum.Enum):
    STARTING = "starting"  # actor created, engine loading
    READY = "ready"  # serving (registered with the router or about to be)
    DRAINING = "draining"  # no new requests; running ones finish
    DEAD = "dead"  # the actor died or its start failed


@dataclass(frozen=True)
class ReplicaView:
    """One managed replica as the supervisor sees it in one round."""

    name: str
    phase: Phase
    started_at: float
    address: str | None = None  # "host:port" once ready
    registered: bool = False  # in the router's pool
    busy: int = 0  # requests running on it (max of replica's and router's count)
    last_healthy_at: float | None = None  # last successful health check


@dataclass(frozen=True)
class Snapshot:
    now: float
    replicas: tuple[ReplicaView, ...]
    queue_depth: int = 0  # requests waiting in the router queue


@dataclass(frozen=True)
class Policy:
    min_replicas: int = 1
    max_replicas: int = 1
    autoscale: bool = True
    scale_up_after_s: float = 5.0
    scale_down_idle_s: float = 60.0
    health_timeout_s: float = 10.0
    start_timeout_s: float = 600.0
    start_backoff_s: float = 1.0  # wait after the first failed start; doubles per failure
    max_start_backoff_s: float = 60.0


@dataclass(frozen=True)
class Memory:
    """What the supervisor remembers between rounds (timers and the target count)."""

    target: int
    queue_busy_since: float | None = None  # when the router queue became non-empty
    idle_since: dict[str, float] = field(default_factory=dict)  # ready replica -> idle since
    start_failures: int = 0  # failed starts since a replica last got ready
    last_failure_at: float | None = None
    start_not_before: float = float("-inf")  # backoff: no new replica before this time


@dataclass(frozen=True)
class Start:
    count: int


@dataclass(frozen=True)
class Register:
    name: str


@dataclass(frozen=True)
class Drain:
    name: str


@dataclass(frozen=True)
class Remove:
    """Stop the replica and release its GPUs. `reason` is shown in logs/status."""

    name: str
    reason: str


Action = Start | Register | Drain | Remove


def initial_memory(policy: Policy) -> Memory:
    return Memory(target=policy.min_replicas)


def plan(snap: Snapshot, memory: Memory, policy: Policy) -> tuple[list[Action], Memory]:
    now = snap.now
    actions: list[Action] = []
    live: list[ReplicaView] = []  # starting or ready after rule 1

    # 1. remove the dead, the unresponsive and the stuck
    failures, last_failure_at, not_before = memory.start_failures, memory.last_failure_at, memory.start_not_before
    if failures and any(r.phase is Phase.READY and r.started_at > (last_failure_at or 0) for r in snap.replicas):
        failures = 0  # a replica started after the last failure got ready: starting works again
    for r in snap.replicas:
        reason = _failure(r, now, policy)
        if reason:
            actions.append(Remove(r.name, reason))
            if r.address is None:  # never got ready: a failed start
                failures += 1
                last_failure_at = now
                not_before = now + min(policy.max_start_backoff_s, policy.start_backoff_s * 2 ** (failures - 1))
        elif r.phase in (Phase.STARTING, Phase.READY):
            live.append(r)

    # 2. register ready replicas the router does not know
    actions += [Register(r.name) for r in live if r.phase is Phase.READY and not r.registered]

    # timers: queue non-empty since, replica idle since
    queue_busy_since = None
    if snap.queue_depth > 0:
        queue_busy_since = now if memory.queue_busy_since is None else memory.queue_busy_since
    idle_since = {
        r.name: memory.idle_since.get(r.name, now)
        for r in live
        if r.phase is Phase.READY and r.registered and r.busy == 0
    }
    target = max(policy.min_replicas, min(memory.target, policy.max_replicas))
    starting = [r for r in live if r.phase is Phase.STARTING]
    draining = [r for r in snap.replicas if r.phase is Phase.DRAINING and not _failure(r, now, policy)]

    # 4. scale up: the queue stayed non-empty long enough and nothing is on its way already
    if (policy.autoscale and queue_busy_since is not None and not starting
            and now - queue_busy_since >= policy.scale_up_after_s and target < policy.max_replicas):
        target += 1
        queue_busy_since = now  # the next step up needs another full period of queueing

    # 5. scale down: nothing queued, one replica idle long enough, nothing else changing
    elif (policy.autoscale and snap.queue_depth == 0 and not starting and not draining
          and target > policy.min_replicas and len(live) >= target):
        idle = [(since, name) for name, since in idle_since.items() if now - since >= policy.scale_down_idle_s]
        if idle:
            _, name = min(idle)
            actions.append(Drain(name))
            target -= 1
            live = [r for r in live if r.name != name]
            idle_since.pop(name)

    # 3. start what is missing (replacements and scale-up)
    missing = target - len(live)
    if missing > 0 and now >= not_before:
        actions.append(Start(missing))

    # 6. retire drained replicas
    actions += [Remove(r.name, "drained") for r in draining if r.busy == 0]

    return actions, replace(memory, target=target, queue_busy_since=queue_busy_since, idle_since=idle_since,
                            start_failures=failures, last_failure_at=last_failure_at, start_not_before=not_before)


def _failure(r: ReplicaView, now: float, policy: Policy) -> str | None:
    """Why this replica must be removed now, or None."""
    if r.phase is Phase.DEAD:
        return "died"
    if r.phase is Phase.STARTING and now - r.started_at > policy.start_timeout_s:
        return f"not ready after {policy.start_timeout_s:g}s"
    if r.phase in (Phase.READY, Phase.DRAINING):
        last = r.last_healthy_at if r.last_healthy_at is not None else r.started_at
        if now - last > policy.health_timeout_s:
            return f"no healthy answer for {now - last:.0f}s"
    return None
