"""Stop strings matched on streamed text, across token boundaries.

The router's incremental detokenizer produces text deltas; a stop string may straddle any
number of them ("<|e" + "nd|>"). `StopMatcher` releases only text that can no longer become
part of a stop and holds back the longest tail that is still a prefix of some stop.

Which stop wins: the one that is complete first in the text (earliest end); when two end at
the same place, the longer (earlier-starting) one. This rule depends only on the text, never on
how it was split into deltas, so streaming and non-streaming clients see the same output.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_STOPS = 16
MAX_STOP_CHARS = 256


class StopStringError(ValueError):
    """The stop strings given are unusable (empty, too many, too long)."""


def validate_stops(stops: Iterable[str]) -> tuple[str, ...]:
    """Check user-given stop strings; returns them deduplicated, in order."""
    out: list[str] = []
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise StopStringError(f"stop[{i}] must be a string, got {type(s).__name__}")
        if not s:
            raise StopStringError(f"stop[{i}] is empty: every stop string needs at least one character")
        if len(s) > MAX_STOP_CHARS:
            raise StopStringError(f"stop[{i}] is {len(s)} characters; the limit is {MAX_STOP_CHARS}")
        if s not in out:
            out.append(s)
    if len(out) > MAX_STOPS:
        raise StopStringError(f"{len(out)} stop strings given; the limit is {MAX_STOPS}")
    return tuple(out)


class StopMatcher:
    """Feed text deltas in order; get back the text that is safe to show.

    >>> m = StopMatcher(["</answer>"])
    >>> m.feed("42</ans"), m.feed("wer> and more"), m.matched
    ('42', '', '</answer>')

    After a match, `matched` holds the stop string and further feeds return "". The matched
    stop is left out of the output unless `include_stop` (then the output ends with it). When
    the generation ends without a match, call `flush()` for the held-back tail.
    """

    def __init__(self, stops: Iterable[str], include_stop: bool = False):
        self.stops = validate_stops(stops)
        self.include_stop = include_stop
        self.matched: str | None = None
        self._held = ""
        self._longest = max((len(s) for s in self.stops), default=0)

    @property
    def done(self) -> bool:
        return self.matched is not None

    @property
    def held(self) -> str:
        """Text received but not released yet (a possible start of a stop)."""
        return self._held

    def feed(self, delta: str) -> str:
        if self.matched is not None or not delta:
            return ""
        if not self.stops:
            return delta
        text = self._held + delta
        found = self._first_complete(text)
        if found is not None:
            start, stop = found
            self.matched = stop
            self._held = ""
            return text[:start + len(stop)] if self.include_stop else text[:start]
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The generation ended without a stop: release what was held back."""
        tail, self._held = self._held, ""
        return "" if self.matched is not None else tail

    def _first_complete(self, text: str) -> tuple[int, str] | None:
        """(start, stop) of the stop occurrence ending earliest; ties go to the longer stop."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                key = (at + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
