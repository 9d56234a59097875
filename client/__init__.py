"""Route records, their binary format, the Redis layout and the HTTP client.

This layer is light on purpose (numpy, msgpack, zstandard, redis, httpx): both the service and the
trainer import it.
"""

from ._codec import FORMAT_VERSION, MEDIA_TYPE, decode_record, encode_record
from ._errors import (
    RouteConnectionError,
    RouteCorruptError,
    RouteError,
    RouteForeignFormatError,
    RouteNotFoundError,
    RouteServiceError,
    RouteShapeError,
    RouteTruncatedError,
    RouteVersionError,
)
from ._record import RouteRecord, expert_dtype

__all__ = [
    "FORMAT_VERSION",
    "MEDIA_TYPE",
    "RouteConnectionError",
    "RouteCorruptError",
    "RouteError",
    "RouteForeignFormatError",
    "RouteNotFoundError",
    "RouteRecord",
    "RouteServiceError",
    "RouteShapeError",
    "RouteTruncatedError",
    "RouteVersionError",
    "decode_record",
    "encode_record",
    "expert_dtype",
]
