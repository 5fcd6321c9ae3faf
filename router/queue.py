"""Admission and the bounded router queue.

`Dispatcher.acquire()` returns a replica slot for a request: at once if the policy finds one,
otherwise the request waits in a FIFO queue. Waiters are woken by events only — every pool
change (a pushed WatchLoad update, a request finishing, a replica added or re-admitted) calls
`pump()`, which binds waiting requests, oldest first, to the replicas that can take them.
No polling, no sleeps.

Admission refuses with RESOURCE_EXHAUSTED and a retry pushback when the queue is full or the
request's deadline cannot be met (estimated wait + its own work > time left).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from router.errors import RouterError
from router.metrics import RouterMetrics
from router.policy import RequestShape, estimate_wait_s, pick_replica
from router.pool import ReplicaHandle, ReplicaPool


def _no_replica(pool: ReplicaPool) -> RouterError:
    return RouterError(grpc.StatusCode.UNAVAILABLE,
                       f"no healthy replica can serve this request now (replicas: {pool.describe()}): retry "
                       f"later, or add replicas (`monoserve router --replica ADDR`, RouterAdmin.AddReplica)")


@dataclass(eq=False)
class _Waiter:
    shape: RequestShape
    exclude: frozenset[str]
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Dispatcher:
    def __init__(self, pool: ReplicaPool, capacity: int, metrics: RouterMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if capacity < 0:
            raise ValueError(f"queue capacity must be >= 0, got {capacity}")
        self.pool = pool
        self.capacity = capacity
        self.metrics = metrics
        self.clock = clock
        self._queue: deque[_Waiter] = deque()

    def depth(self) -> int:
        return len(self._queue)

    def try_acquire(self, shape: RequestShape, exclude: frozenset[str] = frozenset()) -> ReplicaHandle | None:
        """A slot now, without queueing (only when nobody is waiting: FIFO fairness)."""
        if self._queue:
            return None
        return self._bind(shape, exclude)

    async def acquire(self, shape: RequestShape, deadline: float | None = None,
                      exclude: frozenset[str] = frozenset(), admitted: bool = False) -> ReplicaHandle:
        """A replica slot for `shape` (the caller must `release()` it), waiting if need be.

        `admitted`: the request was accepted before (it is failing over or retrying): it is never
        refused for a full queue or a tight deadline — nothing accepted is dropped."""
        handle = self.try_acquire(shape, exclude)
        if handle is not None:
            return handle
        if not self.pool.could_serve(exclude):
            raise _no_replica(self.pool)
        if not admitted:
            self._admit(shape, deadline)
        waiter = _Waiter(shape, exclude)
        if admitted:
            self._queue.appendleft(waiter)  # it was accepted before everyone waiting: goes first
        else:
            self._queue.append(waiter)
        self._queued_changed()
        self.pump()
        timeout = None if deadline is None else max(0.0, deadline - self.clock())
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                # bound at the same moment we gave up: hand the slot back
                self.release(waiter.future.result(), shape.max_tokens)
            waiter.future.cancel()
            if waiter in self._queue:
                self._queue.remove(waiter)
                self._queued_changed()
            if isinstance(e, asyncio.TimeoutError):
                raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "deadline passed while waiting for a free replica") from None
            raise

    def release(self, handle: ReplicaHandle, max_tokens: int) -> None:
        self.pool.release(handle, max_tokens)  # -> on_change -> pump()
        if self.metrics:
            self.metrics.active.dec()

    def pump(self) -> None:
        """Bind waiting requests to free replicas, oldest first (called on every pool change)."""
        if not self._queue:
            return
        changed = False
        for waiter in list(self._queue):
            if waiter.future.done():
                self._queue.remove(waiter)
                changed = True
                continue
            handle = self._bind(waiter.shape, waiter.exclude)
            if handle is not None:
                self._queue.remove(waiter)
                waiter.future.set_result(handle)
                changed = True
            elif not self.pool.could_serve(waiter.exclude):
                self._queue.remove(waiter)
                waiter.future.set_exception(_no_replica(self.pool))
                changed = True
        if changed:
            self._queued_changed()

    # -- internals ---------------------------------------------------------------------------

    def _bind(self, shape: RequestShape, exclude: frozenset[str]) -> ReplicaHandle | None:
        address = pick_replica(self.pool.snapshot(shape.session_id), shape, self.clock(), exclude)
        if address is None:
            return None
        handle = self.pool.replicas[address]
        self.pool.reserve(handle, shape.max_tokens)
        if shape.session_id:
            self.pool.remember_session(shape.session_id, address, shape.prompt_tokens)
        if self.metrics:
            self.metrics.active.inc()
        return handle

    def _admit(self, shape: RequestShape, deadline: float | None) -> None:
        replicas = self.pool.snapshot().replicas
        now = self.clock()
        if len(self._queue) >= self.capacity:
            wait = estimate_wait_s(replicas, [], now)
            self._reject("queue_full", f"router queue is full ({self.capacity} waiting): retry later",
                         wait if wait is not None else 1.0)
        if deadline is None:
            return
        wait = estimate_wait_s(replicas, [w.shape for w in self._queue], now)
        if wait is None:
            return  # no healthy replica now: nothing to estimate; wait for one until the deadline
        measured = [r for r in replicas if r.tpot_s is not None and r.healthy]
        work = min((r.prefill_s(shape.prompt_tokens) + shape.max_tokens * r.tpot_at(1) for r in measured), default=0.0)
        left = deadline - now
        if wait + work > left:
            self._reject("deadline", f"cannot finish before the deadline: about {wait * 1000:.0f} ms wait + "
                         f"{work * 1000:.0f} ms work > {left * 1000:.0f} ms left; retry later, allow more "
                         f"time or ask for fewer max_tokens", max(wait, 0.001))

    def _reject(self, reason: str, message: str, retry_after_s: float) -> None:
        if self.metrics:
            self.metrics.rejections.labels(reason).inc()
        raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s=retry_after_s)

    def _queued_changed(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self._queue))
