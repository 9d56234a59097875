"""Every error routereplay's client layer raises. Each message names the offending id or field."""

from __future__ import annotations

__all__ = [
    "RouteConnectionError",
    "RouteCorruptError",
    "RouteError",
    "RouteEvictedError",
    "RouteForeignFormatError",
    "RouteLimitError",
    "RouteNotFoundError",
    "RouteServiceError",
    "RouteShapeError",
    "RouteTruncatedError",
    "RouteVersionError",
    "UnsupportedRedisError",
]


class RouteError(Exception):
    """Base class of all routereplay errors."""


class RouteShapeError(RouteError, ValueError):
    """A record's arrays or fields are inconsistent (wrong shape, dtype, range)."""


class RouteNotFoundError(RouteError, KeyError):
    """No record is stored under the route id (never written, deleted or expired)."""

    def __init__(self, route_id: str, detail: str = "") -> None:
        self.route_id = route_id
        msg = f"route {route_id!r} not found"
        super().__init__(msg + (f": {detail}" if detail else ""))

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class RouteCorruptError(RouteError, ValueError):
    """Stored bytes fail their checksum, structure or content address, or a chunk a manifest
    names is missing."""


class RouteEvictedError(RouteCorruptError):
    """A chunk the record's manifest names is gone (expired or evicted before the manifest):
    the record cannot be read. ``missing_ok`` reads report it as missing."""


class RouteTruncatedError(RouteCorruptError):
    """A blob ends before its declared length."""


class RouteForeignFormatError(RouteCorruptError):
    """The bytes are not a routereplay blob at all (wrong magic)."""


class RouteLimitError(RouteError, ValueError):
    """A record's declared size exceeds the reader's limits (:class:`ReadLimits`): refused
    before its rows are allocated. The message names the limit and how to raise it."""


class RouteVersionError(RouteError, ValueError):
    """The blob was written by a newer format version than this library reads."""


class RouteStoreError(RouteError):
    """Redis answered but refused a command (out of memory, read-only replica, Redis < 7.0)."""


class UnsupportedRedisError(RouteStoreError):
    """The Redis server is older than the store needs (``MIN_REDIS_VERSION``)."""


class RouteConnectionError(RouteError, ConnectionError):
    """Redis or the routereplay service could not be reached."""


class RouteServiceError(RouteError):
    """The routereplay service answered with an error (OpenAI error schema)."""

    def __init__(self, status_code: int, message: str, type_: str = "", param: str | None = None):
        self.status_code = status_code
        self.type = type_
        self.param = param
        super().__init__(f"HTTP {status_code}: {message}" + (f" (param: {param})" if param else ""))
