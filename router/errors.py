"""The one error type the router core raises: a gRPC status code plus a message for the user.

`Router.generate` raises `RouterError` for every failure (bad request, overload, deadline, no
replica); the gRPC servicer turns it into the call's status (with the retry pushback trailer),
the OpenAI HTTP layer into an HTTP status. Errors are never sent in-band.
"""

from __future__ import annotations

import grpc

# Trailing-metadata key gRPC clients read for server pushback (gRFC A6).
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # set with RESOURCE_EXHAUSTED: when a retry may succeed

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        if self.retry_after_s is None:
            return ()
        return ((RETRY_PUSHBACK_KEY, str(max(1, round(self.retry_after_s * 1000)))),)

    def __repr__(self) -> str:
        return f"RouterError({self.code.name}, {self.message!r})"


def invalid(message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message)


def pushback_s(e: grpc.aio.AioRpcError) -> float | None:
    """A server's retry pushback (the gRFC A6 trailer) in seconds; None without a valid one."""
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_PUSHBACK_KEY:
            try:
                return max(0.0, int(value) / 1000.0)
            except ValueError:
                return None
    return None
