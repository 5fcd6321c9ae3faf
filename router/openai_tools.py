"""Tool calls: find the calls a model wrote in its output and return them as OpenAI `tool_calls`.

Models announce tool calls in text, in the format their chat template taught them:

- "hermes" (Qwen2/2.5/3, Hermes, many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, possibly after some text.
- "json" (Llama 3.1/3.2/3.3): the whole answer is `{"name": ..., "parameters": {...}}`
  (the `<|python_tag|>` before it is a special token and never reaches the text).

The format is picked from the checkpoint's chat template (what it tells the model to write).
Parsing is only done when the request carries `tools` (and tool_choice is not "none").
Output that does not parse as a tool call is returned unchanged as content: a near miss is
never lost.

Streaming: `ToolCallStream` passes text through until a call may be starting (a `<tool_call>`
tag, or a reply whose first character is `{` for the json format), then holds the rest back and
decides at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|\Z)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's wire format)
    id: str

    def as_json(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def tool_format(template_source: str | None) -> str | None:
    """'hermes', 'json' or None, from what the chat template asks the model to write."""
    if not template_source:
        return None
    if HERMES_OPEN in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or '"parameters"' in template_source \
            or "'parameters'" in template_source or "ipython" in template_source:
        return "json"
    return None


def _call(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls). No calls found -> (text, [])."""
    if fmt == "hermes":
        start = text.find(HERMES_OPEN)
        if start < 0:
            return text, []
        calls, outside, pos = [], [text[:start]], start
        for block in _HERMES_BLOCK.finditer(text, start):
            outside.append(text[pos:block.start()])
            pos = block.end()
            try:
                call = _call(json.loads(block.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        outside.append(text[pos:])
        content = "".join(outside).strip()  # text around the calls is kept, not dropped
        return (content or None), calls
    if fmt == "json":
        body = text.strip()
        if not body.startswith(("{", "[")):
            return text, []
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError:
            parsed = _semicolon_separated(body)
        objs = parsed if isinstance(parsed, list) else [parsed]
        calls = [_call(o) for o in objs]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls
    return text, []


def _semicolon_separated(body: str):
    """Llama 3.x sometimes writes several calls as `{...}; {...}`."""
    try:
        return [json.loads(part) for part in body.split(";") if part.strip()]
    except json.JSONDecodeError:
        return None


class ToolCallStream:
    """Streaming side: feed content deltas, get back what can be shown now; `finish()` at the end."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self._held = ""  # text that may be (part of) a tool call
        self._holding = False  # a call has (possibly) started: hold everything from here
        self._seen_text = False

    def feed(self, delta: str) -> str:
        if self._holding:
            self._held += delta
            return ""
        text = self._held + delta
        self._held = ""
        if self.fmt == "json":
            if not self._seen_text:
                stripped = text.lstrip()
                if not stripped:  # only whitespace so far: undecided
                    self._held = text
                    return ""
                self._seen_text = True
                if stripped.startswith(("{", "[")):
                    self._holding, self._held = True, text
                    return ""
            return text
        at = text.find(HERMES_OPEN)
        if at >= 0:
            self._holding, self._held = True, text[at:]
            return text[:at]
        keep = next((k for k in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1)
                     if HERMES_OPEN.startswith(text[-k:])), 0)  # a tag may be split across deltas
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(text still to show as content, tool calls)."""
        held, self._held = self._held, ""
        if not self._holding:
            return held, []
        content, calls = parse_tool_calls(held, self.fmt)
        if not calls:
            return held, []
        return (content or ""), calls
