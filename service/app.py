"""The app factory: ``create_app(settings)`` composes the routers, the error handlers and a lifespan
that starts the engine backend and connects the route store.

Nothing happens at import or in ``create_app`` itself; the engine starts and Redis is connected in
the app's lifespan (a backend or store passed in is used as is and left open). Each endpoint's
code is one hop away: ``routers/<concern>.py`` (HTTP shape) -> ``serving/<concern>.py`` (behaviour).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio.to_thread
from fastapi import FastAPI

from routereplay.client import (
    AsyncRouteStore,
    ReadLimits,
    RouteConnectionError,
    UnsupportedRedisError,
    decoded_bytes,
)

from .auth import KeyRing
from .clock import Clock, SystemClock
from .engine import EngineBackend
from .errors import StartupRefused, install_error_handlers, redact
from .gc_pauses import freeze_startup_heap
from .http_limits import BodySizeLimit
from .loop_stalls import StallWatch
from .metrics import LOOP_LAG_INTERVAL_S, ServiceMetrics
from .model_info import ModelInfo
from .route_workers import RouteWorkers
from .routers import ROUTERS
from .settings import Settings
from .state import ServiceState

__all__ = ["StartupRefusalQuiet", "create_app", "make_backend"]

log = logging.getLogger("routereplay.service")


def make_backend(settings: Settings) -> EngineBackend:
    """The backend ``settings`` select (not started)."""
    if settings.backend != "vllm" and (
        settings.tool_call_parser or settings.enable_auto_tool_choice
    ):
        raise ValueError(
            "--tool-call-parser and --enable-auto-tool-choice are the in-process engine's "
            "(--backend vllm); an upstream vLLM parses tools with its own flags"
        )
    if settings.backend == "upstream":
        from .engines.upstream import UpstreamBackend

        if not settings.upstream_url:
            raise ValueError("backend=upstream needs upstream_url (ROUTEREPLAY_UPSTREAM_URL)")
        if settings.route_weights != "off":
            raise ValueError(
                "--route-weights needs the in-process engine: vLLM's server returns no routing "
                "weights (serve with --backend vllm, or --route-weights off)"
            )
        key = settings.upstream_api_key
        return UpstreamBackend(
            settings.upstream_url,
            served_model_name=settings.served_model_name,
            model_config_path=settings.model,
            timeout_s=settings.upstream_timeout_s,
            api_key=key.get_secret_value() if key is not None else None,
        )
    if settings.backend == "synthetic":
        from .engines.synthetic import SyntheticBackend

        return SyntheticBackend(
            name=settings.served_model_name or "synthetic-moe",
            max_model_len=settings.max_model_len,
            route_weights=settings.route_weights,
        )
    from .engines.vllm import VllmBackend

    model = settings.model
    dtype = settings.dtype
    if model is None:
        from .tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model(settings.tiny_variant, settings.model_dir))
        # float32 keeps the tiny model's routes exact against any other float32 engine.
        dtype = "float32" if dtype == "auto" else dtype
    return VllmBackend(
        model,
        served_model_name=settings.resolved_model_name(),
        dtype=dtype,
        max_model_len=settings.max_model_len,
        seed=settings.seed,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enforce_eager=settings.enforce_eager,
        tensor_parallel_size=settings.tensor_parallel_size,
        extra_engine_args=settings.engine_args,
        cpu_bind=settings.cpu_bind,
        route_weights=settings.route_weights,
        tool_call_parser=settings.tool_call_parser,
        enable_auto_tool_choice=settings.enable_auto_tool_choice,
        offload_bytes=settings.offload_bytes,
    )


async def _check_redis(store: AsyncRouteStore) -> None:
    """Refuse a Redis older than the store needs; an unreachable one is checked by the store
    before its first write instead (the service starts without Redis and reports it on /ready)."""
    try:
        versions = await store.check_server()
    except UnsupportedRedisError as e:
        raise StartupRefused(redact(str(e))) from e
    except RouteConnectionError as e:
        log.warning(
            "Redis unreachable at start, its version is checked on first use: %s", redact(str(e))
        )
        return
    log.info("Redis %s", ", ".join(sorted(set(versions))) or "version not readable (ACL)")


def _open_store(settings: Settings, stack: contextlib.AsyncExitStack) -> AsyncRouteStore:
    """The route store at ``settings.redis_url`` (without one, a private redis-server started
    here), closed by ``stack``."""
    url = settings.redis_url
    if url is None:
        from routereplay.local_redis import redis_server

        from .ctrl_c import sigint_blocked

        # Out of a Ctrl-C's reach like the engine: it stores routes while we drain.
        with sigint_blocked():
            url = stack.enter_context(redis_server(settings.local_redis_maxmemory))
        log.info("no --redis-url: started a private redis-server")
    # Where a trainer reads routes from (RouteStore.from_url), password redacted.
    log.info("routes stored in %s (key prefix %r)", redact(url), settings.route_prefix)
    st = AsyncRouteStore.from_url(
        url, prefix=settings.route_prefix, ttl_s=settings.route_ttl_s,
        block_size=settings.block_size,
    )  # fmt: skip
    stack.push_async_callback(st.close)
    return st


def read_limits(info: ModelInfo, weights: bool) -> ReadLimits:
    """What the service lets one stored record declare before it decodes it: no record it
    writes is longer than its engine's context or wider than its routing layout, so bytes in
    Redis that declare more (a crafted chunk decodes to gigabytes) are refused unread."""
    rows = info.max_model_len
    size = decoded_bytes(rows, len(info.moe_layers), info.top_k, info.num_experts, weights)
    return ReadLimits(max_rows=rows, max_bytes=size)


async def _start_route_workers(
    settings: Settings, stack: contextlib.AsyncExitStack
) -> RouteWorkers:
    """The route workers, started (off the loop) before the first request; the stack waits for
    the routes in flight when it closes them."""
    workers = RouteWorkers(settings.route_workers)
    stack.push_async_callback(workers.aclose)
    pids = await asyncio.to_thread(workers.start)
    where = f"{len(pids)} processes" if pids else "threads of this process"
    log.info("routes are built and stored by route workers: %s", where)
    return workers


async def _start_backend(settings: Settings, stack: contextlib.AsyncExitStack) -> EngineBackend:
    """The backend ``settings`` select, started, closed by ``stack``."""
    be = make_backend(settings)
    await be.start()
    stack.push_async_callback(be.close)
    return be


@contextlib.asynccontextmanager
async def _refusals(app: FastAPI) -> AsyncIterator[None]:
    """Keep a start-up refusal's one line in ``app.state.refused`` for ``routereplay serve``
    (StartupRefusalQuiet keeps the server from printing its traceback)."""
    try:
        yield
    except StartupRefused as e:
        app.state.refused = str(e)
        log.critical("cannot serve: %s", e)
        raise


class StartupRefusalQuiet:
    """ASGI wrapper: a lifespan that failed with :class:`StartupRefused` reports no traceback to
    the server (Starlette sends one as the failure message, uvicorn logs it); the refusal's one
    line is logged and printed instead."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def quiet_send(message: Any) -> None:
            if message["type"] == "lifespan.startup.failed" and self.app.state.refused:
                message = {**message, "message": ""}
            await send(message)

        await self.app(scope, receive, quiet_send)


