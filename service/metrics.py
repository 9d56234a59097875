"""Prometheus metrics of one app instance (own registry: no process-global state), and the
engine's own metrics beside them (:class:`VllmEngineMetrics`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from .gc_pauses import GcPauses

__all__ = ["LOOP_LAG_INTERVAL_S", "ServiceMetrics", "VllmEngineMetrics"]

LOOP_LAG_INTERVAL_S = 0.05

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_STORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_BACKLOG_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 4096)


class ServiceMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "routereplay_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "routereplay_request_latency_seconds",
            "end-to-end request latency",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("routereplay_prompt_tokens", "prompt tokens", registry=r)
        self.completion_tokens = Counter(
            "routereplay_completion_tokens", "completion tokens", registry=r
        )
        self.routes_stored = Counter(
            "routereplay_routes_stored", "route records stored", registry=r
        )
        self.route_bytes = Counter(
            "routereplay_route_bytes_stored",
            "bytes written to Redis for routes (new chunks + "
            "manifests; shared prefixes are written once)",
            registry=r,
        )
        self.store_errors = Counter(
            "routereplay_route_store_errors",
            "routes that could not be stored",
            ["reason"],
            registry=r,
        )
        self.rows_filled = Counter(
            "routereplay_route_rows_filled", "rows filled from the token-prefix index", registry=r
        )
        self.inflight = Gauge(
            "routereplay_requests_inflight", "completion requests being served", registry=r
        )
        # From a choice's end to its record stored (or refused): what its response waits for.
        self.store_seconds = Histogram(
            "routereplay_route_store_seconds", "time to store one choice's route record",
            buckets=_STORE_BUCKETS, registry=r,
        )  # fmt: skip
        self.pending_writes = Gauge(
            "routereplay_route_writes_pending", "route records waiting to be stored", registry=r
        )
        # The gauge is a moment; this keeps every backlog a record met, so a reader of two
        # scrapes learns the largest one between them without polling the gauge.
        self.write_backlog = Histogram(
            "routereplay_route_write_backlog",
            "route records pending, this one included, as each record's store starts",
            buckets=_BACKLOG_BUCKETS, registry=r,
        )  # fmt: skip
        self.rl_ops = Counter(
            "routereplay_rl_operations", "RL control calls by operation and outcome",
            ["op", "status"], registry=r,
        )  # fmt: skip
        self.rl_latency = Histogram(
            "routereplay_rl_operation_seconds", "RL control call duration", ["op"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "routereplay_engine_queue_depth", "requests inside the engine (running + waiting)",
            registry=r,
        )  # fmt: skip
        self._loop_metrics(r)
        self._engine: Collector | None = None

    def _loop_metrics(self, r: CollectorRegistry) -> None:
        """What holds the serving process's event loop: its lag, its stalls, collections."""
        self.loop_lag = Histogram(
            "routereplay_event_loop_lag_seconds",
            "how late the event loop ran a timer due every "
            f"{LOOP_LAG_INTERVAL_S}s: a stall delays every stream, probe and lease renewal",
            buckets=_LAG_BUCKETS, registry=r,
        )  # fmt: skip
        self.loop_stalls = Counter(
            "routereplay_event_loop_stalls",
            "event-loop stalls of at least --loop-stall-log-ms, each logged with the stack of "
            "the loop's thread",
            registry=r,
        )
        self.gc_pauses = GcPauses()  # started by the app's lifespan
        r.register(self.gc_pauses)
        self.gc_frozen = Gauge(
            "routereplay_gc_frozen_objects",
            "objects the app froze out of the garbage collector's walks at start-up",
            registry=r,
        )

    async def watch_loop_lag(self, beat: Callable[[], None] | None = None) -> None:
        """Observe the event loop's lag until cancelled (a task of the app's lifespan), calling
        ``beat`` each time the timer fires (:mod:`.loop_stalls`)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LOOP_LAG_INTERVAL_S
            await asyncio.sleep(LOOP_LAG_INTERVAL_S)
            if beat is not None:
                beat()
            self.loop_lag.observe(max(0.0, loop.time() - due))

    def bind_queue_depth(self, fn: Callable[[], float]) -> None:
        self.queue_depth.set_function(fn)

    def bind_engine(self, collector: Collector | None) -> None:
        """Serve ``collector``'s metrics (the engine's own) beside this app's; None: stop."""
        if self._engine is not None:
            self.registry.unregister(self._engine)
        self._engine = collector
        if collector is not None:
            self.registry.register(collector)


class VllmEngineMetrics:
    """vLLM's own metrics (``vllm:*``: queue lengths, KV-cache usage, prefix-cache hits,
    preemptions, token counts, latencies) as its stat logger records them in this process.

    vLLM registers them in prometheus_client's global registry. When ``PROMETHEUS_MULTIPROC_DIR``
    is set, prometheus_client keeps every process's values in files there instead, and they are
    read from the files, as ``vllm serve`` reads them. Only ``vllm:*`` families pass: the app's
    own metrics come from its registry, and in multiprocess mode the files hold those too.
    """

    PREFIX = "vllm:"

    def __init__(self, own: Callable[[], Iterable[Metric]] | None = None) -> None:
        """``own``: the backend's metrics of the engine (weights generation, cache resets),
        served beside vLLM's."""
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            self._source = CollectorRegistry()
            MultiProcessCollector(self._source)
        else:
            self._source = REGISTRY
        self._own = own

    def describe(self) -> Iterable[Metric]:
        # Read at each scrape: vLLM registers its metrics when the engine starts, and
        # re-registers them on a restart.
        return ()

    def collect(self) -> Iterable[Metric]:
        yield from (m for m in self._source.collect() if m.name.startswith(self.PREFIX))
        if self._own is not None:
            yield from self._own()
