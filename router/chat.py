"""Chat templates: turn a list of chat messages into the prompt text a checkpoint was trained on.

A Hugging Face checkpoint ships its template as Jinja2 source (`chat_template` in
tokenizer_config.json, or a `chat_template.jinja` file beside it). We render it the way
`transformers`' `apply_chat_template` does, so a prompt built here is byte-identical to one
built by transformers (checked by scripts/check_chat_templates.py against the real thing):

- an immutable sandboxed environment (templates come from downloaded checkpoints: no file or
  attribute access beyond plain data), with `trim_blocks` and `lstrip_blocks`;
- `raise_exception(msg)` and `strftime_now(fmt)` as globals, `tojson` that neither sorts keys
  nor HTML-escapes (Jinja's built-in one does both), loop controls (`break`/`continue`) and a
  no-op `{% generation %}` block (used by templates for assistant-token masks);
- variables: `messages`, `tools`, `documents`, `add_generation_prompt` and the special tokens
  (`bos_token`, `eos_token`, ...) as strings, plus any extra keyword the caller passes.

The rendered text already holds the template's special tokens (BOS, headers): tokenize it
WITHOUT adding special tokens again (`tokenizer.encode(text, add_special_tokens=False)`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """The chat request cannot be rendered (the template rejected it, or the messages are malformed)."""


class NoChatTemplate(ChatTemplateError):
    """Chat input was sent but the served checkpoint has no chat template."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the block to find assistant tokens for training masks; for serving only
    the text matters, but a template using the tag must still compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # The output is inserted verbatim into the prompt: no HTML escaping, key order preserved.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    """A checkpoint's chat template(s), compiled once, rendered per request (thread-safe).

    `templates` maps a name to Jinja source; checkpoints with one template use "default".
    A template named "tool_use" is preferred when the request carries tools (as transformers does).
    """

    def __init__(self, templates: Mapping[str, str] | str | None, special_tokens: Mapping[str, str] | None = None,
                 source: str = "checkpoint"):
        if isinstance(templates, str):
            templates = {"default": templates}
        self.templates: dict[str, str] = dict(templates or {})
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.source = source
        self._env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}
        self._compile_errors: dict[str, str] = {}
        for name, text in self.templates.items():
            try:
                self._compiled[name] = self._env.from_string(text)
            except jinja2.exceptions.TemplateSyntaxError as e:
                # Kept, not raised: text and token-id requests must still work with a broken template.
                self._compile_errors[name] = f"line {e.lineno}: {e.message}"

    @property
    def available(self) -> bool:
        return bool(self.templates)

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any], template_file_text: str | None = None,
                              source: str = "checkpoint") -> "ChatTemplate":
        """Build from a parsed tokenizer_config.json (and the text of chat_template.jinja, if any)."""
        raw = template_file_text if template_file_text is not None else config.get("chat_template")
        if isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
            templates = {t["name"]: t["template"] for t in raw if isinstance(t, Mapping)
                         and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        elif isinstance(raw, str):
            templates = {"default": raw}
        else:
            templates = {}
        special = {k: text for k in SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(k))) is not None}
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
        return cls(templates, special, source=source)

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | Path) -> "ChatTemplate":
        """Load from a checkpoint directory. A checkpoint without a template gives a ChatTemplate
        whose `render` raises NoChatTemplate (text and token-id requests don't need one)."""
        path = Path(checkpoint_dir)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        file_path = path / TEMPLATE_FILE
        file_text = file_path.read_text(encoding="utf-8") if file_path.is_file() else None
        return cls.from_tokenizer_config(config, file_text, source=str(path))

    def _pick(self, has_tools: bool) -> tuple[str, jinja2.Template]:
        if not self.templates:
            raise NoChatTemplate(
                f"the served model ({self.source}) has no chat template (no `chat_template` in "
                f"tokenizer_config.json and no {TEMPLATE_FILE}): send a plain text prompt "
                "(/v1/completions or GenerateRequest.text) instead of chat messages, or add a chat "
                "template to the checkpoint"
            )
        if has_tools and "tool_use" in self.templates:
            name = "tool_use"
        elif "default" in self.templates:
            name = "default"
        elif len(self.templates) == 1:
            name = next(iter(self.templates))
        else:
            raise NoChatTemplate(
                f"the served model ({self.source}) has several chat templates ({sorted(self.templates)}) "
                "and none is named 'default'"
            )
        if name in self._compile_errors:
            raise ChatTemplateError(
                f"the served model's chat template {name!r} is not valid Jinja ({self._compile_errors[name]}): "
                "fix `chat_template` in the checkpoint's tokenizer_config.json"
            )
        return name, self._compiled[name]

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """Render messages to prompt text.

        add_generation_prompt: end with the header that opens the assistant's turn (what a
        server wants). continue_final_message: the last message is a partial assistant turn
        the model should continue; the text stops right after its content.
        """
        _check_messages(messages)
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError(
                "add_generation_prompt and continue_final_message cannot both be true: the first opens a "
                "new assistant turn, the second continues the last message"
            )
        name, template = self._pick(bool(tools))
        variables = {**self.special_tokens, **template_kwargs}
        try:
            text = template.render(messages=list(messages), tools=list(tools) if tools else None,
                                   documents=list(documents) if documents else None,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:  # includes raise_exception and sandbox refusals
            raise ChatTemplateError(f"the model's chat template rejected the messages: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(
                f"the model's chat template failed on these messages ({type(e).__name__}: {e}): "
                "check roles, content types and tool definitions"
            ) from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1])
        return text


def _check_messages(messages: Any) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string (system, user, assistant or tool)")


def _final_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = [p.get("text") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
        if texts:
            return texts[-1]
    raise ChatTemplateError("continue_final_message needs the last message to have text content")


def _cut_after_final_message(text: str, message: Mapping[str, Any]) -> str:
    """Drop what the template appends after the last message (its end-of-turn tokens)."""
    final = _final_text(message)
    core = final.strip()
    at = text.rfind(core)
    if not core or at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not reproduce the last message's content verbatim, "
            "so the prompt cannot be cut after it"
        )
    # Keep the message's own trailing whitespace when the template kept it.
    keep = len(final.lstrip()) if text[at:at + len(final.lstrip())] == final.lstrip() else len(core)
    return text[:at + keep]
