"""OpenAI-compatible HTTP front of the router: /v1/models, /v1/completions, /v1/chat/completions.

Runs in-process on the router's event loop (uvicorn's server as a task on that loop) and calls
`Router.generate()` directly, so HTTP and gRPC requests share one queue, one replica pool and
one set of metrics. Started by `RouterServer(http_port=...)` through `start_http()`.

- Streaming is Server-Sent Events (`data: {...}` per chunk, then `data: [DONE]`).
- A client that disconnects (streaming or not) aborts its generation within one token: the
  router call is cancelled, which cancels the replica's.
- Errors use OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}` with the HTTP
  status a client library acts on: 400 bad input, 404 unknown model/path, 413 body too large,
  429 overloaded (with Retry-After), 503 no replica, 504 deadline. An error after streaming
  has begun is sent as a last `data: {"error": ...}` event (as OpenAI does).
- Optional request header `X-Request-Timeout: <seconds>` sets the request's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc
import uvicorn
from monoserve.v1 import inference_pb2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router import openai_convert as convert
from router.errors import RouterError
from router.openai_models import ChatCompletionRequest, CompletionRequest, OpenAIRequestError, parse_request

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
TIMEOUT_HEADER = "x-request-timeout"

# gRPC status of a RouterError -> (HTTP status, OpenAI error type, error code)
_HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "no_replica_available"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", "cancelled"),
}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    @classmethod
    def from_router(cls, e: RouterError) -> "HTTPError":
        status, type_, code = _HTTP_OF_GRPC.get(e.code, (500, "server_error", None))
        headers = {}
        if e.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
        return cls(status, e.message, type_, None, code, headers)

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status, headers=self.headers)


class _ClientGone(Exception):
    """The HTTP client disconnected; its generation was cancelled."""


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it (and raising _ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise _ClientGone()
    return task.result()


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class _SSEResponse(StreamingResponse):
    """Streams an async iterator of SSE bytes; stops it as soon as the client disconnects
    (not only at the next write), so an idle or queued stream is aborted promptly too."""

    def __init__(self, events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        shutting_down = False
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping and its grace period is over
            shutting_down = True
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self.events.aclose()  # ends the router call (and the replica's) if still running
        if shutting_down:
            # Tell the client why its stream ends, instead of just dropping the connection.
            error = HTTPError(503, "the server is shutting down: retry on another router", "service_unavailable_error")
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": _sse(error.payload()), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if task.done() and not task.cancelled() and task.exception() is not None \
                and not isinstance(task.exception(), OSError):  # OSError: the client went away
            raise task.exception()


class OpenAIApp:
    """The Starlette app; `router` is a `router.core.Router` (or anything with its interface)."""

    def __init__(self, router, max_body_bytes: int = MAX_BODY_BYTES):
        self.router = router
        self.max_body_bytes = max_body_bytes
        self.created = convert.now()
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_exception, Exception: self._unexpected})

    # -- endpoints ----------------------------------------------------------------------------

    def _model_cards(self) -> list[dict[str, Any]]:
        return [{"id": m.id, "object": "model", "created": self.created, "owned_by": "monoserve",
                 "max_model_len": m.context_length or None, "replicas": m.replicas}
                for m in self.router.list_models().models]

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self._model_cards()})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        card = next((c for c in self._model_cards() if c["id"] == name), None)
        if card is None:
            return self._unknown_model(name).response()
        return JSONResponse(card)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    # -- the generate path ----------------------------------------------------------------------

    async def _serve(self, request: Request, chat: bool) -> Response:
        try:
            req = parse_request(ChatCompletionRequest if chat else CompletionRequest, await self._read_json(request))
            model_ids = [c["id"] for c in self._model_cards()]
            if req.model not in model_ids:
                raise self._unknown_model(req.model)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if chat:
                limits = self.router.model
                greq = convert.chat_to_generate(req, rid, req.model, self.router.tokenizer,
                                                self.router.chat_template, limits.max_context)
            else:
                greq = convert.completion_to_generate(req, rid, req.model)
            stream = self.router.generate(greq, deadline=self._deadline(request))
            if not req.stream:
                text, final = await _unless_disconnected(request, _collect(stream))
                body = (convert.chat_body if chat else convert.completion_body)(
                    rid, convert.now(), req.model, text, final)
                return JSONResponse(body)
            first = await _unless_disconnected(request, _first(stream))
            events = _chat_events if chat else _completion_events
            return _SSEResponse(events(stream, first, rid, req.model, req.include_usage_in_stream))
        except OpenAIRequestError as e:
            return HTTPError(400, e.message, param=e.param).response()
        except RouterError as e:
            return HTTPError.from_router(e).response()
        except HTTPError as e:
            return e.response()
        except (_ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody is listening; uvicorn drops it

    def _unknown_model(self, name: str) -> HTTPError:
        served = ", ".join(repr(c["id"]) for c in self._model_cards())
        return HTTPError(404, f"model {name!r} does not exist: this server serves {served} (see GET /v1/models)",
                         param="model", code="model_not_found")

    def _deadline(self, request: Request) -> float | None:
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return None
        try:
            seconds = float(raw)
        except ValueError:
            seconds = float("nan")
        if not (math.isfinite(seconds) and seconds > 0):
            raise HTTPError(400, f"header X-Request-Timeout must be a positive number of seconds, got {raw!r}")
        return self.router.clock() + seconds

    async def _read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.max_body_bytes:
                raise self._too_large()
        if not body:
            raise HTTPError(400, "the request body is empty: send a JSON object (Content-Type: application/json)")
        try:
            return json.loads(body, parse_constant=_refuse_constant)
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
            raise HTTPError(400, f"the request body is not valid JSON ({e}): send a JSON object") from None

    def _too_large(self) -> HTTPError:
        return HTTPError(413, f"the request body is larger than {self.max_body_bytes} bytes: send a shorter prompt",
                         code="request_too_large")

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        message = {404: f"no such endpoint: {request.method} {request.url.path} (see /v1/models, /v1/completions, "
                        "/v1/chat/completions)",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                            str(exc.detail))
        return HTTPError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None).response()

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        log.exception("unexpected error serving %s", request.url.path)
        return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def _first(stream: AsyncIterator[inference_pb2.GenerateResponse]) -> inference_pb2.GenerateResponse:
    try:
        return await anext(stream)
    except BaseException:
        await stream.aclose()
        raise


async def _collect(stream) -> tuple[str, inference_pb2.Final | None]:
    parts, final = [], None
    try:
        async for event in stream:
            if event.HasField("chunk"):
                parts.append(event.chunk.text)
            else:
                final = event.final
    finally:
        await stream.aclose()
    return "".join(parts), final


async def _events(stream, first):
    """The router's responses starting with the already-received first one."""
    yield first
    if first.HasField("final"):
        return
    async for event in stream:
        yield event


