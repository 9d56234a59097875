"""Route records, their binary format, the Redis layout and the HTTP client.

This layer is light on purpose (numpy, msgpack, zstandard, blake3, redis, httpx; pure Python):
both the service and the trainer import it.
"""

from ._batch import BATCH_MEDIA_TYPE, RawBatch
from ._codec import FORMAT_VERSION, MEDIA_TYPE, decode_record, encode_record
from ._errors import (
    RouteConnectionError,
    RouteCorruptError,
    RouteError,
    RouteEvictedError,
    RouteForeignFormatError,
    RouteLimitError,
    RouteNotFoundError,
    RouteServiceError,
    RouteShapeError,
    RouteStoreError,
    RouteTruncatedError,
    RouteVersionError,
    UnsupportedRedisError,
)
from ._http import AsyncRoutesClient, RoutesClient, response_cap
from ._keys import DEFAULT_BLOCK_SIZE, DEFAULT_TTL_S, KeySchema, validate_route_id
from ._layout import PutResult, StoredRecord
from ._limits import ReadLimits, decoded_bytes
from ._load import UNKNOWN_VERSION, expert_counts, layer_counts, load_figures
from ._record import EngineRoutes, RouteRecord, WeightSpan, expert_dtype
from ._store import MIN_REDIS_VERSION, AsyncRouteStore, RouteStore, StoreAddress
from ._threads import default_decode_threads, usable_cpus

__all__ = [
    "BATCH_MEDIA_TYPE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_TTL_S",
    "FORMAT_VERSION",
    "MEDIA_TYPE",
    "MIN_REDIS_VERSION",
    "UNKNOWN_VERSION",
    "AsyncRouteStore",
    "AsyncRoutesClient",
    "EngineRoutes",
    "KeySchema",
    "PutResult",
    "RawBatch",
    "ReadLimits",
    "RouteConnectionError",
    "RouteCorruptError",
    "RouteError",
    "RouteEvictedError",
    "RouteForeignFormatError",
    "RouteLimitError",
    "RouteNotFoundError",
    "RouteRecord",
    "RouteServiceError",
    "RouteShapeError",
    "RouteStore",
    "RouteStoreError",
    "RouteTruncatedError",
    "RouteVersionError",
    "RoutesClient",
    "StoreAddress",
    "StoredRecord",
    "UnsupportedRedisError",
    "WeightSpan",
    "decode_record",
    "decoded_bytes",
    "default_decode_threads",
    "encode_record",
    "expert_counts",
    "expert_dtype",
    "layer_counts",
    "load_figures",
    "response_cap",
    "usable_cpus",
    "validate_route_id",
]
