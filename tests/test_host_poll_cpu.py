"""The host's token poll (replicas/host_poll.py) and the order in which a drain hands out tokens.

Linux adds a thread's timer slack (50 us unless set) to each sleep, which made the 20 us poll ~75 us: tokens
and joins waited for it. poll_sleep tightens the polling thread's own slack and leaves other threads alone.
The batched engine's drain puts a request's first token before the running slots' next ones (its TTFT).
"""

from __future__ import annotations

import queue
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from replicas import host_poll
from replicas import layout as L

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux") or host_poll._PRCTL is None,
                                reason="timer slack is a Linux per-thread setting")


@linux_only
def test_poll_sleep_tightens_only_the_polling_threads_timer_slack():
    seen = {}

    def poller():
        seen["before"] = host_poll.timer_slack_ns()
        host_poll.poll_sleep()
        seen["after"] = host_poll.timer_slack_ns()

    t = threading.Thread(target=poller)
    t.start()
    t.join()
    assert seen["after"] == host_poll.TIMER_SLACK_NS
    other = {}
    t = threading.Thread(target=lambda: other.setdefault("slack", host_poll.timer_slack_ns()))
    t.start()
    t.join()
    assert other["slack"] == seen["before"]  # a thread that never polled keeps what it inherited


def test_tighten_timer_slack_reports_where_it_cannot(monkeypatch):
    monkeypatch.setattr(host_poll, "_PRCTL", None)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("ok", host_poll.tighten_timer_slack()))
    t.start()
    t.join()
    assert result["ok"] is False and host_poll.timer_slack_ns() is None
    host_poll.poll_sleep()  # still sleeps


def test_drain_puts_a_first_token_before_the_running_slots_next_ones():
    from replicas.monokernel_batched import BatchedMonokernelEngine, _Request
    from replicas.engine import SamplingParams

    order = []

    class Recording(queue.Queue):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def put(self, item, *a, **k):
            order.append((self.name, item))
            super().put(item, *a, **k)

    width = 4
    ctrl = np.zeros((width, L.CTRL_WORDS), np.int64)
    tokens = np.arange(width * 16, dtype=np.int32).reshape(width, 16) + 1000
    slots = []
    for b, sent in enumerate((5, 7, 0, 3)):  # slot 2 joined: nothing sent yet
        r = _Request([1, 2, 3], SamplingParams(max_tokens=32), [], threading.Event(), out=Recording(f"slot{b}"))
        r.sent = sent
        ctrl[b, L.CTRL_COUNT] = sent + 1  # one new token each
        slots.append(r)
    engine = SimpleNamespace(
        gpu=SimpleNamespace(slot_ctrl=lambda b: ctrl[b], slot_tokens=lambda b: tokens[b]),
        _slots=slots, _cv=threading.Condition(), _resident_launch=True,
        _sessions=SimpleNamespace(pending=[], ended=lambda *a: False))
    BatchedMonokernelEngine._drain(engine, final=False)
    assert [name for name, _ in order] == ["slot2", "slot0", "slot1", "slot3"]
    assert order[0][1] == ("tok", int(tokens[2, 0]))
    assert all(r.sent == ctrl[b, L.CTRL_COUNT] for b, r in enumerate(slots))
