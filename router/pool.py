"""The replica pool: one connection per replica, kept current by what the replicas push.

For every replica two server-streaming calls stay open (no polling):
- `Replica.WatchLoad`: capacity, busy slots, tokens remaining, TPOT — the policy's input;
- `grpc.health.v1.Health.Watch` on the replica's readiness service: SERVING or not.
A replica is eligible when both streams are up, it reports healthy and SERVING, and neither it
nor the router is draining it. A failed stream or a failed call ejects it at once; it is
re-admitted as soon as both streams are back and healthy (the watch calls use wait_for_ready,
so they resume when gRPC's own reconnection succeeds). A replica that has not reported once
within `connect_timeout_s` of being added (a mistyped address, a replica that died first) counts
as ejected rather than "connecting, worth waiting for": requests fail fast with UNAVAILABLE; its
watches keep trying, and its first healthy report admits it.

Every change calls `on_change()`, which the dispatcher uses to hand free slots to waiters.
Everything here runs on the router's event loop (single-threaded: no locks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from monoserve.v1 import REPLICA_SERVICE, admin_pb2, common_pb2, replica_pb2, replica_pb2_grpc

from router.errors import RouterError
from router.policy import ReplicaState, Snapshot

log = logging.getLogger(__name__)

# Reconnect quickly after a replica restarts (gRPC's default backoff grows to two minutes).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)
# Pause before re-opening a watch that failed while the connection was up (a replica bug, not
# a restart): keeps a broken replica from spinning the loop. Not on any request's path.
_WATCH_RETRY_S = 1.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# After a replica refused for lack of a slot, its free slots are not trusted until its next load
# report or this re-check (the replica's pushback, within these bounds): the report showing the
# slot the refusal freed usually arrives *before* the refusal, and the next one may be a 2 s
# heartbeat away. A replica that keeps refusing is bounded per request by the router core.
BUSY_RECHECK_S = (0.01, 0.05, 0.25)  # (min, without pushback, max)
MAX_SESSIONS = 100_000  # session affinity entries kept (least recently used dropped first)


def _ms(value: float) -> float | None:
    return value / 1000.0 if value > 0 else None


class ReplicaHandle:
    """The router's view of one replica."""

    def __init__(self, address: str, on_change: Callable[[], None], clock: Callable[[], float],
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.connect_timed_out = False  # never reported within connect_timeout_s of being added
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = replica_pb2_grpc.ReplicaStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._on_change = on_change
        self._clock = clock
        self.load: common_pb2.ReplicaLoad | None = None
        self.load_at = 0.0
        self.load_stream_up = False
        self.serving = False
        self.info: replica_pb2.GetInfoResponse | None = None
        self.router_running = 0  # requests the router has bound to this replica
        self.router_tokens = 0  # their remaining max_tokens (until the replica's report counts them)
        self.removing = False
        self.failed = False  # a call failed; stays ejected until its streams report healthy again
        self.full_until_report = False  # it refused for lack of a slot: trust no free slot until it reports
        self.last_error = ""
        self.idle = asyncio.Event()  # set when router_running drops to 0 (for drain)
        self.idle.set()
        self._tasks: list[asyncio.Task] = []
        self._connect_timer: asyncio.TimerHandle | None = None
        self._busy_recheck: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch_load(), name=f"load:{self.address}"),
                       asyncio.create_task(self._watch_health(), name=f"health:{self.address}")]
        self._connect_timer = asyncio.get_running_loop().call_later(self.connect_timeout_s, self._connect_expired)

    def _connect_expired(self) -> None:
        if self.load is None:
            self.connect_timed_out = True
            self.last_error = (f"not ready {self.connect_timeout_s:g} s after it was added: is the address "
                               f"right and the replica running? (still retrying)")
            log.warning("replica %s: %s", self.address, self.last_error)
            self._on_change()  # waiters that were waiting only for it fail now

    @property
    def connecting(self) -> bool:
        """Never contacted yet, and still within its connect timeout (worth waiting for)."""
        return self.load is None and not self.failed and not self.connect_timed_out

    async def close(self) -> None:
        for timer in (self._connect_timer, self._busy_recheck):
            if timer is not None:
                timer.cancel()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.channel.close()

    # -- state -----------------------------------------------------------------------------

    @property
    def replica_id(self) -> str:
        return (self.load.replica_id if self.load else "") or self.address

    @property
    def healthy(self) -> bool:
        return (self.load_stream_up and self.serving and self.load is not None and self.load.healthy
                and not self.failed)

    @property
    def draining(self) -> bool:
        return self.removing or bool(self.load and self.load.draining)

    def state(self) -> ReplicaState:
        """Immutable snapshot for the policy."""
        load = self.load or common_pb2.ReplicaLoad()
        capacity = load.capacity or (self.info.max_batch if self.info else 0)
        reported_up_to_date = load.busy_slots >= self.router_running
        tpot = _ms(load.tpot_ewma_ms)
        by_busy = tuple((x if x > 0 else load.tpot_ewma_ms) / 1000.0 for x in load.tpot_ms_by_occupancy)
        return ReplicaState(
            address=self.address, capacity=capacity,
            busy=capacity if self.full_until_report else max(load.busy_slots, self.router_running),
            healthy=self.healthy, draining=self.draining,
            tokens_remaining=max(load.tokens_remaining, self.router_tokens),
            tpot_s=tpot, tpot_by_busy=by_busy if all(by_busy) else (),
            prefill_s_per_token=_ms(load.prefill_ms_per_token),
            expected_idle_s=load.expected_idle_ms / 1000.0 if reported_up_to_date and tpot else None,
            reported_at=self.load_at)

    def admin_state(self) -> int:
        if self.draining:
            return admin_pb2.REPLICA_STATE_DRAINING
        if self.healthy:
            return admin_pb2.REPLICA_STATE_READY
        if self.connecting:
            return admin_pb2.REPLICA_STATE_CONNECTING
        return admin_pb2.REPLICA_STATE_EJECTED

    def status(self) -> admin_pb2.ReplicaStatus:
        msg = admin_pb2.ReplicaStatus(address=self.address, state=self.admin_state(),
                                      last_error=self.last_error, router_running=self.router_running)
        if self.load is not None:
            msg.load.CopyFrom(self.load)
        return msg

    def mark_failed(self, error: str) -> None:
        """A call to the replica failed: eject it until its streams say it is healthy again."""
        self.failed = True
        self.last_error = error
        self._on_change()

    def refused_busy(self, pushback_s: float | None) -> None:
        """It refused a request for lack of a slot: count it full until it reports again or a
        short re-check passes, whichever comes first."""
        self.full_until_report = True
        if self._busy_recheck is not None:
            self._busy_recheck.cancel()
        low, default, high = BUSY_RECHECK_S
        delay = min(max(pushback_s if pushback_s is not None else default, low), high)
        self._busy_recheck = asyncio.get_running_loop().call_later(delay, self._recheck_slots)

    def _recheck_slots(self) -> None:
        self._busy_recheck = None
        if self.full_until_report:
            self.full_until_report = False  # back to its latest report (which may say full)
            self._on_change()

    # -- the two watch streams ---------------------------------------------------------------

    async def _watch_load(self) -> None:
        while True:
            try:
                # on every (re)connection: a restarted replica may serve a different build
                self.info = await self.stub.GetInfo(replica_pb2.GetInfoRequest(), wait_for_ready=True)
                async for load in self.stub.WatchLoad(replica_pb2.WatchLoadRequest(), wait_for_ready=True):
                    if self.load is not None and load.version and load.version < self.load.version \
                            and load.replica_id == self.load.replica_id:
                        continue  # stale, reordered update
                    self.load, self.load_at, self.load_stream_up = load, self._clock(), True
                    self.full_until_report = False
                    if self.failed and load.healthy:
                        self.failed = False  # fresh evidence it works again
                    self._on_change()
                error = "WatchLoad stream ended"
            except grpc.aio.AioRpcError as e:
                error = f"WatchLoad: {e.code().name}: {e.details()}"
            self._stream_lost(error)
            await self._before_rewatch()

    async def _watch_health(self) -> None:
        service = REPLICA_SERVICE
        while True:
            try:
                request = health_pb2.HealthCheckRequest(service=service)
                async for reply in self._health.Watch(request, wait_for_ready=True):
                    if reply.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN and service:
                        service = ""  # replica without a readiness entry: use overall health
                        break
                    self.serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    if not self.serving:
                        self.last_error = "health: NOT_SERVING"
                    self._on_change()
                else:
                    self._stream_lost("health watch ended")
                    await self._before_rewatch()
            except grpc.aio.AioRpcError as e:
                self._stream_lost(f"health: {e.code().name}: {e.details()}")
                await self._before_rewatch()

    def _stream_lost(self, error: str) -> None:
        was_healthy = self.healthy
        self.load_stream_up = self.serving = False
        self.last_error = error
        if was_healthy:
            log.warning("replica %s ejected: %s", self.address, error)
        self._on_change()

    async def _before_rewatch(self) -> None:
        # A dead replica: the next wait_for_ready call waits for the reconnection by itself.
        # A live one whose stream failed anyway: do not spin.
        if self.channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY:
            await asyncio.sleep(_WATCH_RETRY_S)


