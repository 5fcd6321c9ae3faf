"""`EngineGroup`: several engines of one model behind the single `Engine` interface.

A replica owns a whole node (8 GPUs). When one engine spans fewer GPUs than the node has
(`tensor_parallel_size` < `gpus_per_replica`), the replica runs one engine per group of
`tensor_parallel_size` GPUs and this group serves them as one engine whose slots are the sum:
each generation goes to the least busy member; a session's next turn prefers the member that
served its previous one (its KV may still be resident there). Members that keep sessions' KV
make the group do so too: its generations report the member's `reused_tokens` and
`session_stats()` sums the members' counters and bounds.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Sequence
from dataclasses import fields

import numpy as np

from replicas.engine import (
    Engine,
    EngineBusy,
    FinishReason,
    Generation,
    SamplingParams,
    accepts_session_id,
)
from replicas.session_cache import SessionStats

MAX_SESSIONS = 4096  # session -> member entries remembered (oldest dropped first)


class _MemberGeneration(Generation):
    """A member engine's generation, re-wrapped so that cancel() reaches the member at once."""

    def __init__(self, inner: Generation, on_done):
        self._inner = inner
        self._on_done = on_done

        def steps(cancel: threading.Event) -> Generator[int, None, tuple[FinishReason, int | None]]:
            try:
                yield from inner
                return inner.finish_reason or FinishReason.LENGTH, inner.stop_token_id
            finally:
                inner.close()
                on_done()

        super().__init__(steps)

    @property
    def reused_tokens(self) -> int:
        """The member's count of prompt tokens reused from the session's KV (not prefilled)."""
        return getattr(self._inner, "reused_tokens", 0)

    def cancel(self) -> None:
        super().cancel()
        self._inner.cancel()

    def close(self) -> None:
        super().close()  # runs the steps' cleanup if they started...
        self._inner.close()
        self._on_done()  # ...and frees the slot even if they never did (idempotent)


class EngineGroup:
    """Engine protocol over `engines` (same model, same kind)."""

    def __init__(self, engines: Sequence[Engine]):
        if not engines:
            raise ValueError("EngineGroup needs at least one engine")
        self.engines = list(engines)
        first = self.engines[0]
        self.config = first.config
        self.kind = first.kind
        self.max_batch = sum(e.max_batch for e in self.engines)
        self.max_context = min(e.max_context for e in self.engines)
        self.devices = [d for e in self.engines for d in getattr(e, "devices", [])]
        self._active = [0] * len(self.engines)
        self._sessions: dict[str, int] = {}
        self._lock = threading.Lock()
        self._sessions_supported = all(accepts_session_id(e) for e in self.engines)
        # only offered when members keep sessions' KV: the replica server looks it up with getattr
        if any(callable(getattr(e, "session_stats", None)) for e in self.engines):
            self.session_stats = self._summed_session_stats

    def _summed_session_stats(self) -> SessionStats:
        """The members' session counters, residency and bounds added up (one cache per member)."""
        parts = [e.session_stats() for e in self.engines if callable(getattr(e, "session_stats", None))]
        return SessionStats(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields(SessionStats)})

    def _pick(self, session_id: str | None) -> int:
        free = [i for i, e in enumerate(self.engines) if self._active[i] < e.max_batch]
        if not free:
            raise EngineBusy(f"all {self.max_batch} generation slots of this engine group are busy; "
                             "retry when one finishes")
        sticky = self._sessions.get(session_id) if session_id else None
        if sticky in free:
            return sticky
        return min(free, key=lambda i: (self._active[i] / self.engines[i].max_batch, i))

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, session_id: str | None = None) -> Generation:
        with self._lock:
            i = self._pick(session_id)
            self._active[i] += 1
            if session_id:
                self._sessions.pop(session_id, None)
                self._sessions[session_id] = i
                if len(self._sessions) > MAX_SESSIONS:
                    self._sessions.pop(next(iter(self._sessions)))
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    self._active[i] -= 1

        try:
            if session_id and self._sessions_supported:
                inner = self.engines[i].generate(prompt_ids, params, session_id=session_id)
            else:
                inner = self.engines[i].generate(prompt_ids, params)
        except BaseException:
            release()
            raise
        return _MemberGeneration(inner, release)

    def forward_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        return self.engines[0].forward_logits(token_ids)

    def close(self) -> None:
        for e in self.engines:
            close = getattr(e, "close", None)
            if close is not None:
                close()
