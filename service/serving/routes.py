"""Serving the retrieval API: route records by id, one at a time or in batches, and deletes."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi.responses import Response

from routereplay.client import (
    BATCH_MEDIA_TYPE,
    MEDIA_TYPE,
    AsyncRouteStore,
    RouteCorruptError,
    RouteEvictedError,
    RouteLimitError,
    RouteNotFoundError,
    RouteRecord,
    RouteShapeError,
    encode_record,
    validate_route_id,
)

from ..errors import (
    InvalidRequestError,
    NotFoundError,
    RouteCorruptResponse,
    RouteTooLargeResponse,
)
from ..protocol import BatchRoutesRequest
from .route_json import route_json

__all__ = ["MAX_JSON_ROWS", "MAX_JSON_WEIGHT_ROWS", "ServingRoutes"]


def _route_id(route_id: str) -> str:
    try:
        return validate_route_id(route_id)
    except RouteShapeError as e:
        raise InvalidRequestError(
            f"route_id: {e}", param="route_id", code="invalid_route_id"
        ) from e


def _not_found(route_id: str) -> NotFoundError:
    return NotFoundError(
        f"route_id {route_id!r} not found (never stored, deleted or expired)",
        param="route_id",
        code="route_not_found",
    )


# A JSON route is at most this many rows (the binary form has no such bound): 8192 rows of a
# 48-layer top-8 model are 3.1M ids, about 13 MB of JSON; with the routing weights, whose
# floats print at about a microsecond each under the GIL, 2048. Longer routes page with
# start/stop.
MAX_JSON_ROWS = 8192
MAX_JSON_WEIGHT_ROWS = 2048
# JSON renders one route at a time: two rendering threads contending for the GIL with the event
# loop starve it (each hand-off may go to the other renderer).
_RENDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="route-json")


def _json_stop(start: int, stop: int | None) -> int:
    """The row a JSON read stops at: one row past the larger of the two bounds (whether the
    record has weights is known only once it is read), so that an over-long window is seen and
    refused without the rest of a long route being read and decoded."""
    bound = start + max(MAX_JSON_ROWS, MAX_JSON_WEIGHT_ROWS) + 1
    return bound if stop is None else min(stop, bound)


def _check_json_window(rec: RouteRecord, start: int, stop: int | None) -> None:
    """Refuse a JSON window (``rec``: rows ``start..stop`` as read up to :func:`_json_stop`)
    over :data:`MAX_JSON_ROWS` rows (:data:`MAX_JSON_WEIGHT_ROWS` with weights), naming the way
    to read it."""
    most = MAX_JSON_ROWS if rec.weights is None else MAX_JSON_WEIGHT_ROWS
    n = rec.num_tokens
    if n <= most:
        return
    end, read_stop = start + n, _json_stop(start, stop)
    # A read cut at the JSON bound (not at the caller's stop) leaves the route's end unknown.
    if end < read_stop or read_stop == stop:
        rows = f"rows [{start}, {end}) are {n}"
    else:
        rows = f"the rows from {start} on exceed {most}"
    with_weights = "" if rec.weights is None else " with its weights"
    raise InvalidRequestError(
        f"a JSON route{with_weights} is at most {most} rows; {rows}: page with start and stop, "
        "or read the binary form",
        param="stop",
        code="json_rows_over_limit",
    )


class ServingRoutes:
    """``GET``/``DELETE /v1/routes/{route_id}`` and ``POST /v1/routes:batch``."""

    def __init__(self, max_batch_ids: int, max_batch_bytes: int) -> None:
        self.max_batch_ids = max_batch_ids
        self.max_batch_bytes = max_batch_bytes

    async def get(
        self,
        store: AsyncRouteStore,
        route_id: str,
        start: int,
        as_json: bool,
        stop: int | None = None,
    ) -> Response:
        route_id = _route_id(route_id)
        if stop is not None and stop <= start:  # before Redis is asked
            raise InvalidRequestError(
                f"stop={stop} must be greater than start={start}", param="stop"
            )
        # The store reads only the chunks of rows start..stop (a JSON read: at most its bound).
        read_stop = _json_stop(start, stop) if as_json else stop
        try:
            rec = await store.get(route_id, start=start, stop=read_stop)
        except (RouteNotFoundError, RouteEvictedError) as e:
            raise _not_found(route_id) from e
        except RouteShapeError as e:
            raise InvalidRequestError(f"start: {e}", param="start") from e
        except RouteCorruptError as e:
            raise RouteCorruptResponse(str(e), param="route_id") from e
        except RouteLimitError as e:
            raise RouteTooLargeResponse(str(e), param="route_id") from e
        # Encoding (or listing) a long record is CPU work: keep it off the event loop.
        if as_json:
            _check_json_window(rec, start, stop)
            loop = asyncio.get_running_loop()
            body = await loop.run_in_executor(_RENDER, route_json, route_id, rec)
            return Response(body, media_type="application/json")
        return Response(await asyncio.to_thread(encode_record, rec), media_type=MEDIA_TYPE)

    async def batch(self, store: AsyncRouteStore, body: BatchRoutesRequest) -> Response:
        """The stored bytes of the ids (manifests + each distinct chunk once), undecoded; the
        reader assembles and verifies them. Past ``max_batch_bytes`` the remaining ids are
        listed as ``deferred`` for a next request (RoutesClient follows up by itself)."""
        if len(body.ids) > self.max_batch_ids:
            raise InvalidRequestError(
                f"ids: {len(body.ids)} ids, at most {self.max_batch_ids} per batch", param="ids"
            )
        ids = list(dict.fromkeys(_route_id(i) for i in body.ids))
        raw = await store.get_raw(ids, start=body.start, max_bytes=self.max_batch_bytes)
        # Packing many MB is CPU work: keep it off the event loop.
        packed = await asyncio.to_thread(raw.pack) if raw.num_bytes > 1 << 20 else raw.pack()
        return Response(packed, media_type=BATCH_MEDIA_TYPE)

    async def delete(self, store: AsyncRouteStore, route_id: str) -> dict[str, Any]:
        route_id = _route_id(route_id)
        if not await store.delete(route_id):
            raise _not_found(route_id)
        return {"id": route_id, "deleted": True}
