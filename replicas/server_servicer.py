"""The `monoserve.v1.Replica` servicer: Generate, Abort, WatchLoad, GetInfo over one Engine.

Threading: handlers run on the server's event loop; each generation iterates in a worker thread
(the engine blocks), which hands every token to the loop with `call_soon_threadsafe` as soon as
it exists — nothing is held back (tokens share a chunk only if they piled up behind a slow
reader). Slot accounting happens only on the loop (server_load.LoadTracker); a slot is freed
when the worker has closed its generation and before the final message goes out, so the engine
is really free when the caller's next request arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from monoserve.v1 import common_pb2, replica_pb2, replica_pb2_grpc

from replicas.engine import (
    Engine,
    EngineBusy,
    EngineFailed,
    FinishReason,
    Generation,
    InvalidRequest,
    SamplingParams,
    accepts_session_id,
    validate_prompt,
)
from replicas.metrics import ReplicaMetrics
from replicas.server_load import LoadTracker, Slot

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # WatchLoad re-sends the current load this often when nothing changes
UNHEALTHY_AFTER = 3  # consecutive engine failures before readiness turns NOT_SERVING
PROBE_INTERVAL_S = 2.0  # while unhealthy, a 1-token probe generation this often; success = healthy again
MAX_SESSION_ID_CHARS = 256  # session ids key the engine's session KV; the router enforces the same

_FINISH = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


def sampling_from_proto(s: common_pb2.SamplingParams) -> SamplingParams:
    """Proto sampling -> engine SamplingParams; unset optional fields take engine defaults."""
    for name in ("temperature", "top_p"):
        if not math.isfinite(getattr(s, name)):
            raise InvalidRequest(f"invalid sampling parameters: {name} must be a finite number, got {getattr(s, name)}")
    kw: dict = dict(temperature=s.temperature, top_k=s.top_k, stop_token_ids=list(s.stop_token_ids),
                    ignore_eos=s.ignore_eos)
    for name in ("max_tokens", "top_p", "seed"):
        if s.HasField(name):
            kw[name] = getattr(s, name)
    return SamplingParams.parse(**kw)


@dataclass
class Running:
    """A generation in flight: the loop-side view the handler, Abort and the worker share."""

    request_id: str
    queue: asyncio.Queue  # (kind, value, perf_counter time): token | done | invalid | busy | error
    session_id: str = ""  # passed to engines that keep sessions' KV between turns
    generation: Generation | None = None
    engine_started_at: float = 0.0  # when the worker handed the prompt to the engine
    aborted: bool = False
    cancel_requested: bool = False
    started_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancel_requested = True
        if self.generation is not None:
            self.generation.cancel()


class ReplicaServicer(replica_pb2_grpc.ReplicaServicer):
    def __init__(self, engine: Engine, load: LoadTracker, metrics: ReplicaMetrics, info: replica_pb2.GetInfoResponse,
                 on_health_change=None):
        self.engine = engine
        self.load = load
        self.metrics = metrics
        self.info = info
        self.running: dict[str, Running] = {}
        self._ids = itertools.count(1)
        self._executor = ThreadPoolExecutor(max_workers=engine.max_batch + 2, thread_name_prefix="replica-gen")
        self._failures = 0  # consecutive engine failures
        self.probe_interval_s = PROBE_INTERVAL_S
        self._probe_task: asyncio.Task | None = None
        self._on_health_change = on_health_change  # async callable(healthy: bool)
        self._sessions = accepts_session_id(engine)  # else session_id only steers the router

    # ---- Generate ------------------------------------------------------------------------
    async def Generate(self, request: replica_pb2.ReplicaGenerateRequest, context: grpc.aio.ServicerContext):
        received = time.perf_counter()
        try:
            params = sampling_from_proto(request.sampling)
            prompt = validate_prompt(request.prompt_token_ids, params, self.engine.config, self.engine.max_context)
            if len(request.session_id) > MAX_SESSION_ID_CHARS:
                raise InvalidRequest(f"session_id is {len(request.session_id)} characters; use at most "
                                     f"{MAX_SESSION_ID_CHARS}")
        except InvalidRequest as e:
            self.metrics.requests("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or f"auto-{next(self._ids)}"
        if request_id in self.running:
            self.metrics.requests("invalid").inc()
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id {request_id!r} is already running on this replica; use a unique id")
        if self.load.draining:
            self.metrics.requests("unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"replica {self.load.replica_id} is draining and admits no new requests; "
                                "send it to another replica")
        if not self.load.has_free_slot():
            await self._reject_busy(context)

        run = Running(request_id, asyncio.Queue(), session_id=request.session_id, started_at=received)
        self.running[request_id] = run
        slot = self.load.admit(request_id, min(params.max_tokens, self.engine.max_context - len(prompt)))
        self.metrics.active_slots.set(self.load.busy)
        loop = asyncio.get_running_loop()
        self._executor.submit(self._worker, loop, run, prompt, params)
        try:
            async for response in self._stream(run, slot, len(prompt), context):
                yield response
        finally:
            # client cancel, deadline, server stop or a normal end: the engine stops within a token
            run.cancel()

    async def _reject_busy(self, context) -> None:
        self.metrics.requests("rejected").inc()
        pushback = int(self.load.snapshot().expected_slot_free_ms) or 1
        context.set_trailing_metadata((("grpc-retry-pushback-ms", str(pushback)),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"all {self.load.capacity} slots of replica {self.load.replica_id} are busy; "
                            f"retry in about {pushback} ms or use another replica")

    async def _stream(self, run: Running, slot: Slot, prompt_tokens: int, context):
        first_at = last_at = None
        outcome = "cancelled"
        pending = None  # a non-token item read while collecting tokens
        try:
            while True:
                kind, value, t = pending or await run.queue.get()
                pending = None
                if kind == "token":
                    # Each token is sent as soon as it exists; only tokens that piled up while the
                    # previous send was in flight (a slow consumer) share a chunk. Never waits.
                    ids = []
                    while True:
                        if first_at is None:
                            first_at = t
                            self.metrics.ttft.observe(t - run.started_at)
                            # only the tokens really prefilled (not those reused from a session)
                            reused = getattr(run.generation, "reused_tokens", 0)
                            self.load.observe_prefill(t - run.engine_started_at, prompt_tokens - reused)
                        else:
                            self.metrics.tpot.observe(t - last_at)
                            self.load.observe_tpot(t - last_at)
                        last_at = t
                        ids.append(value)
                        if run.queue.empty():
                            break
                        kind, value, t = run.queue.get_nowait()
                        if kind != "token":
                            pending = (kind, value, t)
                            break
                    slot.produced += len(ids)
                    self.metrics.tokens.inc(len(ids))
                    yield replica_pb2.ReplicaGenerateResponse(chunk=replica_pb2.ReplicaChunk(token_ids=ids))
                elif kind == "done":
                    gen: Generation = value
                    reason = _FINISH[gen.finish_reason or FinishReason.CANCELLED]
                    outcome = "aborted" if run.aborted else gen.finish_reason.value
                    yield replica_pb2.ReplicaGenerateResponse(final=self._final(
                        gen, reason, prompt_tokens, slot.produced, run, first_at, last_at, t))
                    return
                elif kind == "invalid":
                    outcome = "invalid"
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, value)
                elif kind == "busy":
                    outcome = "rejected"
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, value)
                else:  # "error" / "fatal": the engine failed; the router resumes elsewhere from the tokens it has
                    outcome = "error"
                    await context.abort(grpc.StatusCode.INTERNAL,
                                        f"engine failed after {slot.produced} tokens: {value}")
        finally:
            if outcome == "cancelled" and context.time_remaining() is not None and context.time_remaining() <= 0:
                outcome = "deadline"
            self.metrics.requests(outcome).inc()

    @staticmethod
    def _final(gen, reason, prompt_tokens, produced, run: Running, first_at, last_at, end) -> replica_pb2.ReplicaFinal:
        ms, start = 1e3, run.started_at
        timings = common_pb2.ServerTimings(
            queue_ms=0.0,  # a replica admits at once or refuses
            ttft_ms=(first_at - start) * ms if first_at else 0.0,
            prefill_ms=(first_at - run.engine_started_at) * ms if first_at else 0.0,
            mean_tpot_ms=(last_at - first_at) * ms / (produced - 1) if produced > 1 else 0.0,
            total_ms=(end - start) * ms,
        )
        final = replica_pb2.ReplicaFinal(
            finish_reason=reason, timings=timings,
            usage=common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=produced,
                                   cached_prompt_tokens=getattr(gen, "reused_tokens", 0)))
        if gen.stop_token_id is not None:
            final.stop_token_id = gen.stop_token_id
        return final

    def _worker(self, loop: asyncio.AbstractEventLoop, run: Running, prompt: list[int], params: SamplingParams):
        """Runs in a worker thread: drive the engine, hand each token to the loop at once."""
        def post(kind, value=None):
            loop.call_soon_threadsafe(run.queue.put_nowait, (kind, value, time.perf_counter()))

        gen = None
        end = ("error", "the engine stopped without a reason", 0.0)
        try:
            run.engine_started_at = time.perf_counter()
            if run.session_id and self._sessions:
                gen = self.engine.generate(prompt, params, session_id=run.session_id)
            else:
                gen = self.engine.generate(prompt, params)
            run.generation = gen
            if run.cancel_requested:  # cancelled before the engine started
                gen.cancel()
            for token in gen:
                post("token", token)
            end = ("done", gen, time.perf_counter())
        except InvalidRequest as e:
            end = ("invalid", str(e), time.perf_counter())
        except EngineBusy as e:  # the engine's own slot count disagrees with ours: refuse, retryable
            end = ("busy", str(e), time.perf_counter())
        except EngineFailed as e:  # fatal for the replica: unhealthy at once (routers stop sending), not after 3
            log.error("engine failed for good during request %s: %s", run.request_id, e)
            end = ("fatal", f"{type(e).__name__}: {e}", time.perf_counter())
        except Exception as e:
            log.exception("engine failed during request %s", run.request_id)
            end = ("error", f"{type(e).__name__}: {e}", time.perf_counter())
        finally:
            if gen is not None:
                gen.close()
            loop.call_soon_threadsafe(self._finished, run, end)

    def _finished(self, run: Running, end: tuple) -> None:
        """On the loop, once the engine has let go of the generation: free the slot, then let the
        handler send the final message (so a caller that sends its next request as soon as it sees
        the final one always finds the slot free)."""
        failed = end[0] in ("error", "fatal")
        self.running.pop(run.request_id, None)
        self.load.release(run.request_id)
        self.metrics.active_slots.set(self.load.busy)
        self._failures = (max(self._failures + 1, UNHEALTHY_AFTER) if end[0] == "fatal"
                          else self._failures + 1 if failed else 0)
        healthy = self._failures < UNHEALTHY_AFTER
        if healthy != self.load.healthy:
            self.load.set_healthy(healthy)
            if self._on_health_change is not None:
                asyncio.ensure_future(self._on_health_change(healthy))
            if not healthy and self._probe_task is None:
                self._probe_task = asyncio.ensure_future(self._probe_until_healthy())
        run.queue.put_nowait(end)

    async def _probe_until_healthy(self) -> None:
        """Routers send nothing to an unhealthy replica, so it tests itself: a 1-token generation
        every probe interval; the first success (via _finished) makes it healthy again."""
        probe = SamplingParams(max_tokens=1, ignore_eos=True)
        prompt = [self.engine.config.bos_token_id or 0]
        try:
            while not self.load.healthy and not self.load.closed:
                await asyncio.sleep(self.probe_interval_s)
                if self.load.draining or not self.load.has_free_slot():
                    continue
                run = Running(f"health-probe-{next(self._ids)}", asyncio.Queue())
                self.running[run.request_id] = run
                self.load.admit(run.request_id, 1)
                self._executor.submit(self._worker, asyncio.get_running_loop(), run, prompt, probe)
                while (await run.queue.get())[0] == "token":
                    pass
        finally:
            self._probe_task = None

    # ---- Abort, WatchLoad, GetInfo -------------------------------------------------------
    async def Abort(self, request: replica_pb2.ReplicaAbortRequest, context) -> replica_pb2.ReplicaAbortResponse:
        run = self.running.get(request.request_id)
        if run is None:
            return replica_pb2.ReplicaAbortResponse(found=False)
        run.aborted = True
        run.cancel()
        self.metrics.aborts.inc()
        return replica_pb2.ReplicaAbortResponse(found=True)

    async def WatchLoad(self, request: replica_pb2.WatchLoadRequest, context):
        while not self.load.closed:
            changed = self.load.change_event  # before the snapshot: a change while we send is not lost
            yield self.load.snapshot()
            try:
                await asyncio.wait_for(changed.wait(), HEARTBEAT_S)
            except asyncio.TimeoutError:
                pass  # heartbeat: re-send the current load

    async def GetInfo(self, request: replica_pb2.GetInfoRequest, context) -> replica_pb2.GetInfoResponse:
        return self.info

    # ---- lifecycle -----------------------------------------------------------------------
    def cancel_all(self) -> None:
        for run in list(self.running.values()):
            run.cancel()

    def shutdown(self) -> None:
        self.cancel_all()
        self._executor.shutdown(wait=True, cancel_futures=True)
