"""Bounded work per request, before any handler runs.

- :class:`BodySizeLimit` (ASGI middleware): a body over ``max_body_bytes`` is refused with 413
  before it is parsed: at once when ``Content-Length`` says so, else as soon as the bytes received
  pass the cap (chunked uploads), so no oversized body is ever held in memory. A body up to twice
  the cap is then read and discarded, so the client gets its 413 on a connection that stays
  usable; beyond that the connection is closed unread (a client that sends that much is not
  worth the bandwidth).
- :class:`JSONRoute`: FastAPI parses request bodies with pydantic-core's JSON parser (Rust, about
  3x faster than ``json.loads`` on large bodies) instead of the standard library's, which raises
  ``RecursionError`` (a 500) on bodies nested a thousand levels deep; pydantic-core stops at a
  fixed depth, and NaN / Infinity (not JSON) are refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import RequestTooLargeError

__all__ = ["BodySizeLimit", "BodyTooLarge", "JSONRoute"]


class BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` when a streamed body passes the cap (an HTTPException, so FastAPI's
    body parsing lets it through to the error handlers, which answer 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds {limit} bytes")
        self.limit = limit


class BodySizeLimit:
    """ASGI middleware: 413 for request bodies over ``max_body_bytes``."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    if declared <= 2 * limit:
                        await _drain(receive, 2 * limit)
                    response = RequestTooLargeError.for_limit(limit, declared).response()
                    await response(scope, receive, send)
                    return
        received = 0
        more = True

        async def limited() -> Message:
            nonlocal received, more
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                more = message.get("more_body", False)
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited, send)
        if more and received > limit:
            await _drain(receive, 2 * limit - received)


async def _drain(receive: Receive, budget: int) -> None:
    """Read and discard the rest of a request body, up to ``budget`` bytes."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class _JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body, allow_inf_nan=False)
            except ValueError as e:
                # FastAPI turns exactly this type into a 400 "json_invalid" validation error.
                raise json.JSONDecodeError(str(e), "", 0) from None
        return self._json


class JSONRoute(APIRoute):
    """An APIRoute whose request bodies are parsed by :class:`_JSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_with_pydantic_core(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return parse_with_pydantic_core
