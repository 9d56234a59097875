"""Serving the retrieval API: route records by id, one at a time or in batches, and deletes."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
from fastapi.responses import JSONResponse, Response

from routereplay.client import (
    BATCH_MEDIA_TYPE,
    MEDIA_TYPE,
    AsyncRouteStore,
    RouteNotFoundError,
    RouteRecord,
    RouteShapeError,
    encode_record,
    validate_route_id,
)

from ..errors import InvalidRequestError, NotFoundError
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
    }


class ServingRoutes:
    """``GET``/``DELETE /v1/routes/{route_id}`` and ``POST /v1/routes:batch``."""

    def __init__(self, store: AsyncRouteStore, max_batch_ids: int) -> None:
        self.store = store
        self.max_batch_ids = max_batch_ids

    async def get(self, route_id: str, start: int, as_json: bool) -> Response:
        route_id = _route_id(route_id)
        try:
            rec = await self.store.get(route_id, start=start)
        except RouteNotFoundError as e:
            raise _not_found(route_id) from e
        except RouteShapeError as e:
            raise InvalidRequestError(f"start: {e}", param="start") from e
        # Encoding (or listing) a long record is CPU work: keep it off the event loop.
        if as_json:
            return JSONResponse(await asyncio.to_thread(_as_json, route_id, rec))
        return Response(await asyncio.to_thread(encode_record, rec), media_type=MEDIA_TYPE)

    async def batch(self, body: BatchRoutesRequest) -> Response:
        if len(body.ids) > self.max_batch_ids:
            raise InvalidRequestError(
                f"ids: {len(body.ids)} ids, at most {self.max_batch_ids} per batch", param="ids"
            )
        ids = [_route_id(i) for i in body.ids]
        try:
            recs = await self.store.get_many(ids, start=body.start, missing_ok=True)
        except RouteShapeError as e:
            raise InvalidRequestError(f"start: {e}", param="start") from e

        def pack() -> bytes:
            records = {i: encode_record(r) for i, r in zip(ids, recs, strict=True) if r}
            missing = [i for i, r in zip(ids, recs, strict=True) if r is None]
            return msgpack.packb({"records": records, "missing": missing}, use_bin_type=True)

        return Response(await asyncio.to_thread(pack), media_type=BATCH_MEDIA_TYPE)

    async def delete(self, route_id: str) -> dict[str, Any]:
        route_id = _route_id(route_id)
        if not await self.store.delete(route_id):
            raise _not_found(route_id)
        return {"id": route_id, "deleted": True}
