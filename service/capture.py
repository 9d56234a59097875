"""Capture: a finished choice's engine routes -> a route record in Redis -> the response handle.

The record is built, stored and counted by a route worker (:mod:`.route_workers`); this side
bounds the writes in flight and turns the worker's outcome into the handle and the metrics. A
route is stored whole or reported ``failed`` (the store publishes the manifest last, so a reader
never sees half a route); a failure never fails the completion itself.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time
import traceback

import numpy as np

from routereplay.client import AsyncRouteStore

from .engine import ChoiceFinished
from .errors import redact
from .metrics import ServiceMetrics
from .model_info import ModelInfo
from .protocol import RouteHandle, WeightSpanOut
from .route_workers import ChoiceJob, RouteWorkerError, RouteWorkers, StoreOutcome
from .routing_stats import RoutingStats

__all__ = ["RouteCapture", "npy_base64"]

log = logging.getLogger("routereplay.service")

# How long past a route's own deadline its worker may take to answer before the route is
# reported failed: the worker stops at the deadline between two Redis batches, and one batch
# is bounded by the socket timeout.
_WORKER_GRACE_S = 15.0


def npy_base64(arr: np.ndarray) -> str:
    """vLLM's inline format: base64 of the ``.npy`` bytes of ``arr``."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getbuffer()).decode("ascii")


class RouteCapture:
    """Builds, fills and stores route records for one served model."""

    def __init__(
        self,
        info: ModelInfo,
        metrics: ServiceMetrics,
        *,
        workers: RouteWorkers,
        ttl_s: int | None = None,
        timeout_s: float = 30.0,
        max_pending: int = 256,
        stats: RoutingStats | None = None,
    ) -> None:
        self.info = info
        self.metrics = metrics
        self.workers = workers
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.stats = stats
        self.pending = 0
        metrics.pending_writes.set_function(lambda: self.pending)

    async def capture(
        self,
        store: AsyncRouteStore,
        route_id: str,
        fin: ChoiceFinished,
        prompt_token_ids: list[int],
        request_id: str,
    ) -> RouteHandle:
        """Store choice ``fin``'s routes under ``route_id`` in ``store`` (the caller's
        namespace); never raises (failures -> handle)."""
        info = self.info
        num_rows = len(prompt_token_ids) + len(fin.output_token_ids)
        handle = RouteHandle(
            route_id=route_id,
            status="failed",
            num_rows=num_rows,
            num_valid_rows=0,
            moe_layers=list(info.moe_layers),
            top_k=info.top_k,
            num_experts=info.num_experts,
        )
        if fin.routed_experts is None:
            handle.error = fin.routes_error or "no routes from the engine"
            self.metrics.store_errors.labels(reason="no_routes").inc()
            return handle
        if self.pending >= self.max_pending:
            # Redis slow or paused: every waiting write holds its record in memory. Past the
            # bound, fail fast rather than grow without limit.
            handle.error = f"route store backlog: {self.pending} writes already pending"
            self.metrics.store_errors.labels(reason="backlog").inc()
            log.warning("storing route %s refused: %s", route_id, handle.error)
            return handle
        self.pending += 1
        self.metrics.write_backlog.observe(self.pending)
        t0 = time.perf_counter()
        try:
            return await self._store(store, route_id, fin, prompt_token_ids, request_id, handle)
        finally:
            self.pending -= 1
            self.metrics.store_seconds.observe(time.perf_counter() - t0)

    async def _store(
        self,
        store: AsyncRouteStore,
        route_id: str,
        fin: ChoiceFinished,
        prompt_token_ids: list[int],
        request_id: str,
        handle: RouteHandle,
    ) -> RouteHandle:
        if store.address is None:
            handle.error = "the route store was not opened from a URL a route worker can open"
            self.metrics.store_errors.labels(reason="no_address").inc()
            return handle
        # One deadline for fill + put, so a capture never takes longer than timeout_s; the
        # worker writes no manifest past it.
        job = ChoiceJob(
            store.address, route_id, self.info, fin, prompt_token_ids, request_id, self.ttl_s,
            time.monotonic() + self.timeout_s, self.stats is not None, store.limits,
        )  # fmt: skip
        try:
            # The worker's own deadline ends its work; this one covers a worker that hangs.
            async with asyncio.timeout(self.timeout_s + _WORKER_GRACE_S):
                out = await self.workers.run(job)
        except Exception as e:  # the job never reached a worker, or its worker went away
            out = StoreOutcome(error=f"{type(e).__name__}: {e}", error_type=type(e).__name__)
            if not isinstance(e, (RouteWorkerError, TimeoutError)):  # a bug (a job unpicklable)
                out.unexpected = traceback.format_exc()
        self._log_fill(route_id, out)
        if out.error is not None:
            return self._failed(route_id, handle, out)
        self.metrics.routes_stored.inc()
        self.metrics.route_bytes.inc(out.bytes_written)
        if self.stats is not None and out.counts is not None:
            self.stats.add(out.counts)
        handle.status = "stored"
        handle.num_valid_rows = out.num_valid_rows
        handle.weight_version = out.weight_version
        handle.weights = fin.routed_weights is not None
        handle.weights_dtype = fin.weights_dtype if handle.weights else None
        handle.weight_versions = [
            WeightSpanOut(version=v, start=a, stop=b) for v, a, b in out.weight_versions
        ] or None
        return handle

    def _log_fill(self, route_id: str, out: StoreOutcome) -> None:
        if out.fill_error is not None:
            log.warning(
                "prefix-index fill for route %s failed, storing unfilled: %s", route_id,
                redact(out.fill_error),
            )  # fmt: skip
            self.metrics.store_errors.labels(reason=f"fill_{out.fill_error_type}").inc()
        self.metrics.rows_filled.inc(out.rows_filled)

    def _failed(self, route_id: str, handle: RouteHandle, out: StoreOutcome) -> RouteHandle:
        error = redact(out.error or "")
        if out.unexpected is not None:  # a bug: keep the traceback
            log.error("storing route %s failed unexpectedly\n%s", route_id, redact(out.unexpected))
        else:  # the store's expected failures (Redis down, full, slow): the reason suffices
            log.warning("storing route %s failed: %s", route_id, error)
        handle.error = error
        self.metrics.store_errors.labels(reason=out.error_type or "unknown").inc()
        return handle
