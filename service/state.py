"""The service's state: everything a request handler needs, built once in the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from routereplay.client import AsyncRouteStore

from .capture import RouteCapture
from .engine import EngineBackend
from .errors import EngineUnavailableError
from .metrics import ServiceMetrics
from .request_ids import RequestIds
from .serving import ServingChat, ServingCompletion, ServingModels, ServingRoutes
from .settings import Settings

__all__ = ["ServiceState", "service_state"]


@dataclass
class ServiceState:
    """``request.app.state.service``; handlers reach their serving class through it."""

    settings: Settings
    metrics: ServiceMetrics
    backend: EngineBackend
    store: AsyncRouteStore
    capture: RouteCapture
    request_ids: RequestIds
    chat: ServingChat
    completion: ServingCompletion
    models: ServingModels
    routes: ServingRoutes

    @classmethod
    def build(
        cls,
        settings: Settings,
        metrics: ServiceMetrics,
        backend: EngineBackend,
        store: AsyncRouteStore,
    ) -> ServiceState:
        """Compose the serving classes over a started backend and an open store."""
        capture = RouteCapture(
            store, backend.info, metrics, ttl_s=settings.route_ttl_s,
            timeout_s=settings.store_timeout_s, offload_bytes=settings.offload_bytes,
            max_pending=settings.max_pending_writes,
        )  # fmt: skip
        # A leaked claim (a stream never started) lapses after the longest a request may run.
        request_ids = RequestIds(store, settings.upstream_timeout_s + settings.store_timeout_s)
        return cls(
            settings=settings,
            metrics=metrics,
            backend=backend,
            store=store,
            capture=capture,
            request_ids=request_ids,
            chat=ServingChat(backend, capture, metrics, request_ids),
            completion=ServingCompletion(backend, capture, metrics, request_ids),
            models=ServingModels(backend),
            routes=ServingRoutes(store, settings.max_batch_ids, settings.max_batch_bytes),
        )


def service_state(request: Request) -> ServiceState:
    """The running service's state (503 while the lifespan has not built it yet)."""
    state = getattr(request.app.state, "service", None)
    if state is None:
        raise EngineUnavailableError("the service is starting", code="starting")
    return state
