"""Serving the retrieval API: route records by id, one at a time or in batches, and deletes."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.responses import JSONResponse, Response

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

__all__ = ["ServingRoutes"]


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


def _as_json(route_id: str, rec: RouteRecord) -> dict[str, Any]:
    return {
        "route_id": route_id,
        "model": rec.model,
        "token_ids": rec.token_ids.tolist(),
        "experts": rec.experts.tolist(),
        "valid": rec.valid.tolist(),
        "moe_layers": list(rec.moe_layers),
        "num_layers": rec.num_layers,
        "num_experts": rec.num_experts,
        "prompt_len": rec.prompt_len,
        "num_cached_tokens": rec.num_cached_tokens,
        "metadata": rec.metadata,
        "weight_versions": [list(span) for span in rec.weight_versions],
        # The routing weights' exact values (float32 holds every bf16/fp16 one) and their dtype.
        **(
            {}
            if rec.weights is None
            else {"weights": rec.weights.tolist(), "weights_dtype": rec.weights_dtype}
        ),
    }


class ServingRoutes:
    """``GET``/``DELETE /v1/routes/{route_id}`` and ``POST /v1/routes:batch``."""

    def __init__(self, max_batch_ids: int, max_batch_bytes: int) -> None:
        self.max_batch_ids = max_batch_ids
        self.max_batch_bytes = max_batch_bytes

    async def get(
        self, store: AsyncRouteStore, route_id: str, start: int, as_json: bool
    ) -> Response:
        route_id = _route_id(route_id)
        try:
            rec = await store.get(route_id, start=start)
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
            return JSONResponse(await asyncio.to_thread(_as_json, route_id, rec))
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