async def _chat_events(stream, first, rid: str, model: str, with_usage: bool) -> AsyncIterator[bytes]:
    created = convert.now()
    try:
        yield _sse(convert.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None, with_usage))
        async for event in _events(stream, first):
            if event.HasField("chunk"):
                if event.chunk.text:
                    yield _sse(convert.chat_chunk(rid, created, model, {"content": event.chunk.text}, None,
                                                  with_usage))
                continue
            yield _sse(convert.chat_chunk(rid, created, model, {}, event.final, with_usage))
            if with_usage:
                yield _sse(convert.usage_chunk(rid, created, model, "chat.completion.chunk", event.final))
        yield _sse("[DONE]")
    except RouterError as e:
        yield _sse(HTTPError.from_router(e).payload())
    finally:
        await stream.aclose()


async def _completion_events(stream, first, rid: str, model: str, with_usage: bool) -> AsyncIterator[bytes]:
    created = convert.now()
    try:
        async for event in _events(stream, first):
            if event.HasField("chunk"):
                if event.chunk.text:
                    yield _sse(convert.completion_chunk(rid, created, model, event.chunk.text, None, with_usage))
                continue
            yield _sse(convert.completion_chunk(rid, created, model, "", event.final, with_usage))
            if with_usage:
                yield _sse(convert.usage_chunk(rid, created, model, "text_completion", event.final))
        yield _sse("[DONE]")
    except RouterError as e:
        yield _sse(HTTPError.from_router(e).payload())
    finally:
        await stream.aclose()


class OpenAIHTTPServer:
    """uvicorn serving `OpenAIApp` as a task on the current (the router's) event loop."""

    def __init__(self, router, host: str = "127.0.0.1", port: int = 0, max_body_bytes: int = MAX_BODY_BYTES):
        self.host, self.port = host, port
        self.app = OpenAIApp(router, max_body_bytes)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so, and
        # without it Nagle + delayed ACK hold every small SSE event back ~40 ms.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"cannot bind the OpenAI HTTP port {self.host}:{self.port}: {e}") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app.app, lifespan="off", log_config=None, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the startup error
                raise RuntimeError("the OpenAI HTTP server exited during startup")
            await asyncio.sleep(0.005)
        log.info("OpenAI-compatible HTTP on http://%s:%d/v1", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=5)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - shutting down regardless
            self._task.cancel()
        self._server = None


async def start_http(router, host: str = "127.0.0.1", port: int = 0,
                     max_body_bytes: int = MAX_BODY_BYTES) -> OpenAIHTTPServer:
    """Start the OpenAI-compatible HTTP server on the running loop; `.port` is the bound port."""
    server = OpenAIHTTPServer(router, host, port, max_body_bytes)
    await server.start()
    return server
