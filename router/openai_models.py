"""Request bodies of the OpenAI-compatible HTTP API, validated with pydantic.

Strict on purpose: wrong types are not coerced ("0.5" is not a number), unknown fields are
rejected (a typo such as `max_token` would otherwise be silently ignored), and options we
cannot honour (n > 1, logprobs, penalties, JSON mode, forced tool calls) are refused with a
message that says what to change, instead of being ignored.

Beyond OpenAI's fields we accept a few widely used extensions (the same names as vLLM):
`top_k`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, and for chat
`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` (e.g.
`{"enable_thinking": false}` for Qwen3 templates). And monoserve's own `session_id` (agent
sessions: the replica keeps the conversation's KV between turns, see docs/sessions.md).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from router.validate import MAX_SESSION_ID_CHARS


class OpenAIRequestError(ValueError):
    """A request body we refuse (HTTP 400); `param` names the offending field (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # accepted for vLLM clients; only the last chunk carries usage


class SamplingFields(_Strict):
    """Fields shared by both endpoints."""

    model: StrictStr
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: StrictStr | None = None
    # extensions (vLLM names)
    top_k: StrictInt | None = Field(None, ge=-1)
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    # monoserve extension: requests of one conversation with the same id reuse its KV (docs/sessions.md)
    session_id: StrictStr | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if self.session_id is not None:
            check_session_id(self.session_id, "`session_id`")
        if self.n not in (None, 1):
            raise OpenAIRequestError(f"n={self.n} is not supported: monoserve returns one choice per request; "
                                     "send n=1 (or several requests)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise OpenAIRequestError(f"{name} is not supported by monoserve's engines: omit it or send 0", name)
        if self.logit_bias:
            raise OpenAIRequestError("logit_bias is not supported by monoserve's engines: omit it", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIRequestError("stream_options is only allowed with stream=true", "stream_options")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions"""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = None

    @model_validator(mode="after")
    def _refuse_unsupported_completion(self):
        if self.logprobs is not None:
            raise OpenAIRequestError("logprobs are not available: monoserve's engines do not return token "
                                     "log probabilities; remove `logprobs`", "logprobs")
        if self.echo:
            raise OpenAIRequestError("echo=true is not supported: the response holds only the completion", "echo")
        if self.suffix:
            raise OpenAIRequestError("suffix (fill-in-the-middle) is not supported: omit it", "suffix")
        if self.best_of not in (None, 1):
            raise OpenAIRequestError("best_of > 1 is not supported: send best_of=1 or omit it", "best_of")
        prompt = self.prompt
        if isinstance(prompt, list):
            if not prompt:
                raise OpenAIRequestError("prompt is empty: give a string or a list of token ids", "prompt")
            if isinstance(prompt[0], (str, list)) and len(prompt) != 1:
                raise OpenAIRequestError(f"prompt holds {len(prompt)} prompts; monoserve takes one prompt per "
                                         "request: send them as separate requests", "prompt")
        elif not prompt:
            raise OpenAIRequestError("prompt is empty: give at least one character", "prompt")
        return self

    @property
    def single_prompt(self) -> str | list[int]:
        """The prompt as text or as token ids."""
        p = self.prompt
        return p[0] if isinstance(p, list) and isinstance(p[0], (str, list)) else p


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr | dict[str, Any]  # OpenAI sends a JSON string; templates want an object


class ToolCall(_Strict):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    refusal: StrictStr | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise OpenAIRequestError(f"a {self.role} message needs `content`", "messages")
        if self.tool_calls and self.role != "assistant":
            raise OpenAIRequestError("only assistant messages may carry tool_calls", "messages")
        return self


class FunctionDef(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions"""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    # extensions
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_unsupported_chat(self):
        if self.logprobs or self.top_logprobs is not None:
            raise OpenAIRequestError("logprobs are not available: monoserve's engines do not return token "
                                     "log probabilities; remove `logprobs`/`top_logprobs`", "logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise OpenAIRequestError("max_tokens and max_completion_tokens disagree: send only one", "max_tokens")
        if self.tool_choice not in (None, "none", "auto"):
            raise OpenAIRequestError("tool_choice must be 'auto' or 'none': monoserve cannot force a tool call",
                                     "tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            raise OpenAIRequestError("response_format other than {'type': 'text'} is not supported "
                                     "(no constrained JSON decoding): omit it", "response_format")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates expect them: text content, tool-call arguments as objects."""
        out = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": _text_content(m.content, i)}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name,
                                                   "arguments": _arguments(c.function.arguments)}}
                                     for c in m.tool_calls]
            out.append(msg)
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _text_content(content: str | list[dict[str, Any]] | None, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text":
            raise OpenAIRequestError(f"messages[{index}].content[{j}] has type {part.get('type')!r}: monoserve's "
                                     "models take text only (type 'text')", "messages")
        try:
            texts.append(TextPart.model_validate(part).text)
        except ValidationError:
            raise OpenAIRequestError(f"messages[{index}].content[{j}] must be {{'type': 'text', 'text': <string>}}",
                                     "messages") from None
    return "\n".join(texts)


def _arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # not JSON: let the template print it as given


def check_session_id(value: str, where: str) -> str:
    """A session id as the router takes it ("" = no session), or OpenAIRequestError naming `where`."""
    if len(value) > MAX_SESSION_ID_CHARS:
        raise OpenAIRequestError(f"{where} is {len(value)} characters; use at most {MAX_SESSION_ID_CHARS} "
                                 "(e.g. a UUID per conversation)", "session_id")
    return value


def parse_request(model: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; every problem becomes one OpenAIRequestError naming the field."""
    if not isinstance(body, dict):
        raise OpenAIRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except OpenAIRequestError:
        raise
    except ValidationError as e:
        first = e.errors()[0]
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, OpenAIRequestError):
            raise cause from None
        loc = _path(first["loc"])
        field = next((p for p in reversed(first["loc"]) if isinstance(p, str) and not _is_union_error((p,))), "")
        if _is_union_error(first["loc"]):
            got = first.get("input")
            raise OpenAIRequestError(f"`{loc}` has the wrong type ({type(got).__name__}): expected "
                                     f"{_UNION_HINTS.get(field, 'another type')}", loc) from None
        if first["type"] == "extra_forbidden":
            raise OpenAIRequestError(f"unknown field `{loc}`: check the spelling, or remove it (monoserve "
                                     "rejects fields it would otherwise ignore)", loc) from None
        if first["type"] == "missing":
            raise OpenAIRequestError(f"`{loc}` is required", loc) from None
        got = first.get("input")
        got_text = f" (got {type(got).__name__} {str(got)[:60]!r})" if got is not None else ""
        raise OpenAIRequestError(f"`{loc}`: {first['msg']}{got_text}", loc) from None


_UNION_HINTS = {
    "prompt": "a string, a list of token ids, or a one-element list of either",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts",
    "arguments": "a JSON string or an object",
    "tool_choice": "'auto' or 'none'",
}


def _is_union_error(loc: tuple) -> bool:
    # pydantic names the union member it tried in the location, e.g. ('prompt', 'list[int]', 0)
    return any(isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p or p.startswith("literal"))
               for p in loc)


def _path(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union member tags dropped)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _is_union_error((p,)):
            break
        else:
            out += ("." if out else "") + p
    return out