class ReplicaPool:
    """All replicas by address. Runs on the router's event loop."""

    def __init__(self, on_change: Callable[[], None], clock: Callable[[], float] = time.monotonic,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
        if not connect_timeout_s > 0:
            raise ValueError(f"connect timeout must be > 0 seconds, got {connect_timeout_s}")
        self._on_change = on_change
        self.connect_timeout_s = connect_timeout_s
        self._clock = clock
        self.replicas: dict[str, ReplicaHandle] = {}
        # Session affinity is learnt from where the router sent each session last (replicas do not
        # list the sessions they hold): a replica that evicted or lost the KV just prefills afresh.
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session_id -> address that served it last
        self.session_tokens: dict[str, int] = {}  # session_id -> tokens that replica holds for it

    def remember_session(self, session_id: str, address: str, tokens: int) -> None:
        """`session_id` goes to `address` with a `tokens`-long prompt (it holds about that many after)."""
        self.sessions[session_id] = address
        self.sessions.move_to_end(session_id)
        self.session_tokens[session_id] = tokens
        if len(self.sessions) > MAX_SESSIONS:
            forgotten, _ = self.sessions.popitem(last=False)  # the least recently used session
            self.session_tokens.pop(forgotten, None)

    def session_grew(self, session_id: str, address: str, tokens: int) -> None:
        """A turn on `address` ended holding `tokens` (prompt + output), unless the session moved since."""
        if self.sessions.get(session_id) == address:
            self.session_tokens[session_id] = tokens

    def add(self, address: str) -> ReplicaHandle:
        address = address.strip()
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"replica address {address!r} is not host:port (e.g. 127.0.0.1:50051)")
        if address in self.replicas:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"replica {address} is already in the pool")
        handle = ReplicaHandle(address, self._on_change, self._clock, self.connect_timeout_s)
        self.replicas[address] = handle
        handle.start()
        return handle

    async def remove(self, address: str, drain: bool = True) -> int:
        """Stop sending requests to `address`; with drain, wait for its running ones to finish."""
        handle = self.replicas.get(address)
        if handle is None:
            raise RouterError(grpc.StatusCode.NOT_FOUND, f"replica {address} is not in the pool")
        running = handle.router_running
        handle.removing = True
        self._on_change()
        if drain:
            await handle.idle.wait()
        del self.replicas[address]
        # Without drain, closing the channel fails the running calls: they fail over.
        await handle.close()
        self._on_change()
        return running

    def snapshot(self, session_id: str = "") -> Snapshot:
        """Immutable view for the policy (with the one session entry it may need)."""
        sticky = self.sessions.get(session_id) if session_id else None
        return Snapshot(tuple(h.state() for h in self.replicas.values()),
                        {session_id: sticky} if sticky else {},
                        {session_id: self.session_tokens[session_id]} if sticky else {})

    def any_eligible(self, exclude=()) -> bool:
        return any(h.healthy and not h.draining for a, h in self.replicas.items() if a not in exclude)

    def could_serve(self, exclude=()) -> bool:
        """Some replica serves now (maybe busy), or is connecting for the first time within its
        connect timeout (worth waiting for).

        When every replica is ejected or draining, requests fail fast with UNAVAILABLE instead of
        waiting an unknown time for one to come back."""
        return any(not h.draining and (h.healthy or h.connecting)
                   for a, h in self.replicas.items() if a not in exclude)

    def describe(self) -> str:
        """Every replica and its state, for error messages: 'a:1 ejected (why), b:2 ready'."""
        parts = []
        for h in list(self.replicas.values()):
            state = admin_pb2.ReplicaState.Name(h.admin_state()).removeprefix("REPLICA_STATE_").lower()
            parts.append(f"{h.address} {state}" + (f" ({h.last_error})" if h.last_error and not h.healthy else ""))
        return "; ".join(parts) or "none in the pool"

    def count_by_state(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for h in list(self.replicas.values()):  # also called from the metrics thread
            counts[h.admin_state()] = counts.get(h.admin_state(), 0) + 1
        return counts

    def reserve(self, handle: ReplicaHandle, max_tokens: int) -> None:
        handle.router_running += 1
        handle.router_tokens += max_tokens
        handle.idle.clear()

    def release(self, handle: ReplicaHandle, max_tokens: int) -> None:
        handle.router_running -= 1
        handle.router_tokens -= max_tokens
        if handle.router_running == 0:
            handle.idle.set()
        self._on_change()

    async def close(self) -> None:
        handles = list(self.replicas.values())
        self.replicas.clear()
        await asyncio.gather(*(h.close() for h in handles), return_exceptions=True)
