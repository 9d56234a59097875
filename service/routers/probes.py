"""Probes: liveness (``/health``, and ``/ping`` as SageMaker asks it), readiness (``/ready``),
the release (``/version``) and Prometheus ``/metrics``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..auth import AuthenticationError, KeyRing, principal
from ..errors import ServiceError, redact
from ..state import service_state

router = APIRouter(tags=["Probes"])


@router.get("/health")
async def health(raw_request: Request) -> JSONResponse:
    """Liveness: 503 once the engine is dead for good (the process should be restarted)."""
    if service_state(raw_request).backend.dead:
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ping")
@router.post("/ping")
async def ping(raw_request: Request) -> JSONResponse:
    """SageMaker's health check, as vLLM serves it: ``/health``'s answer."""
    return await health(raw_request)


@router.get("/version", dependencies=[Depends(principal)])
async def version(raw_request: Request) -> JSONResponse:
    """vLLM's ``/version``: the vLLM release serving the requests (null for the synthetic
    engine), and this service's own."""
    st = service_state(raw_request)
    mine = raw_request.app.version
    return JSONResponse({"version": st.backend.vllm_version, "routereplay": mine})


@router.get("/ready")
async def ready(raw_request: Request) -> JSONResponse:
    """Readiness: the engine can serve and Redis takes writes (a paused, full or unreachable
    Redis is not ready), each checked within ``--ready-timeout-s``; 503 naming what is not.
    Open to probes without a key; with keys configured the reasons go to key holders only."""
    st = service_state(raw_request)
    timeout = st.settings.ready_timeout_s

    async def check(what: str, probe: Awaitable[object]) -> tuple[str, str | None]:
        try:
            async with asyncio.timeout(timeout):
                await probe
        except ServiceError as e:
            return what, e.message
        except TimeoutError:
            return what, f"no answer within {timeout:g} s"
        except Exception as e:
            return what, redact(f"{type(e).__name__}: {e}")
        return what, None

    results = await asyncio.gather(
        check("engine", st.backend.check_ready()), check("redis", st.store.check_writable())
    )
    problems = {what: problem for what, problem in results if problem}
    if problems:
        keys: KeyRing = raw_request.app.state.keys
        try:
            keys.authenticate(raw_request.headers.get("authorization"))
        except AuthenticationError:
            problems = {what: "not ready" for what in problems}
        return JSONResponse({"status": "not_ready", **problems}, status_code=503)
    return JSONResponse({"status": "ready"})


def _metrics_access(request: Request) -> None:
    # --metrics-open: a Prometheus that discovers pods by annotation scrapes without credentials.
    if not request.app.state.settings.metrics_open:
        principal(request)


@router.get("/metrics", response_class=Response, dependencies=[Depends(_metrics_access)])
async def metrics(raw_request: Request) -> Response:
    """Prometheus text format (this app's own registry). Needs a key when keys are configured,
    unless --metrics-open."""
    registry = raw_request.app.state.metrics.registry
    # The page grows with the series (tenants, buckets) and is scraped while tokens stream:
    # rendered on a thread, as the collectors lock their own values.
    body = await asyncio.to_thread(generate_latest, registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
