"""Tokenization in the router: load the checkpoint's `tokenizer.json`, encode prompts, and turn a
stream of token ids back into text incrementally without ever emitting half a character.

Byte-level BPE (Llama 3, Qwen) and byte-fallback (Llama 2, Mistral) tokenizers can split one
UTF-8 character over several tokens; `tokenizers.decoders.DecodeStream` buffers those until the
character is complete. `IncrementalDetokenizer.finish()` flushes whatever is left (an incomplete
sequence at the end becomes U+FFFD), so the concatenated deltas always equal the full decode.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens given to the decoder as context, so the first output token decodes the way it
# would inside the full sequence (e.g. SentencePiece's leading-space rule).
_CONTEXT_TOKENS = 8
# Text at least this long is tokenized off the event loop: `Tokenizer.encode` holds the GIL for
# its whole run (~1 s per MB), `encode_batch` releases it, so other streams keep flowing.
OFF_LOOP_CHARS = 16_384


class TokenizerError(ValueError):
    """The checkpoint's tokenizer files are missing or malformed."""


class TextTokenizer:
    """The checkpoint's tokenizer plus what the router needs from tokenizer_config.json."""

    def __init__(self, tokenizer: Tokenizer, add_bos: bool = False, bos_token_id: int | None = None,
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.add_bos = add_bos and bos_token_id is not None
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "TextTokenizer":
        """Load `tokenizer.json` (+ `tokenizer_config.json` if present) from a checkpoint dir."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path} not found: give the checkpoint directory that holds tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
            raise TokenizerError(f"{path} is not a valid tokenizer.json: {e}") from None
        config: dict = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{config_path} is not valid JSON: {e}") from None
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        special = {k: v for k, v in special.items() if v}
        bos_id = tokenizer.token_to_id(special["bos_token"]) if "bos_token" in special else None
        # HF's default for Llama-style tokenizers is to add BOS; a post-processor in
        # tokenizer.json may already add it, in which case encode() must not add it twice.
        add_bos = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(tokenizer, add_bos=add_bos, bos_token_id=bos_id, chat_template=template,
                   special_tokens=special)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._with_bos(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids,
                              add_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` for callers on an event loop: long text is tokenized in a worker thread with
        the GIL released, so the loop (every other stream) is not stalled."""
        if len(text) < OFF_LOOP_CHARS:
            return self.encode(text, add_special_tokens)
        ids = await asyncio.to_thread(
            lambda: self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return self._with_bos(ids, add_special_tokens)

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def detokenizer(self, prompt_ids: list[int] = ()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self.tokenizer, prompt_ids)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} (AddedToken serialisation)
        value = value.get("content")
    return value if isinstance(value, str) else None


class IncrementalDetokenizer:
    """Feed token ids one by one; get back only complete characters."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] = ()):
        self._tokenizer = tokenizer
        context = list(prompt_ids)[-_CONTEXT_TOKENS:]
        self._stream = DecodeStream(ids=context, skip_special_tokens=True) if context \
            else DecodeStream(skip_special_tokens=True)
        self._context = context
        self._ids: list[int] = []
        self._pending: list[int] = []  # ids whose text has not been emitted yet
        self.text = ""  # everything emitted so far

    def step(self, token_id: int) -> str:
        """Add one token id; returns the new complete text (possibly "")."""
        self._ids.append(token_id)
        self._pending.append(token_id)
        try:
            chunk = self._stream.step(self._tokenizer, token_id)
        except Exception:  # an id outside the tokenizer's vocabulary: no text for it
            chunk = None
        if chunk is None:
            return ""
        self._pending.clear()
        self.text += chunk
        return chunk

    def finish(self) -> str:
        """Flush text still held back (an incomplete character at the end becomes U+FFFD)."""
        if not self._pending:
            return ""
        full = self._tokenizer.decode(self._context + self._ids, skip_special_tokens=True)
        before = self._tokenizer.decode(self._context, skip_special_tokens=True) if self._context else ""
        tail = full[len(before):] if full.startswith(before) else full
        rest = tail[len(self.text):] if tail.startswith(self.text) else \
            self._tokenizer.decode(self._pending, skip_special_tokens=True)
        self._pending.clear()
        self.text += rest
        return rest
