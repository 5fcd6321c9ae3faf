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
- Agent sessions: the body's `session_id` (or, without it, the `X-Session-Id` header) becomes
  `GenerateRequest.session_id`; `usage.prompt_tokens_details.cached_tokens` says how many prompt
  tokens were reused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import uuid
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router import openai_convert as convert
from router.errors import RouterError
from router.openai_errors import HTTPError
from router.openai_models import (ChatCompletionRequest, CompletionRequest, OpenAIRequestError, check_session_id,
                                  parse_request)
from router.openai_stream import (ClientGone, SSEResponse, chat_events, collect, completion_events, first_event,
                                  unless_disconnected)
from router.openai_tools import parse_tool_calls, tool_format

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
TIMEOUT_HEADER = "x-request-timeout"
SESSION_HEADER = "x-session-id"  # for clients that can set headers but not extra body fields


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
                greq = await convert.chat_to_generate(req, rid, req.model, self.router.tokenizer,
                                                      self.router.chat_template, limits.max_context)
            else:
                greq = convert.completion_to_generate(req, rid, req.model)
            greq.session_id = self._session_id(request, req)
            tools = self._tool_format(req) if chat else None
            stream = self.router.generate(greq, deadline=self._deadline(request))
            if not req.stream:
                text, final = await unless_disconnected(request, collect(stream))
                if not chat:
                    return JSONResponse(convert.completion_body(rid, convert.now(), req.model, text, final))
                content, calls = parse_tool_calls(text, tools) if tools else (text, [])
                return JSONResponse(convert.chat_body(rid, convert.now(), req.model, content, final, calls))
            first = await unless_disconnected(request, first_event(stream))
            if chat:
                return SSEResponse(chat_events(stream, first, rid, req.model, req.include_usage_in_stream, tools))
            return SSEResponse(completion_events(stream, first, rid, req.model, req.include_usage_in_stream))
        except OpenAIRequestError as e:
            return HTTPError(400, e.message, param=e.param).response()
        except RouterError as e:
            return HTTPError.from_router(e).response()
        except HTTPError as e:
            return e.response()
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody is listening; uvicorn drops it

    def _tool_format(self, req: ChatCompletionRequest) -> str | None:
        """How to find tool calls in this request's output (None: don't look for them)."""
        template = self.router.chat_template
        if not req.tools or req.tool_choice == "none" or template is None:
            return None
        return tool_format("\n".join(getattr(template, "templates", {}).values()))

    def _unknown_model(self, name: str) -> HTTPError:
        served = ", ".join(repr(c["id"]) for c in self._model_cards())
        return HTTPError(404, f"model {name!r} does not exist: this server serves {served} (see GET /v1/models)",
                         param="model", code="model_not_found")

    @staticmethod
    def _session_id(request: Request, req) -> str:
        """The body's `session_id` wins over the X-Session-Id header; "" = no session."""
        if req.session_id is not None:
            return req.session_id
        return check_session_id(request.headers.get(SESSION_HEADER, ""), "header X-Session-Id")

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
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as e:
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
