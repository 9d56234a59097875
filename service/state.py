"""The service's state: everything a request handler needs, built once in the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from routereplay.client import AsyncRouteStore

from .capture import RouteCapture
from .clock import Clock, SystemClock
from .engine import EngineBackend
from .errors import EngineUnavailableError
from .metrics import ServiceMetrics
from .model_info import ModelInfo
from .request_ids import RequestIds
from .route_workers import RouteWorkers
from .routing_stats import RoutingStats
from .serving import ServingChat, ServingCompletion, ServingModels, ServingRL, ServingRoutes
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
    rl: ServingRL
    _stores: dict[str, AsyncRouteStore] = field(default_factory=dict)

    def store_for(self, namespace: str | None) -> AsyncRouteStore:
        """The route store of a tenant's namespace (``None``: the service runs without keys).

        Tenants share the Redis connections, not keys: each has its own prefix, so its routes,
        request-id claims and prefix index are out of every other tenant's reach."""
        if namespace is None:
            return self.store
        st = self._stores.get(namespace)
        if st is None:
            base = self.store
            st = AsyncRouteStore(
                base.redis, prefix=f"{base.keys.prefix}:t:{namespace}", ttl_s=base.ttl_s,
                block_size=base.block_size,
            )  # fmt: skip
            if base.address is not None:
                st.address = base.address.with_prefix(st.keys.prefix)
            self._stores[namespace] = st
        return st

    @classmethod
    def build(
        cls,
        settings: Settings,
        metrics: ServiceMetrics,
        backend: EngineBackend,
        store: AsyncRouteStore,
        workers: RouteWorkers,
        clock: Clock | None = None,
    ) -> ServiceState:
        """Compose the serving classes over a started backend, an open store and started route
        workers; ``clock`` times the request-id leases (default: real time)."""
        capture = RouteCapture(
            backend.info, metrics, workers=workers, ttl_s=settings.route_ttl_s,
            timeout_s=settings.store_timeout_s, max_pending=settings.max_pending_writes,
            stats=routing_stats(settings, backend.info),
        )  # fmt: skip
        # A claim is renewed while its request runs, up to the longest a request may run (a
        # leaked one, a stream never started, lapses then); a dead replica's within one lease.
        request_ids = RequestIds(
            settings.upstream_timeout_s + settings.store_timeout_s,
            settings.request_id_lease_s,
            clock or SystemClock(),
        )
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
            routes=ServingRoutes(settings.max_batch_ids, settings.max_batch_bytes),
            rl=ServingRL(backend, metrics, settings.weights_root),
        )


def routing_stats(settings: Settings, info: ModelInfo) -> RoutingStats | None:
    """The expert-load telemetry of ``settings`` for the served model; None when it is off."""
    if settings.routing_stats_window_s <= 0:
        return None
    return RoutingStats(
        info.moe_layers, info.num_experts, info.top_k,
        window_s=settings.routing_stats_window_s, versions=settings.routing_stats_versions,
        per_expert=settings.expert_metrics,
    )  # fmt: skip


def service_state(request: Request) -> ServiceState:
    """The running service's state (503 while the lifespan has not built it yet)."""
    state = getattr(request.app.state, "service", None)
    if state is None:
        raise EngineUnavailableError("the service is starting", code="starting")
    return state
