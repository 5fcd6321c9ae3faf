"""`ReplicaServer`: one Engine behind the `monoserve.v1.Replica` gRPC service.

    server = ReplicaServer(engine, host="127.0.0.1", port=0, replica_id=None, metrics_port=None)
    port = server.start()      # returns at once; serving happens in a background thread
    server.drain()             # refuse new requests (UNAVAILABLE), finish running ones
    server.stop(grace=5.0)

grpc.aio runs in its own event-loop thread, so a server starts from synchronous code (a Ray
actor, the CLI, a test). Besides `Replica` it serves `grpc.health.v1.Health` — service "" is
liveness (SERVING while the process serves), service "monoserve.v1.Replica" is readiness
(NOT_SERVING while draining or after repeated engine failures) — and server reflection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from monoserve.loop_thread import LoopThread
from monoserve.v1 import REPLICA_SERVICE, common_pb2, replica_pb2

from replicas.engine import Engine
from replicas.metrics import ReplicaMetrics
from replicas.server_handlers import add_servicer
from replicas.server_load import LoadTracker
from replicas.server_servicer import ReplicaServicer

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def engine_info(engine: Engine, replica_id: str, model_name: str | None, model_path: str | None,
                gpu_ids: Sequence[int] | None) -> replica_pb2.GetInfoResponse:
    """GetInfo's answer, from the engine's config and whatever the engine tells about itself."""
    c = engine.config
    shape = replica_pb2.ModelShape(
        architecture=c.architecture, family=c.family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, dtype=c.dtype,
        eos_token_ids=list(c.eos_token_ids), num_parameters=c.num_parameters(),
    )
    if c.bos_token_id is not None:
        shape.bos_token_id = c.bos_token_id
    path = model_path or str(getattr(engine, "model_path", "") or "")
    name = model_name or (path.rstrip("/").rsplit("/", 1)[-1] if path else engine.kind)
    gpus = gpu_ids if gpu_ids is not None else getattr(engine, "devices", None) or ()
    return replica_pb2.GetInfoResponse(
        replica_id=replica_id, model_name=name, model_path=path, shape=shape, engine_kind=engine.kind,
        gpu_ids=[int(g) for g in gpus], max_batch=engine.max_batch, max_context=engine.max_context,
    )


class ReplicaServer:
    """Serves one engine over gRPC from a background event-loop thread."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, replica_id: str | None = None,
                 metrics_port: int | None = None, *, model_name: str | None = None,
                 model_path: str | None = None, gpu_ids: Sequence[int] | None = None):
        self.engine = engine
        self.host = host
        self.port = port
        self.replica_id = replica_id
        self.metrics_port = metrics_port
        self._model = (model_name, model_path, gpu_ids)
        self._runner: LoopThread | None = None  # the event loop the gRPC server runs on
        self._server: grpc.aio.Server | None = None
        self._stopped = threading.Event()
        self.servicer: ReplicaServicer | None = None
        self.metrics: ReplicaMetrics | None = None
        self.health: health.aio.HealthServicer | None = None

    @property
    def address(self) -> str:
        """"host:port" clients connect to (a wildcard host is replaced by this machine's name)."""
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "[::]", "") else self.host
        return f"{host}:{self.port}"

    # ---- lifecycle (callable from any thread) --------------------------------------------
    def start(self) -> int:
        """Bind and start serving; returns the bound gRPC port."""
        if self._runner is not None:
            raise RuntimeError("ReplicaServer already started")
        self._runner = LoopThread("replica-server-loop")
        try:
            self.port = self._call(self._start())
        except BaseException:
            self._runner.close()
            self._runner = None
            raise
        log.info("replica %s serving %s engine on %s", self.replica_id, self.engine.kind, self.address)
        return self.port

    def drain(self) -> None:
        """Stop admitting (new requests get UNAVAILABLE; readiness NOT_SERVING); running ones finish."""
        self._call(self._drain())

    def busy_slots(self) -> int:
        """Generations running now."""
        return self._call(self._busy())

    def load(self) -> common_pb2.ReplicaLoad:
        """The current load, as WatchLoad would push it (healthy, draining, busy_slots, ...)."""
        return self._call(self._snapshot())

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no generation is running; False on timeout."""
        async def idle():
            while self.servicer.load.busy:
                await self.servicer.load.change_event.wait()
        try:
            self._call(asyncio.wait_for(idle(), timeout))
            return True
        except (asyncio.TimeoutError, TimeoutError):
            return False

    def stop(self, grace: float | None = 5.0) -> None:
        """Stop serving: running calls get `grace` seconds, then are cancelled. Idempotent."""
        if self._runner is None or self._stopped.is_set():
            return
        try:
            self._call(self._stop(grace))
        finally:
            self.servicer.shutdown()
            if self.metrics is not None:
                self.metrics.stop()
            self._runner.close()
            self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stop() has finished (for the CLI); False on timeout."""
        return self._stopped.wait(timeout)

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        return self._runner.loop if self._runner else None

    def _call(self, coro):
        if self._runner is None:
            coro.close()
            raise RuntimeError("ReplicaServer is not started; call start() first")
        return self._runner.call(coro)

    # ---- on the event loop -------------------------------------------------------------
    async def _start(self) -> int:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        cause = None
        try:
            port = server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError as e:  # grpc raises RuntimeError("Failed to bind ...")
            port, cause = 0, e
        if port == 0:
            raise OSError(f"cannot bind gRPC address {self.host}:{self.port} (in use, or not an address of "
                          "this machine): pick another port or host") from cause
        self.port = port
        self.replica_id = self.replica_id or self.address
        session_stats = getattr(self.engine, "session_stats", None)  # engines that keep sessions' KV
        self.metrics = ReplicaMetrics(self.replica_id, self.engine.max_batch, session_stats, engine=self.engine)
        load = LoadTracker(self.replica_id, self.engine.max_batch, session_stats=session_stats)
        info = engine_info(self.engine, self.replica_id, *self._model)
        self.servicer = ReplicaServicer(self.engine, load, self.metrics, info, on_health_change=self._set_ready)
        add_servicer(self.servicer, server, replica_pb2.DESCRIPTOR, "Replica")  # malformed bytes -> INVALID_ARGUMENT
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        services = (REPLICA_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, server)
        await self.health.set(health.OVERALL_HEALTH, SERVING)
        await self.health.set(REPLICA_SERVICE, SERVING)
        await server.start()
        self._server = server
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.metrics_port, host=self.host)
        return port

    async def _set_ready(self, ready: bool) -> None:
        load = self.servicer.load
        await self.health.set(REPLICA_SERVICE, SERVING if ready and not load.draining and load.healthy else NOT_SERVING)

    async def _drain(self) -> None:
        self.servicer.load.set_draining(True)
        self.metrics.draining.set(1)
        await self._set_ready(False)

    async def _busy(self) -> int:
        return self.servicer.load.busy

    async def _snapshot(self) -> common_pb2.ReplicaLoad:
        return self.servicer.load.snapshot()

    async def _stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        self.servicer.load.set_draining(True)
        self.servicer.load.close()  # ends WatchLoad streams now, so `grace` only waits for generations
        await self._server.stop(grace)
