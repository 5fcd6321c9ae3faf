"""StopMatcher: output never depends on how the text was split into deltas."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.stop_strings import MAX_STOPS, StopMatcher, StopStringError


def expected(text: str, stops: list[str], include_stop: bool) -> tuple[str, str | None]:
    """Brute force on the whole text: the first stop to be complete wins (longest on a tie)."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                start = end - len(stop)
                return (text[:end] if include_stop else text[:start]), stop
    return text, None


def run(deltas: list[str], stops: list[str], include_stop: bool) -> tuple[str, str | None, list[str]]:
    m = StopMatcher(stops, include_stop=include_stop)
    outs = [m.feed(d) for d in deltas]
    outs.append(m.flush())
    return "".join(outs), m.matched, outs


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


alphabet = st.sampled_from("ab<|>é🙂")
texts = st.text(alphabet, max_size=40)
stop_lists = st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=0, max_size=4)


@settings(max_examples=400, deadline=None)
@given(text=texts, stops=stop_lists, cuts=st.lists(st.integers(0, 100), max_size=12), include=st.booleans())
def test_any_split_gives_the_whole_text_answer(text, stops, cuts, include):
    out, matched, _ = run(split(text, cuts), stops, include)
    assert (out, matched) == expected(text, stops, include)


@settings(max_examples=200, deadline=None)
@given(text=texts, stops=stop_lists.filter(bool), include=st.booleans())
def test_released_text_is_never_retracted_and_holds_back_only_stop_prefixes(text, stops, include):
    m = StopMatcher(stops, include_stop=include)
    released = ""
    for ch in text:
        released += m.feed(ch)
        if m.done:
            break
        # What is held is exactly a proper prefix of some stop (or nothing).
        assert m.held == "" or any(s.startswith(m.held) and s != m.held for s in stops)
        assert released + m.held == text[:len(released) + len(m.held)]
    released += m.flush()
    assert released == expected(text, stops, include)[0]


def test_stop_split_over_tokens_is_excluded_and_reported():
    m = StopMatcher(["</answer>"])
    assert m.feed("The answer is 42<") == "The answer is 42"
    assert m.feed("/ans") == ""
    assert m.feed("wer> trailing text") == ""
    assert m.matched == "</answer>"
    assert m.feed("more") == "" and m.flush() == ""


def test_include_stop_keeps_the_stop_and_drops_what_follows():
    m = StopMatcher(["STOP"], include_stop=True)
    assert m.feed("go ST") == "go "
    assert m.feed("OP now") == "STOP"
    assert m.matched == "STOP"


def test_false_start_is_released_once_it_cannot_be_a_stop():
    m = StopMatcher(["\n\nUser:"])
    assert m.feed("line\n") == "line"
    assert m.feed("\nUs") == ""
    assert m.feed("ually") == "\n\nUsually"
    assert m.matched is None
    assert m.feed("!") == "!"


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == "" and m.matched is None


def test_unflushed_tail_at_end_of_generation():
    m = StopMatcher(["###"])
    assert m.feed("done #") == "done "
    assert m.flush() == "#"
    assert m.matched is None


@pytest.mark.parametrize("stops, message", [
    ([""], "stop[0] is empty"),
    (["x" * 300], "stop[0] is 300 characters"),
    ([str(i) for i in range(MAX_STOPS + 1)], f"limit is {MAX_STOPS}"),
    ([3], "stop[0] must be a string"),
])
def test_bad_stops_are_rejected_with_a_reason(stops, message):
    with pytest.raises(StopStringError, match=re.escape(message)):
        StopMatcher(stops)
