"""Errors the service answers with, all in one OpenAI error schema, and the handlers that say so.

``{"error": {"message": str, "type": str, "param": str | null, "code": str}}``: ``code`` is always a
string, ``param`` names the request field (``messages[0].role``, ``max_tokens``, ``X-Request-Id``,
``route_id``) whenever one is at fault, and the message starts with that field. FastAPI's own
errors (unknown path, wrong method, body validation) are rewritten into the same schema by
:func:`install_error_handlers`, so no response ever carries ``{"detail": ...}``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from routereplay.client import RouteConnectionError

__all__ = [
    "ConflictError",
    "EngineUnavailableError",
    "ErrorBody",
    "ErrorResponse",
    "InvalidRequestError",
    "NotFoundError",
    "RequestTooLargeError",
    "RouteCorruptResponse",
    "RouteTooLargeResponse",
    "ServiceError",
    "StartupRefused",
    "StoreUnavailableError",
    "error_responses",
    "install_error_handlers",
    "redact",
]

log = logging.getLogger("routereplay.service")


class StartupRefused(Exception):
    """The service cannot serve as configured (an unsupported Redis, an engine without the
    capture it needs): ``routereplay serve`` prints the message as one line and exits 2."""


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorResponse(BaseModel):
    """The OpenAI error schema (documented on every endpoint in ``/openapi.json``)."""

    error: ErrorBody


class ServiceError(Exception):
    """Base of every error the service answers with; subclasses set status, type and code."""

    status_code = 500
    type = "internal_error"
    default_code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class InvalidRequestError(ServiceError):
    status_code = 400
    type = "invalid_request_error"
    default_code = "invalid_value"


class RequestTooLargeError(ServiceError):
    """The request body is over the service's cap: 413, before it is parsed."""

    status_code = 413
    type = "invalid_request_error"
    default_code = "request_too_large"

    @classmethod
    def for_limit(cls, limit: int, size: int | None = None) -> RequestTooLargeError:
        got = f" ({size} bytes)" if size is not None else ""
        return cls(
            f"body: the request body{got} exceeds the limit of {limit} bytes (--max-body-bytes)",
            param="body",
        )


class NotFoundError(ServiceError):
    status_code = 404
    type = "not_found_error"
    default_code = "not_found"


class RouteCorruptResponse(ServiceError):
    """The stored bytes of a route fail their checks (checksum, structure, content address):
    422, as retrying cannot help; the route must be generated again."""

    status_code = 422
    type = "route_corrupt_error"
    default_code = "route_corrupt"


class RouteTooLargeResponse(ServiceError):
    """The stored route declares more rows or bytes than the service's reader limits
    (``ReadLimits``): 422, refused before it is decoded (``POST /v1/routes:batch`` lists such
    an id under ``errors`` with this code)."""

    status_code = 422
    type = "route_too_large_error"
    default_code = "route_too_large"


class MethodNotAllowedError(ServiceError):
    status_code = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class ConflictError(ServiceError):
    """The request collides with one in flight (a reused X-Request-Id): 409."""

    status_code = 409
    type = "conflict_error"
    default_code = "conflict"


class EngineUnavailableError(ServiceError):
    """The engine died or is unreachable: 503, so load balancers route around this replica."""

    status_code = 503
    type = "engine_unavailable"
    default_code = "engine_unavailable"


