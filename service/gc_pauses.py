"""The garbage collector in the serving process: its start-up heap frozen, and every
collection's pause timed for /metrics.

A collection of the oldest generation walks every object the collector tracks. Once vLLM's
engine client, torch, the tokenizer and the app are loaded, those are millions, and the walk
holds the GIL and the event loop for as long as it takes: no token of any stream, no probe,
no lease renewal moves meanwhile, and a burst of new requests that triggers one sees its first
tokens late together. Nothing loaded at start-up is garbage, so :func:`freeze_startup_heap`
moves it out of the collector's sight (``gc.freeze``, as vLLM's own server does at start), and
a collection then walks only what requests made since. :class:`GcPauses` times each
collection so that a stall of this kind is visible as such.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.metrics_core import Metric

__all__ = ["GcPauses", "freeze_startup_heap"]

log = logging.getLogger("routereplay.service")

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_GENERATIONS = (0, 1, 2)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive now (``gc.freeze``); the number frozen.

    :func:`gc.unfreeze` undoes it: a process that hosts the app and outlives it (a test, a
    framework's own process) calls it at shutdown, as the app's lifespan does."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze the start-up heap: %d objects, %.2f s", frozen, time.perf_counter() - t0)
    return frozen


class GcPauses:
    """A prometheus collector: ``routereplay_gc_pause_seconds{generation}``, the wall time of
    each collection of the process's garbage collector, by the oldest generation it collected.

    The callback runs inside the collector, in whichever thread triggered it, so it takes no
    lock (one held by the interrupted code would deadlock it) and only adds to plain lists: the
    GIL keeps two collections from running at once.
    """

    def __init__(self) -> None:
        self._counts = {g: [0] * (len(_BUCKETS) + 1) for g in _GENERATIONS}
        self._sums = dict.fromkeys(_GENERATIONS, 0.0)
        self._t0 = 0.0

    def start(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        gen = min(int(info.get("generation", 2)), 2)
        self._counts[gen][bisect.bisect_left(_BUCKETS, took)] += 1  # the first bound >= took
        self._sums[gen] += took

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        fam = HistogramMetricFamily(
            "routereplay_gc_pause_seconds",
            "wall time of each garbage collection in the serving process, by the oldest "
            "generation collected: the event loop and every stream wait it out",
            labels=["generation"],
        )
        for gen in _GENERATIONS:
            counts, running, buckets = self._counts[gen], 0, []
            for bound, n in zip((*map(str, _BUCKETS), "+Inf"), counts, strict=True):
                running += n
                buckets.append((bound, running))
            fam.add_metric([str(gen)], buckets, self._sums[gen])
        yield fam
