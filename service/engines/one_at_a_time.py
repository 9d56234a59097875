"""The order of the RL calls that change an engine's state: one at a time, each to its end."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["OneAtATime"]

log = logging.getLogger("routereplay.service")

T = TypeVar("T")


class OneAtATime:
    """Runs the RL calls that change the engine's state one at a time, each to its end once it
    has started, in the order they arrive (asyncio's lock is fair).

    The lock is held by the task that does the work, never by its caller: a caller that is
    cancelled (its client hung up) leaves a started call running, and the lock held, until the
    call (a load, or the restore after it) ends; otherwise a second load, or a resume, could
    run on an engine still loading (or half loaded). A caller cancelled while still waiting for
    the lock drops its call: nobody would learn its outcome."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._orphans: set[asyncio.Task[Any]] = set()  # calls whose caller went away
        self.running: dict[str, Any] | None = None  # what holds the lock now

    async def run(self, what: dict[str, Any], work: Callable[[], Awaitable[T]]) -> T:
        started = asyncio.Event()

        async def locked() -> T:
            async with self._lock:
                started.set()
                self.running = {**what, "started_at": time.time()}
                try:
                    return await work()
                finally:
                    self.running = None

        task = asyncio.ensure_future(locked())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not started.is_set():
                task.cancel()  # the lock is released by its own acquire when cancelled
            else:
                self._orphans.add(task)  # the loop keeps only weak references to tasks
                task.add_done_callback(self._orphan_done)
            raise

    def _orphan_done(self, task: asyncio.Task[Any]) -> None:
        self._orphans.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("an RL call whose caller went away failed: %s", task.exception())
