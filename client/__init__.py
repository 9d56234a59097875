"""Route records, their binary format, the Redis layout and the HTTP client.

This layer is light on purpose (numpy, msgpack, zstandard, redis, httpx): both the service and the
trainer import it.
"""

from ._batch import BATCH_MEDIA_TYPE, RawBatch
from ._codec import FORMAT_VERSION, MEDIA_TYPE, codec_kernel, decode_record, encode_record
from ._errors import (
    RouteConnectionError,
    RouteCorruptError,
    RouteError,
    RouteEvictedError,
    RouteForeignFormatError,
    RouteNotFoundError,
    RouteServiceError,
    RouteShapeError,
    RouteStoreError,
    RouteTruncatedError,
    RouteVersionError,
)
from ._http import AsyncRoutesClient, RoutesClient
from ._layout import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_TTL_S,
    KeySchema,
    PutResult,
    StoredRecord,
    batch_decoder,
    validate_route_id,
)
from ._record import RouteRecord, WeightSpan, expert_dtype
from ._rows import copy_row_runs
from ._store import AsyncRouteStore, RouteStore
from ._threads import default_decode_threads

__all__ = [
    "BATCH_MEDIA_TYPE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_TTL_S",
    "FORMAT_VERSION",
    "MEDIA_TYPE",
    "AsyncRouteStore",
    "AsyncRoutesClient",
    "KeySchema",
    "PutResult",
    "RawBatch",
    "RouteConnectionError",
    "RouteCorruptError",
    "RouteError",
    "RouteEvictedError",
    "RouteForeignFormatError",
    "RouteNotFoundError",
    "RouteRecord",
    "RouteServiceError",
    "RouteShapeError",
    "RouteStore",
    "RouteStoreError",
    "RouteTruncatedError",
    "RouteVersionError",
    "RoutesClient",
    "StoredRecord",
    "WeightSpan",
    "batch_decoder",
    "codec_kernel",
    "copy_row_runs",
    "decode_record",
    "default_decode_threads",
    "encode_record",
    "expert_dtype",
    "validate_route_id",
]
