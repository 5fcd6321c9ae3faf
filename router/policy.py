"""Dispatch policy: which replica should serve a request now — a pure function over a snapshot.

Nothing here does I/O or reads a clock: the pool builds an immutable `ReplicaState` per replica
from its latest pushed load report (`WatchLoad`) plus the router's own in-flight count, and the
caller passes `now` (same clock as `ReplicaState.reported_at`). That makes every decision
reproducible in a unit test.

Rules (see DESIGN.md, Router):
- only healthy, non-draining replicas with a free slot are candidates;
- an idle replica (nothing running) beats a busy one;
- among the rest, lowest expected completion time:
  backlog (tokens remaining x TPOT at current occupancy) + this request's prefill + decode;
- session affinity: the replica that last served `session_id` (its engine keeps the session's KV)
  wins if its expected completion is no worse than the best's by more than the prefill it saves:
  its prefill rate x the tokens it would reuse (what it held after the last turn, at most the
  prompt - 1). If that replica is full, the request waits for it (None) under the same rule —
  its slot-wait counts as backlog — but not once its own estimate of when it frees has passed;
- None when no replica can take the request now (the caller queues it).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Used until a replica has reported a measured value (a fresh replica, a cold router).
DEFAULT_TPOT_S = 0.02
DEFAULT_PREFILL_S_PER_TOKEN = 0.0005


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows about one replica at one moment (immutable)."""

    address: str
    capacity: int  # generation slots
    busy: int  # slots in use (max of the replica's report and the router's own in-flight count)
    healthy: bool = True
    draining: bool = False
    tokens_remaining: int = 0  # sum over running generations of max_tokens - generated
    tpot_s: float | None = None  # EWMA seconds per output token; None = not measured yet
    # Optional TPOT per occupancy: tpot_by_busy[k-1] = seconds per token with k busy slots.
    tpot_by_busy: tuple[float, ...] = ()
    prefill_s_per_token: float | None = None
    expected_idle_s: float | None = None  # replica's own estimate, measured at reported_at
    reported_at: float = 0.0  # when the load report arrived (caller's clock)

    @property
    def free_slots(self) -> int:
        return max(0, self.capacity - self.busy)

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining and self.free_slots > 0

    def tpot_at(self, occupancy: int) -> float:
        """Seconds per token when `occupancy` slots are busy."""
        if self.tpot_by_busy:
            k = min(max(occupancy, 1), len(self.tpot_by_busy))
            return self.tpot_by_busy[k - 1]
        return self.tpot_s if self.tpot_s is not None else DEFAULT_TPOT_S

    def prefill_s(self, prompt_tokens: int) -> float:
        per_token = self.prefill_s_per_token if self.prefill_s_per_token is not None else DEFAULT_PREFILL_S_PER_TOKEN
        return prompt_tokens * per_token

    def backlog_s(self, now: float) -> float:
        """Expected seconds until the work running now is done (ages with the report)."""
        if self.busy == 0:
            return 0.0
        if self.expected_idle_s is not None:
            estimate = self.expected_idle_s
        else:
            estimate = self.tokens_remaining * self.tpot_at(self.busy)
        return max(0.0, estimate - max(0.0, now - self.reported_at))


@dataclass(frozen=True)
class RequestShape:
    """What the policy needs to know about a request."""

    prompt_tokens: int
    max_tokens: int
    session_id: str = ""


@dataclass(frozen=True)
class Snapshot:
    """The pool as the policy sees it: replica states plus session -> last replica."""

    replicas: tuple[ReplicaState, ...]
    sessions: dict[str, str] = field(default_factory=dict)  # session_id -> replica address
    # session_id -> tokens that replica holds for it (last prompt + output); absent = the whole prompt
    session_tokens: dict[str, int] = field(default_factory=dict)


def completion_s(replica: ReplicaState, request: RequestShape, now: float) -> float:
    """Expected seconds until `request` would finish if sent to `replica` now."""
    decode = request.max_tokens * replica.tpot_at(replica.busy + 1)
    return replica.backlog_s(now) + replica.prefill_s(request.prompt_tokens) + decode


def pick_replica(snapshot: Snapshot, request: RequestShape, now: float,
                 exclude: Iterable[str] = ()) -> str | None:
    """Address of the replica to send `request` to now, or None if none can take it."""
    excluded = set(exclude)
    candidates = [r for r in snapshot.replicas if r.available and r.address not in excluded]
    if not candidates:
        return None

    def rank(r: ReplicaState):
        # idle first; then expected completion; ties -> least loaded, then a stable order
        return (r.busy > 0, completion_s(r, request, now), r.busy / r.capacity, r.address)

    best = min(candidates, key=rank)
    sticky = _session_replica(snapshot, request, now, excluded)
    if sticky is not None and sticky.address != best.address:
        held = snapshot.session_tokens.get(request.session_id, request.prompt_tokens)
        saved = sticky.prefill_s(max(0, min(held, request.prompt_tokens - 1)))
        if completion_s(sticky, request, now) - saved <= completion_s(best, request, now):
            return sticky.address if sticky.available else None  # None: worth waiting for its slot
    return best.address


def _session_replica(snapshot: Snapshot, request: RequestShape, now: float,
                     excluded: set[str]) -> ReplicaState | None:
    """The replica holding the request's session KV, if it may serve it now or once a slot frees
    (a full one whose estimated backlog has run out is overdue: we cannot tell when it frees)."""
    address = snapshot.sessions.get(request.session_id) if request.session_id else None
    for r in snapshot.replicas:
        if r.address == address and address not in excluded and r.healthy and not r.draining \
                and (r.available or (r.capacity > 0 and r.backlog_s(now) > 0)):
            return r
    return None


def estimate_wait_s(replicas: Sequence[ReplicaState], ahead: Sequence[RequestShape], now: float) -> float | None:
    """Expected seconds until a request queued behind `ahead` gets a slot; None if no replica serves.

    Simulates the queue: every slot of every healthy non-draining replica frees at its
    backlog time; each waiter ahead takes the earliest slot and holds it for its own expected
    work.
    """
    slots: list[tuple[float, int]] = []  # (time the slot frees, replica index)
    for i, r in enumerate(replicas):
        if not r.healthy or r.draining or r.capacity <= 0:
            continue
        backlog = r.backlog_s(now)
        slots += [(0.0, i)] * r.free_slots + [(backlog, i)] * min(r.busy, r.capacity)
    if not slots:
        return None
    heapq.heapify(slots)
    for req in ahead:
        free_at, i = heapq.heappop(slots)
        r = replicas[i]
        work = r.prefill_s(req.prompt_tokens) + req.max_tokens * r.tpot_at(r.capacity)
        heapq.heappush(slots, (free_at + work, i))
    return slots[0][0]
