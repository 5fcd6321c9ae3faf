"""The host's token poll: sleeps of POLL_SECONDS that last about that long.

Linux adds the calling thread's timer slack (50 us unless set) to every sleep, so `time.sleep(20e-6)` took
~75 us: a token the kernel had written waited ~40 us on average before the host saw it, and a request that
joined a running resident launch waited as long before the scheduler picked it up. `poll_sleep` sets the
polling thread's slack to TIMER_SLACK_NS once (the thread's own setting: prctl PR_SET_TIMERSLACK), then sleeps.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

POLL_SECONDS = 20e-6  # host poll interval for new tokens (a decode step is ~0.6-4 ms)
TIMER_SLACK_NS = 1_000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_local = threading.local()


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def tighten_timer_slack() -> bool:
    """Set this thread's timer slack to TIMER_SLACK_NS (once per thread); False where the OS has no such setting."""
    if getattr(_local, "tight", None) is None:
        _local.tight = _PRCTL is not None and _PRCTL(_PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) == 0
    return _local.tight


def timer_slack_ns() -> int | None:
    """This thread's timer slack (None where it cannot be read)."""
    return None if _PRCTL is None else int(_PRCTL(_PR_GET_TIMERSLACK, 0, 0, 0, 0))


def poll_sleep() -> None:
    """One poll interval, with this thread's timer slack tightened first."""
    tighten_timer_slack()
    time.sleep(POLL_SECONDS)
