"""Which code holds the event loop when it stalls.

``routereplay_event_loop_lag_seconds`` says that the loop ran late, not what ran instead, and a
profiler's samples of a whole level hide one stall of a few hundred milliseconds among
thousands. :class:`StallWatch` is a thread that looks at the loop's thread while the stall is
going on: the loop beats each time its lag timer fires (every ``LOOP_LAG_INTERVAL_S``), and once
a beat is ``threshold_s`` overdue the watch logs the loop thread's Python stack, once per stall,
and counts the stall. Only another thread can do this: a stalled loop runs nothing of its own.

A stall in C code that holds the GIL (a long ``json.dumps``, a numpy call) keeps this thread
out too; it then samples only once the GIL comes back, when the loop may have moved on, and its
log line says so. Its cost is one wake-up every ``threshold_s / 2``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

from prometheus_client import Counter

__all__ = ["StallWatch"]

log = logging.getLogger("routereplay.service")

_FRAMES = 30  # the innermost frames of the loop thread's stack that a log line shows


class StallWatch:
    """Logs the loop thread's stack once per stall of at least ``threshold_s``."""

    def __init__(self, threshold_s: float, interval_s: float, stalls: Counter) -> None:
        self.threshold_s = threshold_s
        self.interval_s = interval_s  # how often the loop beats when it is not stalled
        self.stalls = stalls
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """The loop ran its lag timer: called on the loop's thread."""
        self._beat = time.monotonic()

    def start(self) -> None:
        """Watch the calling thread's loop (call it on the loop's thread)."""
        loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._watch, args=(loop_thread,), name="routereplay-stall-watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _watch(self, loop_thread: int) -> None:
        period = self.threshold_s / 2
        reported = None  # the beat of the stall already logged
        due = time.monotonic() + period
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            now = time.monotonic()
            # This thread woke late by more than a period: the GIL (or the host) held it too.
            held_here = now - due > period
            due = now + period
            beat = self._beat
            late = now - beat - self.interval_s
            if late < self.threshold_s or beat == reported:
                continue
            reported = beat
            self.stalls.inc()
            self._log(loop_thread, late, held_here)

    def _log(self, loop_thread: int, late: float, held_here: bool) -> None:
        frame = sys._current_frames().get(loop_thread)
        stack = "".join(traceback.format_stack(frame)[-_FRAMES:]) if frame is not None else ""
        note = (
            " (sampled once the GIL came back: C code may have held it, and the loop may have"
            " moved on)"
            if held_here
            else ""
        )
        log.warning(
            "event loop stalled for %.0f ms so far%s; its thread is in:\n%s",
            late * 1e3, note, stack.rstrip(),
        )  # fmt: skip
