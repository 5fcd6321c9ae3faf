"""The contract every engine keeps: sampling parameters, finish reasons and the `Engine` protocol.

An engine turns prompt token ids into a stream of generated token ids. The stream is a
`Generation`: iterate it for token ids; once exhausted, `finish_reason` says why it ended.
`cancel()` may be called from any thread; the engine stops within one decode step.

Stop tokens (EOS ids and `stop_token_ids`) end the generation and are NOT yielded; the id that
matched is kept in `Generation.stop_token_id`.
"""

from __future__ import annotations

import enum
import inspect
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from replicas.model import ModelConfig


class EngineError(Exception):
    """Base of errors an engine raises for a bad request (the caller's fault, never retried)."""


class InvalidRequest(EngineError, ValueError):
    """The request cannot be served as given (bad prompt, bad sampling values, too long)."""


class EngineFailed(RuntimeError):
    """The engine can serve nothing more: its GPU kernel faulted or lost a tensor-parallel peer, and the GPU's
    CUDA context with it. Fatal for the replica (drain it and restart), not a fault of the request."""


class EngineBusy(RuntimeError):
    """All of the engine's generation slots (max_batch) are taken; retry when one frees."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS id or a stop token id was sampled
    LENGTH = "length"  # max_tokens reached, or the context window is full
    CANCELLED = "cancelled"  # cancel() was called


class SamplingParams(BaseModel):
    """How to pick each next token. temperature == 0 means greedy (argmax)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy; otherwise logits / T.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = no limit.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus: keep the smallest set with mass >= top_p.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Same seed => same tokens. None = random.")
    stop_token_ids: tuple[int, ...] = Field((), description="Extra ids that end generation (not yielded).")
    ignore_eos: bool = Field(False, description="Do not stop at the model's EOS ids (benchmarks).")

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _as_tuple(cls, v):
        return tuple(v) if v is not None else ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def parse(cls, **kwargs) -> SamplingParams:
        """Build from user input; a bad value becomes InvalidRequest with a readable message."""
        try:
            return cls(**kwargs)
        except ValidationError as e:
            parts = [f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors()]
            raise InvalidRequest("invalid sampling parameters: " + "; ".join(parts)) from None


def validate_prompt(prompt_ids: Sequence[int], params: SamplingParams, config: ModelConfig,
                    max_context: int | None = None) -> list[int]:
    """Check a prompt against the model; returns it as a list of ints or raises InvalidRequest."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise InvalidRequest("prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < config.vocab_size]
    if bad:
        raise InvalidRequest(f"prompt has token id {bad[0]} outside the vocabulary [0, {config.vocab_size})")
    limit = max_context or config.max_position_embeddings
    if len(ids) >= limit:
        raise InvalidRequest(
            f"prompt is {len(ids)} tokens but the context window is {limit}: shorten the prompt"
        )
    for t in params.stop_token_ids:
        if not 0 <= t < config.vocab_size:
            raise InvalidRequest(f"stop token id {t} outside the vocabulary [0, {config.vocab_size})")
    return ids


def validate_teacher_ids(token_ids: Sequence[int], config: ModelConfig, max_context: int) -> list[int]:
    """Check the ids given to `forward_logits`; returns them as ints or raises InvalidRequest."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise InvalidRequest("token_ids is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < config.vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} outside the vocabulary [0, {config.vocab_size})")
    if len(ids) > max_context:
        raise InvalidRequest(f"{len(ids)} tokens exceed the context window of {max_context}")
    return ids


def stop_ids(config: ModelConfig, params: SamplingParams) -> frozenset[int]:
    """Ids that end a generation for these params."""
    eos = () if params.ignore_eos else tuple(config.eos_token_ids)
    return frozenset(eos) | frozenset(params.stop_token_ids)


class Generation(Iterator[int]):
    """A running generation: iterate for token ids; `finish_reason` is set once it ends.

    Wraps an engine's step generator, which receives the cancel event, yields token ids and
    returns (FinishReason, stop_token_id | None).
    """

    def __init__(self, steps: Callable[[threading.Event], Generator[int, None, tuple[FinishReason, int | None]]]):
        self._cancel = threading.Event()
        self._steps = steps(self._cancel)
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.num_tokens = 0

    # Leading prompt tokens whose KV came from the session's previous turn (not prefilled again);
    # known once the first token is out. Engines without session reuse leave it 0.
    reused_tokens: int = 0

    def cancel(self) -> None:
        """Ask the engine to stop; safe from any thread, idempotent."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> int:
        if self.finish_reason is not None:
            raise StopIteration
        try:
            token = next(self._steps)
        except StopIteration as done:
            self.finish_reason, self.stop_token_id = done.value or (FinishReason.LENGTH, None)
            raise
        self.num_tokens += 1
        return token

    def close(self) -> None:
        """Release the engine's resources for this generation (also on early exit)."""
        self._cancel.set()
        self._steps.close()
        if self.finish_reason is None:
            self.finish_reason = FinishReason.CANCELLED


@runtime_checkable
class Engine(Protocol):
    """What the replica server needs from an engine."""

    config: ModelConfig
    kind: str  # "reference", "monokernel", ...
    max_batch: int  # concurrent generations this engine serves (slots)
    max_context: int  # most tokens (prompt + generated) one sequence may hold

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Start generating; validation errors raise InvalidRequest before any token.

        Optional extension (agent sessions): an engine may also accept `session_id: str | None = None`
        as a keyword. It then keeps the session's KV after the generation (a bounded LRU, see
        replicas.session_cache) and, when the next prompt of that session shares a prefix with
        what it holds, prefills only the rest — with outputs equal to a fresh full-prompt request.
        It reports `Generation.reused_tokens` and `session_stats() -> SessionStats`. Callers check
        `accepts_session_id(engine)` first."""
        ...

    def forward_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits [len(token_ids), vocab] float32 (the correctness hook)."""
        ...


def accepts_session_id(engine: Engine) -> bool:
    """True if `engine.generate` takes the optional `session_id` keyword (session KV reuse)."""
    try:
        return "session_id" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
