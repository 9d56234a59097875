"""Expert-load telemetry of the stored routes: per MoE layer and weight version, over a sliding
window, the load imbalance, the routing entropy and the share of experts no token chose.

A Prometheus collector with bounded cardinality: ``layers x versions x 3`` gauge series (the
``--routing-stats-versions`` newest weight versions, by first appearance), plus, only with
``--expert-metrics`` and at most :data:`MAX_EXPERTS_PER_EXPERT_METRICS` experts, a per-expert
token counter (``layers x experts`` series). A stored record is counted where it was built (a
route worker: :func:`version_counts`), and the serving process only adds the ``[M, E]`` counts
of each weight span to its windows (:meth:`RoutingStats.add`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

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
    "MAX_EXPERTS_PER_EXPERT_METRICS",
    "UNKNOWN_VERSION",
    "RoutingStats",
    "VersionCounts",
    "expert_counts",
    "load_figures",
    "version_counts",
]

MAX_EXPERTS_PER_EXPERT_METRICS = 64
_BUCKETS = 12  # the window moves in steps of window_s / _BUCKETS
# Versions pushed out of the kept ones, remembered so that a late record of one is recognised as
# old; a version never seen (or forgotten past this many) counts as the newest.
_RETIRED_REMEMBERED = 1024

# A record's expert counts ``[M, E]`` per weight span, in row order.
VersionCounts = list[tuple[str, np.ndarray]]


def version_counts(record: RouteRecord) -> VersionCounts:
    """The expert counts of ``record``'s valid rows, one ``[M, E]`` array per weight span
    (spans of one version stay apart: the windows add them). Counts in blocks, so a long
    record is never copied whole as int64."""
    spans = record.weight_versions or [(UNKNOWN_VERSION, 0, record.num_tokens)]
    out = []
    for version, start, stop in spans:
        valid = record.valid[start:stop]
        if valid.any():
            counts = layer_counts(record.experts[start:stop], valid, record.num_experts)
            out.append((str(version or UNKNOWN_VERSION), counts))
    return out


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
        self._windows: OrderedDict[str, _Window] = OrderedDict()  # by first appearance
        self._retired: OrderedDict[str, None] = OrderedDict()  # pushed out, oldest first
        self._expert_totals = np.zeros((len(self.layers), self.E), np.int64) if per_expert else None
        self.skipped_retired = 0  # records with rows of a version pushed out already

    def count(self, record: RouteRecord) -> None:
        """Add ``record``'s valid rows to its weight versions' windows (each span its own)."""
        self.add(version_counts(record))

    def add(self, counts: VersionCounts) -> None:
        """Add a stored record's :func:`version_counts` to its versions' windows; rows of a
        version pushed out already are left uncounted (and the record counted as skipped)."""
        shape = (len(self.layers), self.E)
        for _, c in counts:
            if c.shape != shape:  # checked before any is added: a record counts whole or not
                raise ValueError(f"counts of shape {c.shape}, not {shape}")
        bucket = self._bucket(self.clock())
        retired = False
        with self._lock:
            for version, c in counts:
                window = self._window(version)
                if window is None:
                    retired = True
                    continue
                window.add(bucket, c)
                if self._expert_totals is not None:
                    self._expert_totals += c
            self.skipped_retired += retired

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
            "stored records the routing statistics left uncounted, in whole or in part: rows "
            "of a weight version older than the kept ones",
            labels=["reason"],
        )
        skipped.add_metric(["retired_version"], self.skipped_retired)
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
