"""Expert-load telemetry of the stored routes: per MoE layer and weight version, over a sliding
window, the load imbalance, the routing entropy and the share of experts no token chose.

A Prometheus collector with bounded cardinality: ``layers x versions x 3`` gauge series (the
``--routing-stats-versions`` most recently seen weight versions), plus, only with
``--expert-metrics`` and at most :data:`MAX_EXPERTS_PER_EXPERT_METRICS` experts, a per-expert
token counter (``layers x experts`` series). The capture path only hands a stored record to
:meth:`RoutingStats.observe`, which queues it (O(1)); a worker thread counts it. When the queue
is full, the record is skipped and counted in ``routereplay_routing_stats_skipped_total``: the
figures are a sample then, never a slower request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from routereplay.client import UNKNOWN_VERSION, RouteRecord, expert_counts, load_figures

__all__ = [
    "MAX_EXPERTS_PER_EXPERT_METRICS",
    "UNKNOWN_VERSION",
    "RoutingStats",
    "expert_counts",
    "load_figures",
]

log = logging.getLogger("routereplay.service")

MAX_EXPERTS_PER_EXPERT_METRICS = 64
_BUCKETS = 12  # the window moves in steps of window_s / _BUCKETS


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
        versions: how many weight versions keep their series (the most recently seen).
        per_expert: also export ``routereplay_expert_tokens_total{layer, expert}``; refused above
            :data:`MAX_EXPERTS_PER_EXPERT_METRICS` experts.
        queue_size: records waiting to be counted; past it a record is skipped.
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
        queue_size: int = 1024,
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
        self.clock = clock
        self._lock = threading.Lock()
        self._windows: OrderedDict[str, _Window] = OrderedDict()  # least recently seen first
        self._expert_totals = np.zeros((len(self.layers), self.E), np.int64) if per_expert else None
        self.skipped = 0
        self._queue: queue.Queue[RouteRecord | None] = queue.Queue(queue_size)
        self._thread: threading.Thread | None = None  # started by the first observe

    # -- capture side ----------------------------------------------------------------------
    def observe(self, record: RouteRecord) -> None:
        """Queue a stored record to be counted; never blocks."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="routing-stats", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.skipped += 1

    def close(self) -> None:
        """Count what is queued, then stop the worker."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                self.count(record)
            except Exception:  # a record of another shape: telemetry must not stop serving
                log.exception("routing stats: counting a record failed")

    def count(self, record: RouteRecord) -> None:
        """Add ``record``'s valid rows to its weight versions' windows (each span its own)."""
        bucket = self._bucket(self.clock())
        for version, counts, tokens in expert_counts(record):
            if tokens == 0:
                continue
            with self._lock:
                self._window(version).add(bucket, counts)
                if self._expert_totals is not None:
                    self._expert_totals += counts

    def _bucket(self, t: float) -> int:
        return int(t // (self.window_s / _BUCKETS))

    def _window(self, version: str) -> _Window:
        w = self._windows.pop(version, None) or _Window((len(self.layers), self.E))
        self._windows[version] = w  # most recently seen last
        while len(self._windows) > self.versions:
            self._windows.popitem(last=False)
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
            "stored records the routing statistics skipped (their queue was full)",
        )
        skipped.add_metric([], self.skipped)
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
