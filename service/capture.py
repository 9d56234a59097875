"""Capture: a finished choice's engine routes -> a route record in Redis -> the response handle.

A route is stored whole or reported ``failed`` (the store publishes the manifest last, so a
reader never sees half a route); a failure never fails the completion itself.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time

import numpy as np

from routereplay.client import AsyncRouteStore, EngineRoutes, RouteError, RouteRecord

from .engine import ChoiceFinished
from .errors import redact
from .metrics import ServiceMetrics
from .model_info import ModelInfo
from .protocol import RouteHandle, WeightSpanOut
from .routing_stats import RoutingStats

__all__ = ["RouteCapture", "npy_base64"]

log = logging.getLogger("routereplay.service")


def row_spans(
    output_spans: list[tuple[str, int, int]] | None, prompt_len: int, num_rows: int
) -> list[tuple[str, int, int]]:
    """The engine's weight-version spans over output tokens, as spans over the record's rows.

    Output token ``i`` is sampled by the forward pass over position ``P + i - 1`` (``P`` the
    prompt length), which also routes row ``P + i - 1``; the prompt's rows are routed by the
    prefill that samples token 0. So rows ``[0, P)`` take token 0's version and row ``P + i``
    token ``i + 1``'s: output span ``[s, e)`` covers rows ``[P + s - 1, P + e - 1)``, the first
    one from row 0 and the last one to the end (the final row is never routed). Unknown -> [].
    """
    spans = [(v, s, e) for v, s, e in output_spans or () if e > s]
    if not spans:
        return []
    out = []
    for n, (v, s, e) in enumerate(spans):
        a = 0 if n == 0 else prompt_len + s - 1
        b = num_rows if n == len(spans) - 1 else prompt_len + e - 1
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], b)
        elif b > a:
            out.append((v, a, b))
    return out


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
        ttl_s: int | None = None,
        timeout_s: float = 30.0,
        offload_bytes: int = 1 << 18,
        max_pending: int = 256,
        stats: RoutingStats | None = None,
    ) -> None:
        self.info = info
        self.metrics = metrics
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.offload_bytes = offload_bytes
        self.max_pending = max_pending
        self.stats = stats
        self.pending = 0
        metrics.pending_writes.set_function(lambda: self.pending)

    def build(
        self, fin: ChoiceFinished, prompt_token_ids: list[int], request_id: str
    ) -> RouteRecord:
        """The record of one choice: tokens ``[T]`` = prompt + completion, experts of MoE layers."""
        info = self.info
        T = len(prompt_token_ids) + len(fin.output_token_ids)
        routes = EngineRoutes(
            fin.routed_experts, fin.routes_row_start, fin.routed_weights, fin.weights_dtype
        )
        return RouteRecord.from_engine(
            routes,
            np.asarray(prompt_token_ids + fin.output_token_ids, dtype=np.int64),
            prompt_len=len(prompt_token_ids),
            num_experts=info.num_experts,
            moe_layers=info.moe_layers,
            num_layers=info.num_layers,
            num_cached_tokens=min(fin.num_cached_tokens, len(prompt_token_ids)),
            model=info.name,
            metadata={"request_id": request_id, "choice": fin.index, "finish": fin.finish_reason},
            weight_versions=row_spans(fin.weight_versions, len(prompt_token_ids), T),
        )

    async def _fill(
        self, store: AsyncRouteStore, route_id: str, record: RouteRecord, deadline: float
    ) -> RouteRecord:
        """Best effort: rows the index cannot supply stay marked invalid, and a failing index
        lookup stores the record as it is rather than failing the route."""
        try:
            async with asyncio.timeout_at(deadline):
                record, filled = await store.fill_from_prefix_index(record)
        except Exception as e:  # the put below decides whether the route is stored
            log.warning(
                "prefix-index fill for route %s failed, storing unfilled: %s", route_id,
                redact(repr(e)),
            )  # fmt: skip
            self.metrics.store_errors.labels(reason="fill_" + type(e).__name__).inc()
            return record
        self.metrics.rows_filled.inc(filled)
        return record

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
        try:
            nbytes = fin.routed_experts.nbytes
            if fin.routed_weights is not None:
                nbytes += fin.routed_weights.nbytes
            if nbytes > self.offload_bytes:
                record = await asyncio.to_thread(self.build, fin, prompt_token_ids, request_id)
            else:
                record = self.build(fin, prompt_token_ids, request_id)
            # One deadline for fill + put, so a capture never takes longer than timeout_s.
            deadline = asyncio.get_running_loop().time() + self.timeout_s
            # The last sampled token never has a route; anything else missing (an engine that
            # returned rows from an offset, or skipped a cached prefix) is filled from the index.
            if not record.valid[:-1].all():
                record = await self._fill(store, route_id, record, deadline)
            async with asyncio.timeout_at(deadline):
                result = await store.put(route_id, record, ttl_s=self.ttl_s)
        except Exception as e:
            if isinstance(e, (RouteError, TimeoutError)):
                # The store's expected failures (Redis down, full, slow): the reason suffices.
                log.warning("storing route %s failed: %s", route_id, redact(repr(e)))
            else:  # a bug: keep the traceback
                log.exception("storing route %s failed unexpectedly", route_id)
            detail = redact(str(e))
            handle.error = f"{type(e).__name__}: {detail}" if detail else type(e).__name__
            self.metrics.store_errors.labels(reason=type(e).__name__).inc()
            return handle
        self.metrics.routes_stored.inc()
        self.metrics.route_bytes.inc(result.bytes_written)
        if self.stats is not None:
            self.stats.observe(record)
        handle.status = "stored"
        handle.num_valid_rows = int(record.valid.sum())
        handle.weight_version = record.weight_version
        handle.weights = fin.routed_weights is not None
        handle.weights_dtype = fin.weights_dtype if handle.weights else None
        handle.weight_versions = [
            WeightSpanOut(version=v, start=a, stop=b) for v, a, b in record.weight_versions
        ] or None
        return handle
