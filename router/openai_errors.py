"""HTTP errors of the OpenAI-compatible API in OpenAI's JSON shape, and the HTTP status of each
router (gRPC) error code."""

from __future__ import annotations

import math
from typing import Any

import grpc
from starlette.responses import JSONResponse

from router.errors import RouterError

# gRPC status of a RouterError -> (HTTP status, OpenAI error type, error code)
_HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "no_replica_available"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", "cancelled"),
}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    @classmethod
    def from_router(cls, e: RouterError) -> "HTTPError":
        status, type_, code = _HTTP_OF_GRPC.get(e.code, (500, "server_error", None))
        headers = {}
        if e.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
        return cls(status, e.message, type_, None, code, headers)

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status, headers=self.headers)