# How often the watcher looks at the engine: a death is acted on within this (plus the grace).
ENGINE_CHECK_INTERVAL_S = 0.5


async def _watch_engine(
    backend: EngineBackend, grace_s: float, on_fatal: Callable[[str], None], clock: Clock
) -> None:
    """Call ``on_fatal`` once the engine is dead for good, after ``grace_s`` during which the
    service answers 503 (running streams end with their error event, load balancers see it)."""
    while not backend.dead:
        await clock.sleep(ENGINE_CHECK_INTERVAL_S)
    reason = "the engine died and cannot recover"
    log.critical("%s; the service stops in %.0f s so its supervisor restarts it", reason, grace_s)
    await clock.sleep(grace_s)
    on_fatal(reason)


def create_app(
    settings: Settings | None = None,
    *,
    backend: EngineBackend | None = None,
    store: AsyncRouteStore | None = None,
    on_fatal: Callable[[str], None] | None = None,
    clock: Clock | None = None,
) -> FastAPI:
    """Build the ASGI app; a ``backend``/``store`` passed in is used as is and not closed.

    ``on_fatal(reason)`` is called when the engine has died for good (``routereplay serve`` then
    exits with status 3, so compose or Kubernetes restarts it); without it the app stays up and
    answers 503. ``clock`` times the request-id leases and the dead-engine grace period (see
    :mod:`.clock`; default: real time).
    """
    settings = settings or Settings()
    clock = clock or SystemClock()
    metrics = ServiceMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _refusals(app), contextlib.AsyncExitStack() as stack:
            st = store if store is not None else _open_store(settings, stack)
            await _check_redis(st)
            be = backend if backend is not None else await _start_backend(settings, stack)
            st.limits = read_limits(be.info, settings.route_weights != "off")
            metrics.bind_queue_depth(be.num_unfinished)
            metrics.bind_engine(be.engine_metrics())
            if st.address is None:  # else every route would fail, one by one
                raise StartupRefused("the route store was not opened from a URL (from_url): "
                                     "route workers cannot open it")  # fmt: skip
            workers = await _start_route_workers(settings, stack)
            app.state.service = ServiceState.build(settings, metrics, be, st, workers, clock)
            stack.push_async_callback(app.state.service.request_ids.aclose)
            if (stats := app.state.service.capture.stats) is not None:
                metrics.registry.register(stats)
                stack.callback(metrics.registry.unregister, stats)
            # FastAPI runs sync dependencies through anyio, whose asyncio backend imports on first
            # use: done here, not as a stall of the first request's event loop.
            await anyio.to_thread.run_sync(lambda: None)
            _freeze_heap(metrics, stack)
            # After the start-up collection, so the lag and the stalls are the serving loop's.
            _watch_loop(settings, metrics, stack)
            watcher = None
            if on_fatal is not None:
                watcher = asyncio.create_task(
                    _watch_engine(be, settings.engine_death_grace_s, on_fatal, clock)
                )
            try:
                yield
            finally:
                if watcher is not None:
                    watcher.cancel()
                metrics.bind_engine(None)
                app.state.service = None

    app = FastAPI(
        title="routereplay",
        summary="OpenAI-compatible vLLM front end that stores every completion's routed experts.",
        version=_version(),
        lifespan=lifespan,
        # Served by routers/docs.py behind the API keys, like every endpoint but /health.
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.service = None
    app.state.refused = None
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.keys = KeyRing.from_settings(settings)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes)
    for router in ROUTERS:
        app.include_router(router)
    return app


