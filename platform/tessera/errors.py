"""The error the gateway answers with, wherever it is raised: ``APIError``, and its OpenAI-style body; and the
errors of the control plane's service layer (tenants, keys, deployments, quotas, records), ``ServiceError``s.

Every error body is ``{"error": {"message", "type", "code", "param"}}``; ``tessera.api.errors`` turns
these into HTTP responses, and the admin API turns ``NotFound`` into a 404, ``Conflict`` into a 409 and
``InvalidConfig`` into a 422.
"""

from __future__ import annotations

from typing import Any

# OpenAI's error types by status; anything 5xx is a server fault, never the caller's input.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ServiceError(ValueError):
    """A change or lookup the service layer refused; the message says what was wrong and what to do."""


class NotFound(ServiceError):
    pass


class Conflict(ServiceError):
    pass


class InvalidConfig(ServiceError):
    pass


class APIError(Exception):
    """An error the gateway answers with; ``message`` says what was wrong and what to do instead."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}
