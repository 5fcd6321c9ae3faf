"""`RouterServer`: the router's gRPC front (Inference + RouterAdmin + health + reflection) and
Prometheus metrics, on grpc.aio in its own event-loop thread (startable from synchronous code:
the CLI, a Ray actor, a test).

    server = RouterServer(["127.0.0.1:50051"], port=0, tokenizer="/ckpt", metrics_port=0)
    port = server.start()
    ...
    server.stop()

`Generate` requests are parsed by a tolerant deserializer so that garbage bytes become
INVALID_ARGUMENT (gRPC's default would be INTERNAL). The client's deadline is the request
deadline; cancelling the call cancels the replica call.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from monoserve.loop_thread import LoopThread
from monoserve.v1 import INFERENCE_SERVICE, ROUTER_ADMIN_SERVICE, admin_pb2, admin_pb2_grpc, inference_pb2

from router.core import Router
from router.detokenizer import TextTokenizer
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.pool import DEFAULT_CONNECT_TIMEOUT_S

log = logging.getLogger(__name__)


class _Malformed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: str):
        self.error = error


# Generate requests over this size are refused with INVALID_ARGUMENT and a message saying why;
# gRPC itself accepts up to _GRPC_RECEIVE_LIMIT (its own error beyond that is a bare
# RESOURCE_EXHAUSTED "Received message larger than max").
MAX_REQUEST_BYTES = 4 << 20
_GRPC_RECEIVE_LIMIT = 4 * MAX_REQUEST_BYTES


def _parse_generate(data: bytes):
    if len(data) > MAX_REQUEST_BYTES:
        return _Malformed(f"request is {len(data)} bytes; the limit is {MAX_REQUEST_BYTES} "
                          f"({MAX_REQUEST_BYTES >> 20} MiB), far more than any context window holds: shorten the prompt")
    try:
        return inference_pb2.GenerateRequest.FromString(data)
    except (DecodeError, ValueError) as e:  # bad wire format, invalid UTF-8 in a string field
        return _Malformed(f"request is not a valid monoserve.v1.GenerateRequest: {str(e) or type(e).__name__}")


class _InferenceServicer:
    def __init__(self, router: Router):
        self.router = router

    async def generate(self, request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        remaining = context.time_remaining()
        deadline = None if remaining is None else self.router.clock() + remaining
        try:
            async for response in self.router.generate(request, deadline=deadline):
                yield response
        except RouterError as e:
            context.set_trailing_metadata(e.trailing_metadata())
            await context.abort(e.code, e.message)

    async def abort(self, request, context):
        return inference_pb2.AbortResponse(found=self.router.abort(request.request_id))

    async def list_models(self, request, context):
        return self.router.list_models()

    def handler(self) -> grpc.GenericRpcHandler:
        ser = lambda m: m.SerializeToString()  # noqa: E731
        return grpc.method_handlers_generic_handler(INFERENCE_SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, request_deserializer=_parse_generate, response_serializer=ser),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self.abort, request_deserializer=inference_pb2.AbortRequest.FromString, response_serializer=ser),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self.list_models, request_deserializer=inference_pb2.ListModelsRequest.FromString,
                response_serializer=ser),
        })


class _AdminServicer(admin_pb2_grpc.RouterAdminServicer):
    def __init__(self, router: Router):
        self.router = router

    async def AddReplica(self, request, context):
        try:
            handle = self.router.add_replica(request.address)
        except RouterError as e:
            await context.abort(e.code, e.message)
        return admin_pb2.AddReplicaResponse(replica=handle.status())

    async def RemoveReplica(self, request, context):
        try:
            running = await self.router.remove_replica(request.address, drain=request.drain)
        except RouterError as e:
            await context.abort(e.code, e.message)
        return admin_pb2.RemoveReplicaResponse(running_requests=running)

    async def ListReplicas(self, request, context):
        return admin_pb2.ListReplicasResponse(
            replicas=[h.status() for h in self.router.pool.replicas.values()],
            queue_depth=self.router.dispatcher.depth(), queue_capacity=self.router.dispatcher.capacity)


class RouterServer:
    def __init__(self, replicas: Iterable[str] = (), host: str = "127.0.0.1", port: int = 0,
                 http_port: int | None = None, metrics_port: int | None = None,
                 tokenizer: str | Path | None = None, model_name: str = "", queue_size: int = 64,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0 seconds (how long a replica may take to come "
                             f"up before requests stop waiting for it), got {connect_timeout_s}")
        self.host, self.port, self.http_port, self.metrics_port = host, port, http_port, metrics_port
        self._initial_replicas = list(replicas)
        self._tokenizer_dir = tokenizer
        self._model_name = model_name
        self._queue_size = queue_size
        self._connect_timeout_s = connect_timeout_s
        self.metrics = RouterMetrics()
        self.router: Router | None = None
        self._runner: LoopThread | None = None  # the event loop the gRPC server runs on
        self._server: grpc.aio.Server | None = None
        self._metrics_server = None
        self._http = None
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "[::]", "") else self.host
        return f"{host}:{self.port}"

    # -- lifecycle (any thread) ---------------------------------------------------------------

    def start(self) -> int:
        """Load the tokenizer, bind, start serving in a background thread; returns the gRPC port."""
        if self._runner is not None:
            raise RuntimeError("RouterServer already started")
        tokenizer, template = self._load_tokenizer()
        self._runner = LoopThread("router-loop")
        try:
            self.port = self._call(self._start(tokenizer, template))
        except BaseException:
            self._runner.close()
            self._runner = None
            raise
        log.info("router serving on %s with %d replicas", self.address, len(self._initial_replicas))
        return self.port

    def add_replica(self, address: str) -> None:
        self._call(self._add(address))

    def remove_replica(self, address: str, drain: bool = True) -> int:
        return self._call(self.router.remove_replica(address, drain))

    def queue_depth(self) -> int:
        return self.router.dispatcher.depth()

    def wait_ready(self, replicas: int = 1, timeout: float = 10.0) -> None:
        """Block until at least `replicas` replicas are healthy (tests, CLI)."""
        end = time.monotonic() + timeout
        while sum(1 for h in list(self.router.pool.replicas.values()) if h.healthy) < replicas:
            if time.monotonic() > end:
                raise TimeoutError(f"fewer than {replicas} healthy replicas after {timeout} s")
            time.sleep(0.01)

    def stop(self, grace: float | None = 2.0) -> None:
        if self._runner is None or self._stopped.is_set():
            return
        try:
            self._call(self._stop(grace))
        finally:
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
            self._runner.close()
            self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        return self._runner.loop if self._runner else None

    def _call(self, coro):
        if self._runner is None:
            coro.close()
            raise RuntimeError("RouterServer is not started; call start() first")
        return self._runner.call(coro)

    def _load_tokenizer(self):
        if self._tokenizer_dir is None:
            return None, None
        tokenizer = TextTokenizer.from_pretrained(self._tokenizer_dir)
        template = None
        try:
            from router.chat import ChatTemplate

            template = ChatTemplate.from_pretrained(self._tokenizer_dir)
        except ImportError:
            pass
        if not self._model_name:
            self._model_name = Path(self._tokenizer_dir).resolve().name
        return tokenizer, template

    # -- on the loop ----------------------------------------------------------------------------

    async def _start(self, tokenizer, template) -> int:
        self.router = Router(tokenizer=tokenizer, chat_template=template, model_name=self._model_name,
                             queue_size=self._queue_size, metrics=self.metrics,
                             connect_timeout_s=self._connect_timeout_s)
        for address in self._initial_replicas:
            self.router.add_replica(address)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", _GRPC_RECEIVE_LIMIT)])
        port = server.add_insecure_port(f"{self.host}:{self.port}")
        if port == 0:
            raise OSError(f"cannot bind gRPC port {self.host}:{self.port}")
        server.add_generic_rpc_handlers((_InferenceServicer(self.router).handler(),))
        admin_pb2_grpc.add_RouterAdminServicer_to_server(_AdminServicer(self.router), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (INFERENCE_SERVICE, ROUTER_ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        for service in (health.OVERALL_HEALTH, INFERENCE_SERVICE, ROUTER_ADMIN_SERVICE):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        self._server = server
        if self.metrics_port is not None:
            self._metrics_server, _ = self.metrics.serve(self.metrics_port, addr=self.host)
            self.metrics_port = self._metrics_server.server_port
        if self.http_port is not None:
            self._http = await self._start_http()
        return port

    async def _start_http(self):
        """The OpenAI-compatible HTTP front (router/openai_http.py), on this same event loop."""
        from router.openai_http import start_http  # owned by the OpenAI engineer

        self._http = await start_http(self.router, host=self.host, port=self.http_port)
        self.http_port = getattr(self._http, "port", self.http_port)
        return self._http

    async def _add(self, address: str) -> None:
        self.router.add_replica(address)

    async def _stop(self, grace: float | None) -> None:
        await self._health.enter_graceful_shutdown()
        if self._http is not None:
            await self._http.stop()
        await self._server.stop(grace)
        await self.router.close()
        # let gRPC's own bookkeeping tasks finish before the loop stops
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
