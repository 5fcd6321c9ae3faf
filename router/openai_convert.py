"""OpenAI wire format <-> monoserve: requests to `GenerateRequest`, results to OpenAI JSON bodies.

Pure functions (no I/O) so the HTTP layer stays small and these stay easy to test.

Choices made where OpenAI and monoserve differ:
- `temperature` defaults to 1.0 and `top_p` to 1.0, as in OpenAI's API (monoserve's gRPC API
  defaults to greedy); send `temperature: 0` for greedy decoding.
- chat `max_tokens` defaults to the rest of the context window (OpenAI's behaviour);
  completions default to 16 tokens (also OpenAI's).
- Chat messages are rendered here with the checkpoint's chat template (with tools and
  tool-call history, which the gRPC ChatMessages cannot carry) and sent as token ids.
- finish_reason: "stop" (EOS, stop token or stop string) or "length" (max_tokens, context full,
  or the request's X-Request-Timeout passed after output began). `stop_reason` (as in vLLM)
  names the stop string or token id that ended it.
"""

from __future__ import annotations

import time
from typing import Any

from monoserve.v1 import common_pb2, inference_pb2

from router.chat import ChatTemplateError
from router.openai_models import ChatCompletionRequest, CompletionRequest, OpenAIRequestError, SamplingFields

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_DEADLINE: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
}


def _sampling(req: SamplingFields, max_tokens: int | None) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(temperature=1.0 if req.temperature is None else req.temperature)
    if max_tokens is not None:
        s.max_tokens = max_tokens
    s.top_p = 1.0 if req.top_p is None else req.top_p
    if req.seed is not None:
        s.seed = req.seed
    if req.top_k is not None and req.top_k > 0:
        s.top_k = req.top_k
    if req.stop_token_ids:
        s.stop_token_ids.extend(req.stop_token_ids)
    s.ignore_eos = bool(req.ignore_eos)
    return s


def _common(req: SamplingFields, request_id: str, model: str, sampling: common_pb2.SamplingParams):
    return dict(request_id=request_id, model=model, sampling=sampling, stop=req.stop_list,
                include_stop=bool(req.include_stop_str_in_output))


def completion_to_generate(req: CompletionRequest, request_id: str, model: str) -> inference_pb2.GenerateRequest:
    prompt = req.single_prompt
    g = inference_pb2.GenerateRequest(**_common(req, request_id, model, _sampling(req, req.max_tokens)))
    if isinstance(prompt, str):
        g.text = prompt
    else:
        g.token_ids.ids.extend(prompt)
    return g


async def chat_to_generate(req: ChatCompletionRequest, request_id: str, model: str, tokenizer, chat_template,
                     max_context: int | None) -> inference_pb2.GenerateRequest:
    """Render with the chat template, tokenize (no extra special tokens: the template has them).
    Async because long prompts are tokenized off the event loop (other streams keep flowing)."""
    if tokenizer is None or chat_template is None:
        raise OpenAIRequestError("this router was started without a checkpoint directory (--model), so it has no "
                                 "tokenizer or chat template: use /v1/completions with token ids, or restart the "
                                 "router with --model DIR", "messages")
    try:
        text = chat_template.render(req.template_messages(), tools=req.template_tools(),
                                    add_generation_prompt=req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message,
                                    **(req.chat_template_kwargs or {}))
    except ChatTemplateError as e:
        raise OpenAIRequestError(str(e), "messages") from None
    ids = await tokenizer.encode_async(text, add_special_tokens=False)
    if not ids:
        raise OpenAIRequestError("the chat template rendered these messages to an empty prompt", "messages")
    limit = req.output_limit
    if limit is None and max_context:
        limit = max(1, max_context - len(ids))  # too long a prompt is refused by the router with its length
    g = inference_pb2.GenerateRequest(**_common(req, request_id, model, _sampling(req, limit)))
    g.token_ids.ids.extend(ids)
    return g


def usage_json(final: inference_pb2.Final | None) -> dict[str, Any]:
    p = final.usage.prompt_tokens if final else 0
    c = final.usage.completion_tokens if final else 0
    cached = final.usage.cached_prompt_tokens if final else 0  # reused from the session's KV
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_fields(final: inference_pb2.Final) -> dict[str, Any]:
    stop_reason: str | int | None = final.matched_stop or None
    if stop_reason is None and final.HasField("stop_token_id"):
        stop_reason = final.stop_token_id
    return {"finish_reason": FINISH_REASONS.get(final.finish_reason, "stop"), "stop_reason": stop_reason}


def completion_body(rid: str, created: int, model: str, text: str, final: inference_pb2.Final) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, **finish_fields(final)}],
            "usage": usage_json(final)}


def chat_body(rid: str, created: int, model: str, text: str | None, final: inference_pb2.Final,
              tool_calls: list | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    finish = finish_fields(final)
    if tool_calls:
        message["tool_calls"] = [c.as_json() for c in tool_calls]
        finish["finish_reason"] = "tool_calls"
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, **finish}],
            "usage": usage_json(final)}


def completion_chunk(rid: str, created: int, model: str, text: str, final: inference_pb2.Final | None,
                     with_usage: bool) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None,
              **(finish_fields(final) if final else {"finish_reason": None})}
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if with_usage:
        body["usage"] = None
    return body


def chat_chunk(rid: str, created: int, model: str, delta: dict, final: inference_pb2.Final | None,
               with_usage: bool, called_tools: bool = False) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None,
              **(finish_fields(final) if final else {"finish_reason": None})}
    if final is not None and called_tools:
        choice["finish_reason"] = "tool_calls"
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    if with_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the last
    return body


def usage_chunk(rid: str, created: int, model: str, obj: str, final: inference_pb2.Final | None) -> dict:
    """The extra last chunk of `stream_options.include_usage`: no choices, the totals."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_json(final)}


def now() -> int:
    return int(time.time())
