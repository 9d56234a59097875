"""The retrieval API: route records by id (binary or JSON), in batches, and deletes.

Binary bodies are ``application/vnd.routereplay.record`` (one record) and
``application/vnd.routereplay.records+msgpack`` (a batch); ``RoutesClient`` speaks both.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import Response

from routereplay.client import BATCH_MEDIA_TYPE, MEDIA_TYPE

from ..errors import error_responses
from ..http_limits import JSONRoute
from ..protocol import BatchRoutesRequest, RouteJSON
from ..state import service_state

router = APIRouter(tags=["Routes"], route_class=JSONRoute)

RouteId = Annotated[
    str, Path(description="`<request id>-<choice index>`, `[A-Za-z0-9._:-]{1,128}`")
]


@router.get(
    "/v1/routes/{route_id}",
    response_class=Response,
    responses={
        200: {
            "content": {
                MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
                "application/json": {"schema": RouteJSON.model_json_schema()},
            }
        },
        **error_responses(400, 404, 503),
    },
)
async def get_route(
    route_id: RouteId,
    raw_request: Request,
    start: Annotated[int, Query(ge=0, description="first row (token position) returned")] = 0,
    format: Annotated[
        Literal["binary", "json"] | None,
        Query(description="`json` for JSON lists; default binary (or by the Accept header)"),
    ] = None,
    accept: Annotated[str | None, Header()] = None,
) -> Response:
    """One route record, rows `start..T`."""
    as_json = format == "json" or (format is None and "application/json" in (accept or ""))
    return await service_state(raw_request).routes.get(route_id, start, as_json)


@router.post(
    "/v1/routes:batch",
    response_class=Response,
    responses={
        200: {
            "content": {BATCH_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
            "description": 'msgpack `{"records": {id: record blob}, "missing": [ids]}`',
        },
        **error_responses(400, 503),
    },
)
async def get_routes_batch(request: BatchRoutesRequest, raw_request: Request) -> Response:
    """Many records in one round trip (each shared prefix chunk read from Redis once)."""
    return await service_state(raw_request).routes.batch(request)


@router.delete("/v1/routes/{route_id}", responses=error_responses(400, 404, 503))
async def delete_route(route_id: RouteId, raw_request: Request) -> dict[str, Any]:
    return await service_state(raw_request).routes.delete(route_id)
