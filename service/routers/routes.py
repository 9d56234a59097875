"""The retrieval API: route records by id (binary or JSON), in batches, and deletes.

Binary bodies are ``application/vnd.routereplay.record`` (one record) and
``application/vnd.routereplay.chunks+msgpack`` (a batch: the stored bytes, undecoded);
``RoutesClient`` speaks both.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import Response

from routereplay.client import BATCH_MEDIA_TYPE, MEDIA_TYPE

from ..auth import Caller
from ..errors import error_responses
from ..http_limits import JSONRoute
from ..protocol import BatchRoutesRequest, RouteJSON
from ..state import service_state

router = APIRouter(tags=["Routes"], route_class=JSONRoute)

RouteId = Annotated[
    str, Path(description="`<request id>-<choice index>`, `[A-Za-z0-9._:-]{1,128}`")
]
Tenant = Annotated[
    str | None,
    Query(description="admin keys only: the tenant whose routes to reach (default: your own)"),
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
        **error_responses(400, 401, 403, 404, 422, 503),
    },
)
async def get_route(
    route_id: RouteId,
    raw_request: Request,
    who: Caller,
    start: Annotated[int, Query(ge=0, description="first row (token position) returned")] = 0,
    stop: Annotated[
        int | None,
        Query(ge=1, description="row after the last returned (default: the route's end)"),
    ] = None,
    format: Annotated[
        Literal["binary", "json"] | None,
        Query(description="`json` for JSON lists; default binary (or by the Accept header)"),
    ] = None,
    accept: Annotated[str | None, Header()] = None,
    tenant: Tenant = None,
) -> Response:
    """One route record, rows `start` up to `stop` (default the end); JSON at most 8192 rows."""
    as_json = format == "json" or (format is None and "application/json" in (accept or ""))
    st = service_state(raw_request)
    store = st.store_for(who.namespace(tenant))
    return await st.routes.get(store, route_id, start, as_json, stop)


@router.post(
    "/v1/routes:batch",
    response_class=Response,
    responses={
        200: {
            "content": {BATCH_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
            "description": 'msgpack `{"manifests": {id: bytes}, "chunks": {digest: bytes}, '
            '"missing": [ids], "errors": {id: {code, message}}, "deferred": [ids]}`',
        },
        **error_responses(400, 401, 403, 413, 503),
    },
)
async def get_routes_batch(
    request: BatchRoutesRequest, raw_request: Request, who: Caller, tenant: Tenant = None
) -> Response:
    """The stored bytes of many records (each shared chunk once); RoutesClient assembles them."""
    st = service_state(raw_request)
    return await st.routes.batch(st.store_for(who.namespace(tenant)), request)


@router.delete("/v1/routes/{route_id}", responses=error_responses(400, 401, 403, 404, 422, 503))
async def delete_route(
    route_id: RouteId, raw_request: Request, who: Caller, tenant: Tenant = None
) -> dict[str, Any]:
    """Delete a route of yours (an admin key: of any tenant)."""
    st = service_state(raw_request)
    return await st.routes.delete(st.store_for(who.namespace(tenant)), route_id)
