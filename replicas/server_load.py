"""Slot accounting and pushed load of one replica server.

Everything here runs on the server's event-loop thread (no locks). A *change* (admission, finish,
drain, health) bumps `version` and wakes every WatchLoad stream at once; per-token progress only
updates counters and the TPOT average, so watchers are not flooded at thousands of tokens/s
(tokens_remaining in a pushed snapshot is exact as of that push).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from monoserve.v1 import common_pb2

EWMA_ALPHA = 0.1  # weight of the newest TPOT sample


@dataclass
class Slot:
    """One admitted generation's share of the load."""

    request_id: str
    max_tokens: int
    produced: int = 0

    @property
    def remaining(self) -> int:
        return max(self.max_tokens - self.produced, 0)


@dataclass
class LoadTracker:
    replica_id: str
    capacity: int
    draining: bool = False
    closed: bool = False  # the server is stopping: WatchLoad streams end
    healthy: bool = True
    version: int = 0
    tpot_ewma_s: float = 0.0
    prefill_s_per_token: float = 0.0
    slots: dict[str, Slot] = field(default_factory=dict)
    tpot_by_occupancy: list[float] = field(default_factory=list)  # seconds, index = busy - 1
    # engine.session_stats for engines that keep sessions' KV (read at every push), else None
    session_stats: Callable[[], object] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.tpot_by_occupancy = [0.0] * self.capacity

    # ---- admission -----------------------------------------------------------------------
    @property
    def busy(self) -> int:
        return len(self.slots)

    def has_free_slot(self) -> bool:
        return self.busy < self.capacity

    def admit(self, request_id: str, max_tokens: int) -> Slot:
        slot = Slot(request_id, max_tokens)
        self.slots[request_id] = slot
        self.changed()
        return slot

    def release(self, request_id: str) -> None:
        if self.slots.pop(request_id, None) is not None:
            self.changed()

    def set_draining(self, draining: bool) -> None:
        if draining != self.draining:
            self.draining = draining
            self.changed()

    def set_healthy(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            self.changed()

    def close(self) -> None:
        self.closed = True
        self.changed()

    # ---- measurements (no push) ----------------------------------------------------------
    def observe_tpot(self, seconds: float) -> None:
        self.tpot_ewma_s = _ewma(self.tpot_ewma_s, seconds)
        i = min(max(self.busy, 1), self.capacity) - 1
        self.tpot_by_occupancy[i] = _ewma(self.tpot_by_occupancy[i], seconds)

    def observe_prefill(self, seconds: float, prompt_tokens: int) -> None:
        self.prefill_s_per_token = _ewma(self.prefill_s_per_token, seconds / max(prompt_tokens, 1))

    # ---- publishing ----------------------------------------------------------------------
    def changed(self) -> None:
        """Bump the version and wake every watcher (a fresh Event for the next change)."""
        self.version += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    @property
    def change_event(self) -> asyncio.Event:
        """Set at the next change; take it *before* reading a snapshot so no change is missed."""
        return self._changed

    def snapshot(self) -> common_pb2.ReplicaLoad:
        remaining = [s.remaining for s in self.slots.values()]
        tpot_ms = self.tpot_ewma_s * 1e3
        soonest = 0.0 if self.has_free_slot() else min(remaining, default=0) * tpot_ms
        sessions = None
        if self.session_stats is not None:
            s = self.session_stats()
            sessions = common_pb2.SessionCacheStats(
                hits=s.hits, misses=s.misses, evictions=s.evictions, reused_tokens=s.reused_tokens,
                sessions=s.sessions, bytes=s.bytes, max_bytes=s.max_bytes, max_sessions=s.max_sessions)
        return common_pb2.ReplicaLoad(
            replica_id=self.replica_id,
            capacity=self.capacity,
            busy_slots=self.busy,
            tokens_remaining=sum(remaining),
            tpot_ewma_ms=tpot_ms,
            # slots decode concurrently, so the replica is idle when its longest generation ends
            expected_idle_ms=max(remaining, default=0) * tpot_ms,
            healthy=self.healthy,
            draining=self.draining,
            tpot_ms_by_occupancy=[t * 1e3 for t in self.tpot_by_occupancy],
            expected_slot_free_ms=soonest,
            prefill_ms_per_token=self.prefill_s_per_token * 1e3,
            version=self.version,
            session_cache=sessions,
        )


def _ewma(old: float, sample: float) -> float:
    return sample if old == 0.0 else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * sample
