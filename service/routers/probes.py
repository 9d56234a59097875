"""Probes: liveness (``/health``), readiness (``/ready``) and Prometheus ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import ServiceError, redact
from ..state import service_state

router = APIRouter(tags=["Probes"])


@router.get("/health")
async def health(raw_request: Request) -> JSONResponse:
    """Liveness: 503 once the engine is dead for good (the process should be restarted)."""
    if service_state(raw_request).backend.dead:
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(raw_request: Request) -> JSONResponse:
    """Readiness: the engine can serve and Redis answers; else 503 naming what is not ready."""
    st = service_state(raw_request)
    problems: dict[str, str] = {}
    try:
        await st.backend.check_ready()
    except ServiceError as e:
        problems["engine"] = e.message
    try:
        await st.store.ping()
    except Exception as e:
        problems["redis"] = redact(f"{type(e).__name__}: {e}")
    if problems:
        return JSONResponse({"status": "not_ready", **problems}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=Response)
async def metrics(raw_request: Request) -> Response:
    """Prometheus text format (this app's own registry)."""
    registry = raw_request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
