"""`InferenceIngress`: the `monoserve.v1.Inference` gRPC service behind Ray Serve's gRPC proxy.

It does what the monoserve router's front does — validate, tokenize (text / chat / token ids),
detokenize incrementally, stop strings, usage and timings — and sends token ids to the
`EngineReplica` deployment through a Serve handle, whose replica choice is our latency-aware
request router. A replica that dies mid-stream is resumed on another one from prompt + tokens
already sent (greedy output is unchanged; nothing is lost or repeated). Errors are gRPC status
codes set on Serve's gRPC context.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import grpc
import ray
from monoserve.v1 import common_pb2, inference_pb2
from ray import serve

from replicas.engine import InvalidRequest
from replicas.model import ModelConfig
from replicas.server_servicer import sampling_from_proto
from router.detokenizer import TextTokenizer
from router.errors import RouterError
from router.stop_strings import StopMatcher
from router.validate import ModelLimits, prepare

FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
          "cancelled": common_pb2.FINISH_REASON_CANCELLED}
REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class _Failed(Exception):
    """Raised after the status code was set on the gRPC context."""


def _fail(ctx, code: grpc.StatusCode, message: str):
    if ctx is not None:
        ctx.set_code(code)
        ctx.set_details(message)
    raise _Failed(f"{code.name}: {message}")


@serve.deployment
class InferenceIngress:
    def __init__(self, engine, model: str | None, model_name: str, engine_kind: str, max_failovers: int = 3):
        self.engine = engine.options(stream=True)
        config = ModelConfig.from_pretrained(model) if model else None
        self.limits = ModelLimits(name=model_name, vocab_size=config.vocab_size if config else None,
                                  max_context=config.max_context if config else None)
        self.engine_kind = engine_kind
        self.tokenizer = self.template = None
        if model and (Path(model) / "tokenizer.json").is_file():
            from router.chat import ChatTemplate

            self.tokenizer = TextTokenizer.from_pretrained(model)
            self.template = ChatTemplate.from_pretrained(model)
        self.max_failovers = max_failovers
        self._aborts: dict[str, asyncio.Event] = {}

    async def Generate(self, request: inference_pb2.GenerateRequest, grpc_context=None):
        t0 = time.perf_counter()
        try:
            p = await prepare(request, self.limits, self.tokenizer, self.template)
            params = sampling_from_proto(p.sampling)
        except RouterError as e:
            _fail(grpc_context, e.code, e.message)
        except InvalidRequest as e:
            _fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or uuid.uuid4().hex
        detok = self.tokenizer.detokenizer(p.prompt_ids) if self.tokenizer else None
        stops = StopMatcher(p.stops, request.include_stop) if p.stops else None
        abort = self._aborts.setdefault(request_id, asyncio.Event())
        sent: list[int] = []
        end: dict | None = None
        first_at = None
        failovers = 0
        try:
            while end is None:
                if len(sent) >= p.max_tokens:
                    end = {"finish_reason": "length"}
                    break
                stream = self.engine.generate.remote(p.prompt_ids + sent,
                                                     params.model_copy(update={"max_tokens": p.max_tokens - len(sent)}))
                try:
                    async for item in stream:
                        if isinstance(item, dict):
                            end = item
                            break
                        sent.append(item)
                        first_at = first_at or time.perf_counter()
                        text = self._text(detok, stops, item)
                        yield inference_pb2.GenerateResponse(chunk=inference_pb2.Chunk(token_ids=[item], text=text))
                        if (stops and stops.done) or abort.is_set():
                            end = {"finish_reason": "stop" if stops and stops.done else "cancelled"}
                            stream.cancel()
                            break
                except REPLICA_LOST as e:
                    failovers += 1
                    if failovers > self.max_failovers:
                        _fail(grpc_context, grpc.StatusCode.UNAVAILABLE,
                              f"replicas failed {failovers} times during this request: {e}")
                except InvalidRequest as e:
                    _fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self._aborts.pop(request_id, None)
        tail = self._flush(detok, stops)
        if tail:
            yield inference_pb2.GenerateResponse(chunk=inference_pb2.Chunk(text=tail))
        yield inference_pb2.GenerateResponse(final=self._final(end, stops, p, sent, request_id, t0, first_at))

    @staticmethod
    def _text(detok, stops, token: int) -> str:
        if detok is None:
            return ""
        text = detok.step(token)
        return stops.feed(text) if stops else text

    @staticmethod
    def _flush(detok, stops) -> str:
        if detok is None:
            return ""
        text = detok.finish()
        return stops.feed(text) + stops.flush() if stops else text

    @staticmethod
    def _final(end: dict, stops, p, sent, request_id, t0, first_at) -> inference_pb2.Final:
        now = time.perf_counter()
        n = len(sent)
        reason = FINISH[end["finish_reason"]]
        if stops and stops.done:
            reason = common_pb2.FINISH_REASON_STOP
        final = inference_pb2.Final(
            finish_reason=reason, matched_stop=(stops.matched or "") if stops else "",
            usage=common_pb2.Usage(prompt_tokens=len(p.prompt_ids), completion_tokens=n),
            timings=common_pb2.ServerTimings(
                ttft_ms=((first_at or now) - t0) * 1e3, total_ms=(now - t0) * 1e3,
                mean_tpot_ms=(now - first_at) / (n - 1) * 1e3 if first_at and n > 1 else 0.0),
            request_id=request_id, replica_id=end.get("replica_id", ""))
        if end.get("stop_token_id") is not None and not (stops and stops.done):
            final.stop_token_id = end["stop_token_id"]
        return final

    async def Abort(self, request: inference_pb2.AbortRequest) -> inference_pb2.AbortResponse:
        """Stops a request served by this ingress replica (run one ingress replica for Abort)."""
        event = self._aborts.get(request.request_id)
        if event is not None:
            event.set()
        return inference_pb2.AbortResponse(found=event is not None)

    async def ListModels(self, request: inference_pb2.ListModelsRequest) -> inference_pb2.ListModelsResponse:
        return inference_pb2.ListModelsResponse(models=[inference_pb2.ModelInfo(
            id=self.limits.name, context_length=self.limits.max_context or 0,
            vocab_size=self.limits.vocab_size or 0, engine_kinds=[self.engine_kind])])