def _watch_loop(
    settings: Settings, metrics: ServiceMetrics, stack: contextlib.AsyncExitStack
) -> None:
    """The loop's lag on /metrics, and each stall's stack logged (:mod:`.loop_stalls`)."""
    watch = None
    if settings.loop_stall_log_ms > 0:
        watch = StallWatch(
            settings.loop_stall_log_ms / 1e3, LOOP_LAG_INTERVAL_S, metrics.loop_stalls
        )
        watch.start()
        stack.callback(watch.stop)
    lag = asyncio.create_task(metrics.watch_loop_lag(watch.beat if watch is not None else None))
    stack.callback(lag.cancel)


def _freeze_heap(metrics: ServiceMetrics, stack: contextlib.AsyncExitStack) -> None:
    """Everything loaded by now lives as long as the app: out of the collector's walks for
    the app's life (:mod:`.gc_pauses`), and each collection timed on /metrics, starting with
    the full one before the freeze (what each would cost without it)."""
    metrics.gc_pauses.start()
    stack.callback(metrics.gc_pauses.stop)
    metrics.gc_frozen.set(freeze_startup_heap())
    stack.callback(gc.unfreeze)  # the host process keeps its heap whole after the app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("routereplay")
    except PackageNotFoundError:
        return "0+unknown"
