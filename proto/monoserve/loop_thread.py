"""An asyncio event loop on its own daemon thread.

The replica and router servers are grpc.aio servers, but they are started from synchronous code
(the CLI, Ray actors, tests); each owns one of these. Lives beside the API stubs because both
`replicas` and `router` may import `monoserve`, and neither may import the other.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Starts a fresh event loop running on a daemon thread named `name`."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (call from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop, join its thread and close the loop. Idempotent."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
