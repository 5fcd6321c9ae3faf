"""Turn a client `GenerateRequest` into what a replica needs — or an INVALID_ARGUMENT saying what
to fix. Tokenization and chat templating happen here (in the router, not on the replicas)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from monoserve.v1 import common_pb2, inference_pb2

from router.detokenizer import TextTokenizer
from router.errors import invalid
from router.stop_strings import StopStringError, validate_stops

DEFAULT_MAX_TOKENS = 16
MAX_SESSION_ID_CHARS = 256  # replicas key their session KV by it; same limit there


@dataclass(frozen=True)
class ModelLimits:
    """What the router knows about the served model (from a replica's GetInfo)."""

    name: str
    vocab_size: int | None = None
    max_context: int | None = None


@dataclass
class Prepared:
    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams  # with max_tokens set
    max_tokens: int
    stops: tuple[str, ...]


async def prepare(req: inference_pb2.GenerateRequest, model: ModelLimits, tokenizer: TextTokenizer | None,
            chat_template=None) -> Prepared:
    if req.model and req.model != model.name:
        raise invalid(f"unknown model {req.model!r}: this router serves {model.name!r} "
                      f"(leave model empty or use one listed by ListModels)")
    prompt_ids = await _prompt_ids(req, tokenizer, chat_template)
    if not prompt_ids:
        raise invalid("prompt is empty: give non-empty text, token_ids or chat messages")
    # the length first: it is O(1), the vocabulary scan of a huge prompt is not
    if model.max_context and len(prompt_ids) >= model.max_context:
        raise invalid(f"prompt is {len(prompt_ids)} tokens but the context window is {model.max_context}: "
                      f"shorten the prompt")
    if model.vocab_size:
        bad = next((t for t in prompt_ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise invalid(f"prompt token id {bad} is outside the vocabulary [0, {model.vocab_size})")
    if len(req.session_id) > MAX_SESSION_ID_CHARS:
        raise invalid(f"session_id is {len(req.session_id)} characters; use at most {MAX_SESSION_ID_CHARS} "
                      f"(e.g. a UUID per conversation)")
    sampling = _sampling(req.sampling, model)
    try:
        stops = validate_stops(req.stop)
    except StopStringError as e:
        raise invalid(f"stop: {e}") from None
    max_tokens = sampling.max_tokens
    if model.max_context:  # no more than the window leaves room for (admission and routing estimate from it)
        max_tokens = min(max_tokens, model.max_context - len(prompt_ids))
    return Prepared(prompt_ids, sampling, max_tokens, stops)


async def _prompt_ids(req, tokenizer: TextTokenizer | None, chat_template) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise invalid("no prompt: set one of text, token_ids or chat")
    if kind == "token_ids":
        return list(req.token_ids.ids)
    if tokenizer is None:
        raise invalid(f"this router has no tokenizer, so it cannot take a {kind} prompt: send token_ids, "
                      f"or start the router with --model CHECKPOINT_DIR")
    if kind == "text":
        if not req.text:
            raise invalid("prompt text is empty")
        return await tokenizer.encode_async(req.text)
    # chat
    if not req.chat.messages:
        raise invalid("chat has no messages: give at least one")
    if chat_template is None or not getattr(chat_template, "available", True):
        raise invalid("the served checkpoint has no chat template: send text or token_ids instead")
    from router.chat import ChatTemplateError  # the OpenAI engineer's module

    messages = []
    for m in req.chat.messages:
        msg = {"role": m.role, "content": m.content}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    add_prompt = req.chat.add_generation_prompt if req.chat.HasField("add_generation_prompt") else True
    try:
        text = chat_template.render(messages, add_generation_prompt=add_prompt)
    except ChatTemplateError as e:
        raise invalid(f"chat: {e}") from None
    return await tokenizer.encode_async(text, add_special_tokens=False)  # the template holds BOS etc.


def _sampling(s: common_pb2.SamplingParams, model: ModelLimits) -> common_pb2.SamplingParams:
    out = common_pb2.SamplingParams()
    out.CopyFrom(s)
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise invalid(f"sampling.max_tokens must be >= 1, got {max_tokens}")
    out.max_tokens = max_tokens
    if not (math.isfinite(s.temperature) and 0.0 <= s.temperature <= 100.0):
        raise invalid(f"sampling.temperature must be in [0, 100] (0 = greedy), got {s.temperature}")
    if s.HasField("top_p") and not (math.isfinite(s.top_p) and 0.0 < s.top_p <= 1.0):
        raise invalid(f"sampling.top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise invalid(f"sampling.top_k must be >= 0 (0 = no limit), got {s.top_k}")
    if s.HasField("seed") and s.seed < 0:
        raise invalid(f"sampling.seed must be in [0, 2^63), got {s.seed}")
    for t in s.stop_token_ids:
        if t < 0 or (model.vocab_size and t >= model.vocab_size):
            raise invalid(f"sampling.stop_token_ids has {t}, outside the vocabulary [0, {model.vocab_size or '?'})")
    return out
