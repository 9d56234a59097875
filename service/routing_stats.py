"""Expert-load telemetry of the stored routes: per MoE layer and weight version, over a sliding
window, the load imbalance, the routing entropy and the share of experts no token chose.

A Prometheus collector with bounded cardinality: ``layers x versions x 3`` gauge series (the
``--routing-stats-versions`` newest weight versions, by first appearance), plus, only with
``--expert-metrics`` and at most :data:`MAX_EXPERTS_PER_EXPERT_METRICS` experts, a per-expert
token counter (``layers x experts`` series). The capture path only hands a stored record to
:meth:`RoutingStats.observe`, which queues its expert ids, valid rows and weight spans (O(1), no
copy); a worker thread counts them. The queue is bounded by the bytes it keeps alive: past
``max_queued_bytes`` a record is skipped and counted in
``routereplay_routing_stats_skipped_total{reason="queue_full"}``: the figures are a sample then,
never a slower request or a growing heap.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from routereplay.client import (
    UNKNOWN_VERSION,
    RouteRecord,
    expert_counts,
    layer_counts,
    load_figures,
)

__all__ = [
    "DEFAULT_MAX_QUEUED_BYTES",
    "MAX_EXPERTS_PER_EXPERT_METRICS",
    "UNKNOWN_VERSION",
    "RoutingStats",
    "expert_counts",
    "load_figures",
]

log = logging.getLogger("routereplay.service")

MAX_EXPERTS_PER_EXPERT_METRICS = 64
DEFAULT_MAX_QUEUED_BYTES = 64 << 20
_BUCKETS = 12  # the window moves in steps of window_s / _BUCKETS
# Charged per queued record on top of its arrays (the tuple, two array headers, the spans), so
# a flood of tiny records is bounded too.
_ITEM_BYTES = 512
# Versions pushed out of the kept ones, remembered so that a late record of one is recognised as
# old; a version never seen (or forgotten past this many) counts as the newest.
_RETIRED_REMEMBERED = 1024
_CLOSE_TIMEOUT_S = 5.0


def _held_nbytes(a: np.ndarray) -> int:
    """The bytes a reference to ``a`` keeps alive: a view holds its whole base array."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.nbytes


class _Routes(NamedTuple):
    """What counting needs of a stored record and nothing more: the stored expert ids
    ``[T, M, K]`` (uint8/uint16, not copied), the valid rows ``[T]`` bool and the weight spans."""

    experts: np.ndarray
    valid: np.ndarray
    spans: tuple[tuple[str, int, int], ...]
    nbytes: int  # what the queue keeps alive for it

    @classmethod
    def of(cls, record: RouteRecord) -> _Routes:
        spans = record.weight_versions or [(None, 0, record.num_tokens)]
        return cls(
            record.experts,
            record.valid,
            tuple((str(v or UNKNOWN_VERSION), int(a), int(b)) for v, a, b in spans),
            _held_nbytes(record.experts) + _held_nbytes(record.valid) + _ITEM_BYTES,
        )


class _Window:
    """Expert counts ``[M, E]`` of one weight version in time buckets."""

    def __init__(self, shape: tuple[int, int]) -> None:
        self.buckets: OrderedDict[int, np.ndarray] = OrderedDict()
        self.shape = shape

    def add(self, bucket: int, counts: np.ndarray) -> None:
        acc = self.buckets.get(bucket)
        if acc is None:
            self.buckets[bucket] = counts.copy()
        else:
            acc += counts

    def total(self, first: int) -> np.ndarray:
        for b in [b for b in self.buckets if b < first]:
            del self.buckets[b]
        out = np.zeros(self.shape, np.int64)
        for counts in self.buckets.values():
            out += counts
        return out