class StoreUnavailableError(ServiceError):
    """Redis (the route store) cannot be reached: 503."""

    status_code = 503
    type = "store_unavailable"
    default_code = "store_unavailable"


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route decorator: each status documented with :class:`ErrorResponse`."""
    return {s: {"model": ErrorResponse} for s in statuses}


def redact(text: str) -> str:
    """``text`` with the password of any ``scheme://user:password@host`` URL replaced by ``***``.

    Redis client errors repeat the URL they were given; a ``rediss://:PASSWORD@host`` must never
    reach a response body or a log line.
    """
    return re.sub(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s]+@", r"\1***@", text)


# Pydantic error types -> OpenAI's error codes (the ones its API answers for the same mistakes).
_CODES = {
    "missing": "missing_required_parameter",
    "json_invalid": "invalid_json",
    "extra_forbidden": "unknown_parameter",
    "greater_than": "value_below_minimum",
    "greater_than_equal": "value_below_minimum",
    "less_than": "value_above_maximum",
    "less_than_equal": "value_above_maximum",
    "too_short": "array_too_short",
    "too_long": "array_too_long",
    "string_too_short": "string_too_short",
    "string_too_long": "string_too_long",
    "literal_error": "invalid_value",
    "enum": "invalid_value",
    "value_error": "invalid_value",
}


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``.

    Pydantic adds the tag of a union member it tried (``str``, ``list[int]``, ``function-after``)
    to the location; those are not fields and are left out.
    """
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (
            "[" in part
            or "-" in part
            or part[:1].isupper()  # a union member's tag or class name
            or part in ("str", "int", "float", "bool", "list", "dict")
        ):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or None


def validation_error(exc: RequestValidationError | Any) -> InvalidRequestError:
    """The first error of a validation failure, as a 400 naming its field."""
    errors = exc.errors()
    err = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
    loc = tuple(err.get("loc", ()))
    kind = err.get("type", "value_error")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error") or err.get("msg")
        return InvalidRequestError(
            f"request body is not valid JSON: {detail}", param="body", code="invalid_json"
        )
    param = _param_path(loc)
    msg = str(err.get("msg", "invalid value"))
    # "Value error, n must be ..." -> the validator's own sentence.
    msg = msg.removeprefix("Value error, ")
    if param is None and loc[:1] == ("body",):
        # A rule across fields (a model validator) has no location; its message starts with
        # the field it is about ("top_logprobs requires logprobs=true").
        lead = re.match(r"([a-z][a-z0-9_]*)\b[ =:]", msg)
        param = lead.group(1) if lead else "body"
    code = _CODES.get(kind) or ("invalid_type" if kind.endswith("_type") else "invalid_value")
    if kind == "missing":
        msg = "is required"
    if param == "body" and kind in ("model_attributes_type", "dict_type", "model_type"):
        msg = "the request body must be a JSON object"
        return InvalidRequestError(msg, param="body", code="invalid_type")
    if param and not msg.startswith(param):
        msg = f"{param}: {msg}"
    return InvalidRequestError(msg, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    """Every error, FastAPI's own included, answered in the one schema above."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        err: ServiceError
        if exc.status_code == 404:
            err = NotFoundError(f"no endpoint {where}; see /docs for the API", code="not_found")
        elif exc.status_code == 413:
            err = RequestTooLargeError.for_limit(getattr(exc, "limit", 0))
        elif exc.status_code == 405:
            err = MethodNotAllowedError(
                f"method {request.method} is not allowed on {request.url.path}",
                headers=dict(exc.headers or {}),
            )
        else:
            err = ServiceError(str(exc.detail), code=f"http_{exc.status_code}")
            err.status_code = exc.status_code
            err.type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return err.response()

    @app.exception_handler(RouteConnectionError)
    async def _store_down(request: Request, exc: RouteConnectionError) -> JSONResponse:
        return StoreUnavailableError(f"route store unavailable: {redact(str(exc))}").response()

    # Anything else (a bug) is answered by InternalErrors below, which does not re-raise:
    # Starlette's last-resort handler re-raises after its 500, and the server then drops the
    # keep-alive connection the client would have reused.
    app.add_middleware(InternalErrors)


class InternalErrors:
    """ASGI middleware: an unhandled exception becomes a logged 500 in the schema, and the
    connection stays usable (unless the response had already started: then it must close)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            err = ServiceError(
                f"internal error: {type(exc).__name__}; the server log has the traceback"
            )
            await err.response()(scope, receive, send)
