"""`PacedEngine`: an Engine that emits deterministic token ids at a fixed rate (no model math).

Router timing tests and bench/router.py need an engine whose speed is known exactly, so that
"N replicas serve N requests at >= 90% of solo speed" or "the router adds <= 1 ms TTFT" measure
the serving path and not numpy. PacedEngine:

- waits `prefill_s` (plus `prefill_s_per_token` x prompt length), then emits one token every
  1 / tokens_per_s seconds on an absolute schedule (no drift from sleep jitter);
- picks each token as a pure function of the whole context so far (prompt + emitted tokens),
  like a greedy LM: resuming from prompt + already-sent tokens continues the same sequence
  (what the router's mid-stream failover relies on), and `forward_logits` agrees with it;
- never emits an EOS id by chance; `eos_after=N` makes it emit EOS as token N + 1 (a STOP);
- honours max_tokens, stop_token_ids, the context window and cancel() (within one token);
- `fail_after=N` raises EngineFailure after N tokens (to test crash handling and failover); with
  `fatal=True` it raises EngineFailed instead (the engine is lost for good: a GPU fault).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator as PyGenerator
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from replicas.engine import EngineFailed, FinishReason, Generation, SamplingParams, stop_ids, validate_prompt
from replicas.model import ModelConfig

_MASK = (1 << 64) - 1


class EngineFailure(RuntimeError):
    """PacedEngine's simulated crash (`fail_after`)."""


def tiny_config(vocab_size: int = 512, max_position_embeddings: int = 4096,
                eos_token_ids: tuple[int, ...] = (2,)) -> ModelConfig:
    """A small Llama-shaped ModelConfig for engines that do no model math."""
    return ModelConfig(
        architecture="LlamaForCausalLM", family="llama", vocab_size=vocab_size, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=max_position_embeddings, eos_token_ids=eos_token_ids, bos_token_id=1,
        dtype="bf16",
    )


def _mix(h: int) -> int:
    """splitmix64 finaliser: spreads a rolling hash over all bits."""
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
    return h ^ (h >> 31)


def _extend(h: int, token: int) -> int:
    """Rolling hash of the context after appending `token`."""
    return (h * 0x100000001B3 + token + 1) & _MASK


class PacedEngine:
    """Engine protocol implementation with fixed prefill time and fixed tokens/s."""

    kind = "paced"

    def __init__(self, config: ModelConfig | None = None, tokens_per_s: float = 1000.0, max_batch: int = 1,
                 prefill_s: float = 0.0, prefill_s_per_token: float = 0.0, eos_after: int | None = None,
                 fail_after: int | None = None, max_context: int | None = None, fatal: bool = False):
        if tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.config = config or tiny_config()
        self.tokens_per_s = float(tokens_per_s)
        self.max_batch = max_batch
        self.max_context = max_context or self.config.max_context
        self.prefill_s = prefill_s
        self.prefill_s_per_token = prefill_s_per_token
        self.eos_after = eos_after
        self.fail_after = fail_after
        self.fatal = fatal
        # observability for tests
        self._lock = threading.Lock()
        self.active = 0  # generations running now
        self.started = 0  # generations started in total
        self.cancelled = 0  # generations that ended by cancel()/close() before finishing
        self.last_generation: Generation | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs) -> PacedEngine:
        """A paced engine with the shape (vocab, EOS, context) of a real checkpoint's config."""
        return cls(ModelConfig.from_pretrained(path), **kwargs)

    # ---- the deterministic "model" ---------------------------------------------------------
    def _next_token(self, h: int, avoid: frozenset[int]) -> int:
        v = self.config.vocab_size
        token = _mix(h) % v
        while token in avoid:  # never an EOS by chance (vocab is far larger than the EOS set)
            token = (token + 1) % v
        return token

    def _context_hash(self, ids: Sequence[int], seed: int) -> int:
        h = seed & _MASK
        for t in ids:
            h = _extend(h, int(t))
        return h

    def forward_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits [len, vocab] whose argmax at each position is the token greedy decoding emits."""
        avoid = frozenset(self.config.eos_token_ids)
        out = np.zeros((len(token_ids), self.config.vocab_size), np.float32)
        h = 0
        for i, t in enumerate(token_ids):
            h = _extend(h, int(t))
            out[i, self._next_token(h, avoid)] = 1.0
        return out

    # ---- Engine protocol -------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        ids = validate_prompt(prompt_ids, params, self.config, self.max_context)
        with self._lock:
            self.started += 1
        gen = Generation(lambda cancel: self._steps(ids, params, cancel))
        self.last_generation = gen
        return gen

    def _steps(self, ids: list[int], params: SamplingParams,
               cancel: threading.Event) -> PyGenerator[int, None, tuple[FinishReason, int | None]]:
        with self._lock:
            self.active += 1
        finished = False
        try:
            # Greedy ignores the seed so a resumed request continues identically; sampling mixes it in.
            seed = 0 if params.greedy else (params.seed if params.seed is not None else time.monotonic_ns())
            h = self._context_hash(ids, seed)
            stops = stop_ids(self.config, params)
            avoid = frozenset(self.config.eos_token_ids)
            interval = 1.0 / self.tokens_per_s
            start = time.monotonic() + self.prefill_s + self.prefill_s_per_token * len(ids)
            budget = min(params.max_tokens, self.max_context - len(ids))
            for i in range(budget):
                if self._wait_until(start + i * interval, cancel):
                    finished = True
                    return FinishReason.CANCELLED, None
                if self.fail_after is not None and i >= self.fail_after:
                    finished = True  # a crash, not a cancel
                    if self.fatal:
                        raise EngineFailed(f"paced engine: simulated GPU fault after {i} tokens")
                    raise EngineFailure(f"paced engine: simulated failure after {i} tokens")
                if self.eos_after is not None and i == self.eos_after and self.config.eos_token_ids:
                    token = self.config.eos_token_ids[0]
                else:
                    token = self._next_token(h, avoid)
                if token in stops:
                    finished = True
                    return FinishReason.STOP, token
                h = _extend(h, token)
                yield token
            finished = True
            return FinishReason.LENGTH, None
        finally:
            with self._lock:
                self.active -= 1
                if not finished or cancel.is_set():  # closed early, or stopped by cancel()
                    self.cancelled += 1

    @staticmethod
    def _wait_until(deadline: float, cancel: threading.Event) -> bool:
        """Sleep until `deadline` (monotonic); True if cancelled meanwhile."""
        delay = deadline - time.monotonic()
        if delay > 0:
            return cancel.wait(delay)
        return cancel.is_set()