class RoutingStats:
    """Sliding-window expert load of the routes the service stores (a Prometheus collector).

    Args:
        moe_layers: global 0-based MoE layer indices (the ``layer`` label).
        num_experts: routed experts per MoE layer.
        top_k: experts per token.
        window_s: the sliding window's length.
        versions: how many weight versions keep their series: the newest by first appearance.
            Rows of a version pushed out already (a late record) are left uncounted.
        per_expert: also export ``routereplay_expert_tokens_total{layer, expert}``; refused above
            :data:`MAX_EXPERTS_PER_EXPERT_METRICS` experts.
        max_queued_bytes: what the records waiting to be counted may keep alive (their expert
            ids and valid rows); past it a record is skipped. A record larger than this alone is
            queued only when the queue is empty.
    """

    def __init__(
        self,
        moe_layers: Sequence[int],
        num_experts: int,
        top_k: int,
        *,
        window_s: float = 60.0,
        versions: int = 2,
        per_expert: bool = False,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_expert and num_experts > MAX_EXPERTS_PER_EXPERT_METRICS:
            raise ValueError(
                f"--expert-metrics exports a series per (layer, expert): the model has "
                f"{num_experts} experts, more than {MAX_EXPERTS_PER_EXPERT_METRICS}"
            )
        self.layers = [str(x) for x in moe_layers]
        self.E = int(num_experts)
        self.top_k = int(top_k)
        self.window_s = float(window_s)
        self.versions = int(versions)
        self.max_queued_bytes = int(max_queued_bytes)
        self.clock = clock
        self._lock = threading.Lock()
        self._windows: OrderedDict[str, _Window] = OrderedDict()  # by first appearance
        self._retired: OrderedDict[str, None] = OrderedDict()  # pushed out, oldest first
        self._expert_totals = np.zeros((len(self.layers), self.E), np.int64) if per_expert else None
        self.skipped = 0  # records: the queue was full
        self.skipped_retired = 0  # records with rows of a version pushed out already
        self._queue: queue.SimpleQueue[_Routes | None] = queue.SimpleQueue()
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self._thread: threading.Thread | None = None  # started by the first observe
        self._closed = False
        self.skipped_closed = 0  # records stored after close(): nothing counts them any more

    # -- capture side ----------------------------------------------------------------------
    @property
    def queued_bytes(self) -> int:
        """Bytes the records waiting to be counted (or being counted) keep alive."""
        return self._queued_bytes

    def observe(self, record: RouteRecord) -> None:
        """Queue a stored record's expert ids, valid rows and spans to be counted; never
        blocks, never copies the arrays. After :meth:`close` a record is only counted as
        skipped: a late store must not start a worker nobody will stop."""
        if self._closed:
            self.skipped_closed += 1
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="routing-stats", daemon=True)
            self._thread.start()
        routes = _Routes.of(record)
        with self._bytes_lock:
            if self._queued_bytes and self._queued_bytes + routes.nbytes > self.max_queued_bytes:
                self.skipped += 1
                return
            self._queued_bytes += routes.nbytes
        self._queue.put(routes)

    def close(self) -> None:
        """Count what is queued, then stop the worker; waits up to 5 s for it (from a
        coroutine, await :meth:`aclose` instead)."""
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=_CLOSE_TIMEOUT_S)

    async def aclose(self) -> None:
        """:meth:`close` in a worker thread: the event loop keeps serving while the queue
        drains."""
        await asyncio.to_thread(self.close)

    def _run(self) -> None:
        while True:
            routes = self._queue.get()
            if routes is None:
                return
            try:
                self._count(routes)
            except Exception:  # a record of another shape: telemetry must not stop serving
                log.exception("routing stats: counting a record failed")
            finally:
                with self._bytes_lock:
                    self._queued_bytes -= routes.nbytes
            del routes  # not kept alive while waiting for the next one

    def count(self, record: RouteRecord) -> None:
        """Add ``record``'s valid rows to its weight versions' windows (each span its own)."""
        self._count(_Routes.of(record))

    def _count(self, routes: _Routes) -> None:
        bucket = self._bucket(self.clock())
        retired = False
        for version, start, stop in routes.spans:
            valid = routes.valid[start:stop]
            if not valid.any():
                continue
            with self._lock:
                window = self._window(version)
            if window is None:
                retired = True
                continue
            counts = layer_counts(routes.experts[start:stop], valid, self.E)
            with self._lock:
                window.add(bucket, counts)
                if self._expert_totals is not None:
                    self._expert_totals += counts
        if retired:
            self.skipped_retired += 1

    def _bucket(self, t: float) -> int:
        return int(t // (self.window_s / _BUCKETS))

    def _window(self, version: str) -> _Window | None:
        """The window of ``version``; a version seen for the first time is the newest and
        pushes out the oldest kept one. None: ``version`` was pushed out already (its late
        rows must not push out a newer version, the live one among them)."""
        w = self._windows.get(version)
        if w is not None or version in self._retired:
            return w
        w = self._windows[version] = _Window((len(self.layers), self.E))
        while len(self._windows) > self.versions:
            self._retired[self._windows.popitem(last=False)[0]] = None
        while len(self._retired) > _RETIRED_REMEMBERED:
            self._retired.popitem(last=False)
        return w

    # -- scrape side -------------------------------------------------------------------------
    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        first = self._bucket(self.clock()) - _BUCKETS + 1
        with self._lock:
            totals = {v: w.total(first) for v, w in self._windows.items()}
            experts = None if self._expert_totals is None else self._expert_totals.copy()
        families = [
            GaugeMetricFamily(
                "routereplay_expert_load_imbalance",
                f"max / mean tokens per expert over the last {self.window_s:g} s (1: balanced)",
                labels=["layer", "weight_version"],
            ),
            GaugeMetricFamily(
                "routereplay_routing_entropy",
                f"entropy of the expert load over the last {self.window_s:g} s / log(experts) "
                "(1: uniform, 0: one expert)",
                labels=["layer", "weight_version"],
            ),
            GaugeMetricFamily(
                "routereplay_unused_experts_ratio",
                f"share of experts no token chose over the last {self.window_s:g} s",
                labels=["layer", "weight_version"],
            ),
        ]
        tokens = GaugeMetricFamily(
            "routereplay_routed_tokens_window",
            f"routed tokens counted over the last {self.window_s:g} s",
            labels=["weight_version"],
        )
        for version, counts in totals.items():
            # Each routed token adds top_k to every layer's row.
            tokens.add_metric([version], float(counts[0].sum() / self.top_k))
            for fam, values in zip(families, load_figures(counts), strict=True):
                for layer, v in zip(self.layers, values, strict=True):
                    if not np.isnan(v):
                        fam.add_metric([layer, version], float(v))
        yield from families
        yield tokens
        skipped = CounterMetricFamily(
            "routereplay_routing_stats_skipped",
            "stored records the routing statistics left uncounted, in whole or in part: their "
            "queue was full, rows of a weight version older than the kept ones, or the "
            "statistics were closed (shutdown)",
            labels=["reason"],
        )
        skipped.add_metric(["queue_full"], self.skipped)
        skipped.add_metric(["retired_version"], self.skipped_retired)
        skipped.add_metric(["closed"], self.skipped_closed)
        yield skipped
        if experts is not None:
            fam = CounterMetricFamily(
                "routereplay_expert_tokens",
                "tokens routed to each expert",
                labels=["layer", "expert"],
            )
            for i, layer in enumerate(self.layers):
                for e in range(self.E):
                    fam.add_metric([layer, str(e)], float(experts[i, e]))
            yield fam
