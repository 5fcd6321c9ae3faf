"""monoserve's latency-aware dispatch policy as a Ray Serve custom request router.

Serve asks `choose_replicas` for ranked candidate lists; we rank with the same rules as the
monoserve router (`router.policy`): idle replicas first, then the lowest expected completion
time for this request, computed from each replica's reported load (`record_routing_stats` of
`deploy.serve_app.EngineReplica`) and the requests this handle has in flight there.

Plug it in with
    request_router_config=RequestRouterConfig(
        request_router_class="deploy.serve_router:LatencyAwareRequestRouter")
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from router.policy import ReplicaState, RequestShape, completion_s

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Candidate:
    """What the policy needs about one Serve replica."""

    key: str
    capacity: int
    in_flight: int | None  # requests this handle believes run there (None = unknown)
    stats: dict  # the replica's last record_routing_stats() (may be empty or stale)


def to_state(c: Candidate) -> ReplicaState:
    s = c.stats or {}
    busy = max(int(s.get("busy", 0)), c.in_flight or 0)
    return ReplicaState(
        address=c.key, capacity=max(c.capacity, 1), busy=busy, healthy=bool(s.get("healthy", True)),
        tokens_remaining=int(s.get("tokens_remaining", 0)), tpot_s=s.get("tpot_s"),
        prefill_s_per_token=s.get("prefill_s_per_token"),
        # the replica's estimate is stale once our own in-flight count disagrees with it
        expected_idle_s=s.get("expected_idle_s") if busy == int(s.get("busy", 0)) else None,
        reported_at=float(s.get("reported_at", 0.0)))


def rank(candidates: Sequence[Candidate], shape: RequestShape, now: float) -> list[list[str]]:
    """Candidate keys in preference order: ranks of one replica each (best first).

    Replicas with a free slot come first (idle before busy, then by expected completion of
    this request); full ones follow in the order they are expected to free up, so Serve can
    still queue on the soonest-free replica.
    """
    states = [to_state(c) for c in candidates]
    states = [s for s in states if s.healthy] or states  # all unhealthy: let Serve's retries decide

    def key(r: ReplicaState):
        return (not r.available, r.busy > 0, completion_s(r, shape, now), r.busy / r.capacity, r.address)

    return [[r.address] for r in sorted(states, key=key)]


def request_shape(pending: PendingRequest | None) -> RequestShape:
    """Prompt length and max_tokens from `EngineReplica.generate(prompt_ids, params)` args."""
    try:
        prompt_ids, params = pending.args[0], pending.args[1]
        return RequestShape(prompt_tokens=len(prompt_ids), max_tokens=int(params.max_tokens))
    except (AttributeError, IndexError, TypeError, ValueError):
        return RequestShape(prompt_tokens=1, max_tokens=DEFAULT_MAX_TOKENS)


class LatencyAwareRequestRouter(FIFOMixin, RequestRouter):
    """Idle first, then soonest expected completion (see module docstring)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        candidates = [Candidate(key, r.max_ongoing_requests, cache.get(r.replica_id), r.routing_stats)
                      for key, r in by_key.items()]
        ranks = rank(candidates, request_shape(pending_request), time.time())
        return [[by_key[k] for k in group] for group in ranks]
