"""Agent-session KV kept between turns: a bounded LRU per engine, independent of the KV's layout.

An agent's next turn repeats its whole conversation (previous prompt + the model's output + the
new message). An engine that keeps the previous turn's KV only needs to prefill the new suffix.

    cache = SessionCache(max_bytes=2**30, max_sessions=64)
    lease = cache.acquire(session_id, prompt_ids)   # at generation start
    kv = lease.kv if lease.kv is not None else new_kv()   # lease.kv holds >= lease.reused positions
    ... prefill prompt_ids[lease.reused:], decode ...
    cache.release(lease, kv, tokens_in_kv, kv_nbytes)      # at the end (or cache.discard(lease))

Rules:
- The stored entry of a session is the token ids whose KV it holds (the last turn's prompt + the
  tokens fed back while decoding). A new prompt reuses its longest common prefix with them, but
  always leaves at least `min_new` tokens to prefill (an engine needs the last prompt position's
  logits). No common prefix -> a fresh prefill; the old entry is dropped and replaced at release.
- An entry lent to a running generation is never evicted; a second concurrent request of the same
  session gets a fresh prefill and does not overwrite the entry when it ends.
- Bounds (`max_bytes`, `max_sessions`) are enforced when a generation hands its KV back: least
  recently used idle entries go first. They bound the memory kept *between* turns; KV lent to
  running generations counts towards them but is never dropped. An entry larger than the whole
  budget is not kept. `max_sessions=0` disables reuse (every session request is a miss).

The engine does the KV-specific part (truncating to `lease.reused` positions); everything here
is bookkeeping under one lock, so `acquire`/`release` may be called from any thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB of KV kept between turns
DEFAULT_MAX_SESSIONS = 64


def session_limits(session_cache_mb: float | None, max_sessions: int | None) -> dict[str, int]:
    """The session keywords engine factories take, from the MiB / count users give (None = the default;
    None rather than the default's value lets a caller tell "not given" apart)."""
    return {"session_cache_bytes": DEFAULT_MAX_BYTES if session_cache_mb is None else int(session_cache_mb * 2**20),
            "max_sessions": DEFAULT_MAX_SESSIONS if max_sessions is None else max_sessions}


@dataclass(frozen=True)
class SessionStats:
    """Counters since the engine started, and what is resident now."""

    hits: int = 0  # session requests that reused stored KV
    misses: int = 0  # session requests that prefilled from scratch
    evictions: int = 0  # entries dropped to stay within the bounds
    reused_tokens: int = 0  # prompt tokens not prefilled thanks to reuse (sum over hits)
    sessions: int = 0  # entries resident now (idle or lent to a running generation)
    bytes: int = 0  # their KV bytes
    max_bytes: int = 0
    max_sessions: int = 0


@dataclass
class _Entry:
    kv: Any
    tokens: np.ndarray  # int64 ids whose KV `kv` holds, in order
    nbytes: int
    in_use: bool = False


@dataclass
class SessionLease:
    """One generation's claim on a session: `kv` to continue from (None = start fresh) and how many
    leading prompt positions of it are valid and reused."""

    session_id: str
    kv: Any = None
    reused: int = 0
    _entry: _Entry | None = None
    _done: bool = False


class SessionCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_sessions: int = DEFAULT_MAX_SESSIONS):
        if max_bytes < 0 or max_sessions < 0:
            raise ValueError(f"session cache bounds must be >= 0, got max_bytes={max_bytes}, "
                             f"max_sessions={max_sessions}")
        self.max_bytes = int(max_bytes)
        self.max_sessions = int(max_sessions)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._reused = 0

    def acquire(self, session_id: str, prompt: Sequence[int], min_new: int = 1) -> SessionLease:
        """Claim `session_id`'s stored KV for a generation of `prompt` (see the module rules)."""
        if not session_id:
            raise ValueError("session_id is empty")
        ids = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is not None and not entry.in_use:
                reused = min(_common_prefix(entry.tokens, ids), len(ids) - min_new)
                if reused > 0:
                    entry.in_use = True
                    self._entries.move_to_end(session_id)
                    self._hits += 1
                    self._reused += reused
                    return SessionLease(session_id, entry.kv, reused, entry)
                del self._entries[session_id]  # diverged from the start: replaced at release
            self._misses += 1
            return SessionLease(session_id)

    def reusable(self, session_id: str, prompt: Sequence[int], min_new: int = 1) -> int:
        """How many leading positions `acquire` would reuse now (0 if none), without claiming anything."""
        ids = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None or entry.in_use:
                return 0
            return max(0, min(_common_prefix(entry.tokens, ids), len(ids) - min_new))

    def release(self, lease: SessionLease, kv: Any, tokens: Sequence[int], nbytes: int) -> None:
        """Keep `kv` (holding exactly `tokens`) as the session's entry; then enforce the bounds."""
        with self._lock:
            if lease._done:
                return
            lease._done = True
            current = self._entries.get(lease.session_id)
            if current is not None and current is not lease._entry and current.in_use:
                return  # a concurrent request of this session holds the entry: it stores its own
            self._entries[lease.session_id] = _Entry(kv, np.asarray(tokens, dtype=np.int64), int(nbytes))
            self._entries.move_to_end(lease.session_id)
            self._evict()

    def discard(self, lease: SessionLease) -> None:
        """The generation failed: its KV may be inconsistent, drop the entry it held."""
        with self._lock:
            if lease._done:
                return
            lease._done = True
            if lease._entry is not None and self._entries.get(lease.session_id) is lease._entry:
                del self._entries[lease.session_id]

    def stats(self) -> SessionStats:
        with self._lock:
            return SessionStats(self._hits, self._misses, self._evictions, self._reused, len(self._entries),
                                sum(e.nbytes for e in self._entries.values()), self.max_bytes,
                                self.max_sessions)

    def resident(self) -> list[str]:
        """Session ids with stored KV, most recently used first."""
        with self._lock:
            return list(reversed(self._entries))

    def clear(self) -> None:
        """Drop every idle entry (entries lent to running generations stay)."""
        with self._lock:
            for sid in [s for s, e in self._entries.items() if not e.in_use]:
                del self._entries[sid]

    def _evict(self) -> None:
        """Drop least recently used idle entries until both bounds hold (or only lent ones remain)."""
        total = sum(e.nbytes for e in self._entries.values())
        for sid in list(self._entries):
            if total <= self.max_bytes and len(self._entries) <= self.max_sessions:
                return
            entry = self._entries[sid]
            if entry.in_use:
                continue
            del self._entries[sid]
            total -= entry.nbytes
            self._evictions += 1


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
