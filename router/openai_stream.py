"""Streaming plumbing of the OpenAI-compatible API: Server-Sent Events built from the router's
responses, and cancellation when the HTTP client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable

from monoserve.v1 import inference_pb2
from starlette.requests import Request
from starlette.responses import StreamingResponse

from router import openai_convert as convert
from router.errors import RouterError
from router.openai_errors import HTTPError
from router.openai_tools import ToolCallStream


class ClientGone(Exception):
    """The HTTP client disconnected; its generation was cancelled."""


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
    return task.result()


def sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class SSEResponse(StreamingResponse):
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
                await send({"type": "http.response.body", "body": sse(error.payload()), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if task.done() and not task.cancelled() and task.exception() is not None \
                and not isinstance(task.exception(), OSError):  # OSError: the client went away
            raise task.exception()


async def first_event(stream: AsyncIterator[inference_pb2.GenerateResponse]) -> inference_pb2.GenerateResponse:
    try:
        return await anext(stream)
    except BaseException:
        await stream.aclose()
        raise


async def collect(stream) -> tuple[str, inference_pb2.Final | None]:
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


async def chat_events(stream, first, rid: str, model: str, with_usage: bool,
                      tool_format: str | None = None) -> AsyncIterator[bytes]:
    created = convert.now()
    tools = ToolCallStream(tool_format) if tool_format else None

    def chunk(delta: dict, final=None, called_tools: bool = False) -> bytes:
        return sse(convert.chat_chunk(rid, created, model, delta, final, with_usage, called_tools))

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in _events(stream, first):
            if event.HasField("chunk"):
                text = tools.feed(event.chunk.text) if tools else event.chunk.text
                if text:
                    yield chunk({"content": text})
                continue
            calls = []
            if tools:
                tail, calls = tools.finish()
                if tail:
                    yield chunk({"content": tail})
                if calls:
                    yield chunk({"tool_calls": [c.as_json(i) for i, c in enumerate(calls)]})
            yield chunk({}, event.final, bool(calls))
            if with_usage:
                yield sse(convert.usage_chunk(rid, created, model, "chat.completion.chunk", event.final))
        yield sse("[DONE]")
    except RouterError as e:
        yield sse(HTTPError.from_router(e).payload())
    finally:
        await stream.aclose()


async def completion_events(stream, first, rid: str, model: str, with_usage: bool) -> AsyncIterator[bytes]:
    created = convert.now()
    try:
        async for event in _events(stream, first):
            if event.HasField("chunk"):
                if event.chunk.text:
                    yield sse(convert.completion_chunk(rid, created, model, event.chunk.text, None, with_usage))
                continue
            yield sse(convert.completion_chunk(rid, created, model, "", event.final, with_usage))
            if with_usage:
                yield sse(convert.usage_chunk(rid, created, model, "text_completion", event.final))
        yield sse("[DONE]")
    except RouterError as e:
        yield sse(HTTPError.from_router(e).payload())
    finally:
        await stream.aclose()
