"""Errors the service answers with, in the OpenAI error schema.

``{"error": {"message", "type", "param", "code"}}``; every message names the offending field.
"""

from __future__ import annotations

__all__ = [
    "EngineUnavailableError",
    "InvalidRequestError",
    "NotFoundError",
    "ServiceError",
    "StoreUnavailableError",
]


class ServiceError(Exception):
    status_code = 500
    type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status_code,
            }
        }


class InvalidRequestError(ServiceError):
    status_code = 400
    type = "invalid_request_error"


class NotFoundError(ServiceError):
    status_code = 404
    type = "not_found_error"


class ConflictError(ServiceError):
    """The request collides with one in flight (a reused X-Request-Id): 409."""

    status_code = 409
    type = "conflict_error"


class EngineUnavailableError(ServiceError):
    """The engine died or is unreachable: 503, so load balancers route around this replica."""

    status_code = 503
    type = "engine_unavailable"


class StoreUnavailableError(ServiceError):
    """Redis (the route store) cannot be reached: 503."""

    status_code = 503
    type = "store_unavailable"
