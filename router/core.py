"""The router core: validate, tokenize, pick a replica, stream, detokenize, fail over.

`Router.generate()` is the one entry point, used in-process by both the gRPC servicer
(router/server.py) and the OpenAI HTTP layer. It yields `GenerateResponse` messages (chunks, then
exactly one final) and raises `RouterError` (a gRPC status) for every failure.

- Cancellation: close or cancel the async iterator; the replica call is cancelled at once, so
  the replica stops within one token. `abort(request_id)` ends a request with FINISH_REASON_CANCELLED.
- Deadline (absolute, on `clock`): travels to the replica as the call timeout. When it passes
  before any token was sent -> RouterError(DEADLINE_EXCEEDED); after tokens were sent, the
  stream ends with a Final(FINISH_REASON_DEADLINE) so an in-process caller keeps the partial
  output (a gRPC client's own deadline fires at the same moment: it sees DEADLINE_EXCEEDED).
- Failover: if the replica fails mid-stream (UNAVAILABLE, INTERNAL, UNKNOWN, lost connection),
  the request resumes on another replica with prompt + tokens already sent and max_tokens
  reduced by their count: the client sees no lost or repeated token (exact for greedy).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from monoserve.v1 import admin_pb2, common_pb2, inference_pb2, replica_pb2

from router.detokenizer import TextTokenizer
from router.errors import RouterError, pushback_s
from router.metrics import RouterMetrics
from router.policy import RequestShape
from router.pool import DEFAULT_CONNECT_TIMEOUT_S, ReplicaHandle, ReplicaPool
from router.queue import Dispatcher
from router.stop_strings import StopMatcher
from router.validate import ModelLimits, prepare

# Replica errors after which the request resumes elsewhere (the replica or its link failed).
_FAILOVER_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                   grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS}
_MAX_FAILOVERS = 8
# Refusals for lack of a slot from one replica, after which a request stops trying it. Each retry
# follows a load report or re-check saying a slot is free, so this many in a row means its slot
# accounting disagrees with its engine (or other routers win every race for it).
MAX_BUSY_REFUSALS = 10
_STATE_NAMES = {admin_pb2.REPLICA_STATE_CONNECTING: "connecting", admin_pb2.REPLICA_STATE_READY: "ready",
                admin_pb2.REPLICA_STATE_EJECTED: "ejected", admin_pb2.REPLICA_STATE_DRAINING: "draining"}
_counter = itertools.count()


@dataclass
class _Running:
    """A request in flight (for Abort)."""

    call: grpc.aio.UnaryStreamCall | None = None
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


def _response(chunk_ids=(), text="") -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(chunk=inference_pb2.Chunk(token_ids=chunk_ids, text=text))


class Router:
    def __init__(self, *, tokenizer: TextTokenizer | None = None, chat_template=None, model_name: str = "",
                 queue_size: int = 64, metrics: RouterMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._model_name = model_name
        self.metrics = metrics or RouterMetrics()
        self.clock = clock
        self.pool = ReplicaPool(self._on_pool_change, clock, connect_timeout_s)
        self.dispatcher = Dispatcher(self.pool, queue_size, self.metrics, clock)
        self._running: dict[str, _Running] = {}
        for state, name in _STATE_NAMES.items():  # computed when scraped, not on every change
            self.metrics.replicas.labels(name).set_function(
                lambda state=state: self.pool.count_by_state().get(state, 0))

    # -- pool ---------------------------------------------------------------------------------

    def _on_pool_change(self) -> None:
        self.dispatcher.pump()

    def add_replica(self, address: str) -> ReplicaHandle:
        return self.pool.add(address)

    async def remove_replica(self, address: str, drain: bool = True) -> int:
        return await self.pool.remove(address, drain)

    async def close(self) -> None:
        await self.pool.close()

    @property
    def model(self) -> ModelLimits:
        info = next((h.info for h in self.pool.replicas.values() if h.info is not None), None)
        if info is None:
            return ModelLimits(self._model_name or "default")
        return ModelLimits(self._model_name or info.model_name, info.shape.vocab_size or None,
                           info.max_context or None)

    def list_models(self) -> inference_pb2.ListModelsResponse:
        model = self.model
        handles = list(self.pool.replicas.values())
        kinds = sorted({h.info.engine_kind for h in handles if h.info})
        healthy = sum(1 for h in handles if h.healthy and not h.draining)
        return inference_pb2.ListModelsResponse(models=[inference_pb2.ModelInfo(
            id=model.name, context_length=model.max_context or 0, vocab_size=model.vocab_size or 0,
            engine_kinds=kinds, replicas=healthy)])

    def abort(self, request_id: str) -> bool:
        running = self._running.get(request_id)
        if running is None:
            return False
        running.aborted.set()
        if running.call is not None:
            running.call.cancel()
        return True

    # -- generate -------------------------------------------------------------------------------

    async def generate(self, req: inference_pb2.GenerateRequest, *,
                       deadline: float | None = None) -> AsyncIterator[inference_pb2.GenerateResponse]:
        t0 = self.clock()
        outcome = "error"
        try:
            request_id = req.request_id or uuid.uuid4().hex
            if request_id in self._running:
                raise RouterError(grpc.StatusCode.ALREADY_EXISTS,
                                  f"request_id {request_id!r} is already running: use a unique id per request")
            running = self._running[request_id] = _Running()  # abortable from now on, also while tokenizing
            try:
                prepared = await prepare(req, self.model, self.tokenizer, self.chat_template)
                stream = _Stream(self, req, prepared, request_id, running, deadline, t0)
                # aclosing: a caller that closes us early cancels the replica call now, not at GC
                async with contextlib.aclosing(stream.run()) as responses:
                    async for response in responses:
                        yield response
                outcome = stream.outcome
            finally:
                del self._running[request_id]
        except RouterError as e:
            outcome = e.code.name.lower()
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            self.metrics.aborts.inc()
            raise
        finally:
            self.metrics.requests.labels(outcome).inc()


class _Stream:
    """One request's life: acquire, stream, fail over, finish."""

    def __init__(self, router: Router, req, prepared, request_id: str, running: _Running,
                 deadline: float | None, t0: float):
        self.r, self.req, self.p = router, req, prepared
        self.request_id, self.running, self.deadline, self.t0 = request_id, running, deadline, t0
        tok = router.tokenizer
        self.detok = tok.detokenizer(prepared.prompt_ids) if tok else None
        self.stops = StopMatcher(prepared.stops, req.include_stop) if prepared.stops else None
        self.sent: list[int] = []
        self.queue_s = 0.0
        self.t_first = self.t_last = None
        self.outcome = "error"
        self.admitted = False  # once a replica was bound, failover/retry never meets admission again

    def _shape(self) -> RequestShape:
        return RequestShape(len(self.p.prompt_ids) + len(self.sent), self.p.max_tokens - len(self.sent),
                            self.req.session_id)

    async def _acquire(self, exclude: frozenset[str]) -> ReplicaHandle | None:
        """A replica slot, or None if the request was aborted while waiting."""
        dispatcher = self.r.dispatcher
        handle = dispatcher.try_acquire(self._shape(), exclude)
        if handle is not None:
            self.r.metrics.queue_wait.observe(0.0)
            return handle
        t = self.r.clock()
        acquire = asyncio.ensure_future(dispatcher.acquire(self._shape(), self.deadline, exclude,
                                                           admitted=self.admitted))
        aborted = asyncio.ensure_future(self.running.aborted.wait())
        waited = False
        try:
            await asyncio.wait((acquire, aborted), return_when=asyncio.FIRST_COMPLETED)
            waited = True
        finally:
            aborted.cancel()
            if not acquire.done():
                acquire.cancel()
                await asyncio.gather(acquire, return_exceptions=True)
            if not waited:  # cancelled, possibly just as a slot was bound to us: hand it back
                self._give_back(acquire)
            self.queue_s += self.r.clock() - t
            self.r.metrics.queue_wait.observe(self.r.clock() - t)
        return acquire.result() if not self.running.aborted.is_set() else self._give_back(acquire)

    def _give_back(self, acquire: asyncio.Future) -> None:
        if not acquire.cancelled() and acquire.exception() is None:
            self.r.dispatcher.release(acquire.result(), self._shape().max_tokens)
        return None

    def _text(self, ids: list[int]) -> tuple[list[int], str]:
        """The ids to send and their text; ids end at the token that completed a stop string (a
        chunk may hold more: tokens pile up behind a slow reader)."""
        if self.detok is None:
            return ids, ""
        pieces = []
        for i, t in enumerate(ids):
            piece = self.detok.step(t)
            pieces.append(self.stops.feed(piece) if self.stops else piece)
            if self.stops and self.stops.done:
                return ids[:i + 1], "".join(pieces)
        return ids, "".join(pieces)

    def _flush_text(self) -> str:
        if self.detok is None:
            return ""
        text = self.detok.finish()
        if self.stops:
            text = self.stops.feed(text) + self.stops.flush()
        return text

    async def run(self) -> AsyncIterator[inference_pb2.GenerateResponse]:
        exclude: set[str] = set()
        replica_final = None
        handle = None
        failures = 0  # replica failures only: a lost race for a slot (_ReplicaBusy) is no failure
        busy: dict[str, int] = {}  # address -> its refusals for lack of a slot
        while True:
            if self.running.aborted.is_set():
                break
            left = self.p.max_tokens - len(self.sent)
            context = self.r.model.max_context
            if left <= 0 or (context and len(self.p.prompt_ids) + len(self.sent) >= context):
                break  # everything was sent before the replica failed, or the window is full: LENGTH
            try:
                handle = await self._acquire(frozenset(exclude))
            except RouterError as e:  # e.g. the deadline passed while waiting to fail over
                if e.code != grpc.StatusCode.DEADLINE_EXCEEDED or not self.sent:
                    raise
                for response in self._deadline_end(None):
                    yield response
                return
            if handle is None:
                break  # aborted while queued
            self.admitted = True
            shape = self._shape()
            stream = self._stream_from(handle, left)
            try:
                try:
                    async for event in stream:
                        if isinstance(event, inference_pb2.GenerateResponse):
                            yield event
                            if self.stops and self.stops.done:
                                break  # a stop string ended it: the replica call is cancelled below
                        else:
                            replica_final = event
                finally:
                    await stream.aclose()  # cancels the replica call if it is still running
                break
            except _ReplicaBusy as refusal:  # lost a race for its last slot: wait for the next free one
                refusals = busy[handle.address] = busy.get(handle.address, 0) + 1
                if refusals >= MAX_BUSY_REFUSALS:
                    exclude.add(handle.address)  # it keeps refusing: only the others from now on
                    if not self.r.pool.could_serve(exclude):
                        raise RouterError(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"replica {handle.address} refused this request {refusals} times for lack of a "
                            f"free slot although it reported one, and no other replica can take it: retry "
                            f"later or add replicas", retry_after_s=refusal.pushback_s or 1.0) from None
            except _ReplicaFailed as failure:
                failures += 1
                if failures > _MAX_FAILOVERS:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"gave up after {failures} replica failures; last: {failure}") from None
                handle.mark_failed(str(failure))
                exclude.add(handle.address)
                self.r.metrics.failovers.inc()
            except _DeadlineHit:
                for response in self._deadline_end(handle):
                    yield response
                return
            finally:
                self.r.dispatcher.release(handle, shape.max_tokens)

        if self.req.session_id and replica_final is not None:  # what the replica now holds for it
            self.r.pool.session_grew(self.req.session_id, handle.address, len(self.p.prompt_ids) + len(self.sent))
        flush = self._flush_text()
        if flush:
            yield _response(text=flush)
        if self.stops and self.stops.done:
            reason = common_pb2.FINISH_REASON_STOP
        elif self.running.aborted.is_set():
            reason = common_pb2.FINISH_REASON_CANCELLED
            self.r.metrics.aborts.inc()
        elif replica_final is not None:
            reason = replica_final.finish_reason
        else:
            reason = common_pb2.FINISH_REASON_LENGTH
        self.outcome = common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
        yield self._final(reason, handle, replica_final)

    def _deadline_end(self, handle: ReplicaHandle | None) -> list[inference_pb2.GenerateResponse]:
        """The deadline passed: the partial output's last text and a Final(DEADLINE), or an error
        if nothing was sent yet."""
        if not self.sent:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the first token")
        flush = self._flush_text()
        self.outcome = "deadline"
        return ([_response(text=flush)] if flush else []) + [self._final(common_pb2.FINISH_REASON_DEADLINE,
                                                                          handle, None)]

    async def _stream_from(self, handle: ReplicaHandle, max_tokens: int):
        """Yield client responses for one replica call, then the ReplicaFinal (if any)."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.p.sampling)
        sampling.max_tokens = max_tokens
        request = replica_pb2.ReplicaGenerateRequest(
            request_id=f"{self.request_id}#{next(_counter)}", prompt_token_ids=self.p.prompt_ids + self.sent,
            sampling=sampling, session_id=self.req.session_id)
        timeout = None if self.deadline is None else self.deadline - self.r.clock()
        if timeout is not None and timeout <= 0:
            raise _DeadlineHit()
        if self.running.aborted.is_set():
            return
        try:
            call = handle.stub.Generate(request, timeout=timeout)
        except grpc.aio.UsageError as e:  # removed without drain (channel closed) after we were bound
            raise _ReplicaFailed(f"{handle.address}: {e}") from None
        self.running.call = call
        got_final = False
        try:
            async for msg in call:
                if msg.HasField("chunk"):
                    ids, text = self._text(list(msg.chunk.token_ids))
                    if not ids:
                        continue
                    self.sent.extend(ids)
                    now = self.r.clock()
                    if self.t_first is None:
                        self.t_first = now
                        self.r.metrics.ttft.observe(now - self.t0)
                    self.t_last = now
                    yield _response(ids, text)
                else:
                    got_final = True
                    yield msg.final
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the client went away
            if self.running.aborted.is_set():
                return  # our own abort cancelled the call: finish normally (CANCELLED)
            # the call was cancelled under us: its replica was removed without drain
            raise _ReplicaFailed(f"{handle.address}: call cancelled (replica removed)") from None
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise _DeadlineHit() from None
            if code == grpc.StatusCode.CANCELLED and self.running.aborted.is_set():
                return
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # only ever before the first token
                pushback = pushback_s(e)
                handle.refused_busy(pushback)  # raced another client for its last slot
                raise _ReplicaBusy(pushback) from None
            if code in _FAILOVER_CODES:
                raise _ReplicaFailed(f"{handle.address}: {code.name}: {e.details()}") from None
            raise RouterError(code, e.details() or code.name) from None
        finally:
            self.running.call = None
            if not call.done():
                call.cancel()  # client went away: stop the replica now
        if not got_final and not self.running.aborted.is_set():
            raise _ReplicaFailed(f"{handle.address}: stream ended without a final message")

    def _final(self, reason, handle: ReplicaHandle | None, replica_final) -> inference_pb2.GenerateResponse:
        now = self.r.clock()
        n = len(self.sent)
        tpot = (self.t_last - self.t_first) / (n - 1) if n > 1 else 0.0
        if n > 1:
            self.r.metrics.tpot.observe(tpot)
        final = inference_pb2.Final(
            finish_reason=reason, matched_stop=(self.stops.matched or "") if self.stops else "",
            usage=common_pb2.Usage(prompt_tokens=len(self.p.prompt_ids), completion_tokens=n, cached_prompt_tokens=(
                replica_final.usage.cached_prompt_tokens if replica_final is not None else 0)),
            timings=common_pb2.ServerTimings(
                queue_ms=self.queue_s * 1e3, ttft_ms=((self.t_first or now) - self.t0) * 1e3,
                mean_tpot_ms=tpot * 1e3, total_ms=(now - self.t0) * 1e3,
                prefill_ms=replica_final.timings.prefill_ms if replica_final is not None else 0.0),
            request_id=self.request_id, replica_id=handle.replica_id if handle else "")
        if replica_final is not None and replica_final.HasField("stop_token_id") \
                and reason == common_pb2.FINISH_REASON_STOP and not (self.stops and self.stops.done):
            final.stop_token_id = replica_final.stop_token_id
        return inference_pb2.GenerateResponse(final=final)


class _ReplicaFailed(Exception):
    pass


class _DeadlineHit(Exception):
    pass


class _ReplicaBusy(Exception):
    def __init__(self, pushback_s: float | None):
        super().__init__(pushback_s)
        self.pushback_s = pushback_s
