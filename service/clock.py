"""The clock of the service's own timers: request-id lease renewal and the dead-engine watcher.

Both read time and sleep through a :class:`Clock` that ``create_app`` takes (by default the
system's monotonic clock and ``asyncio.sleep``), so whoever drives the service can step their
time instead of waiting it out: a test moves a lease or a grace period forward at once, and
checks what happens at each step without racing real time. Deadlines of I/O (a Redis write,
an upstream call, a readiness check) stay on the event loop's clock: they bound real waits.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["Clock", "SystemClock"]


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock."""
        ...


class SystemClock:
    """Real time: ``time.monotonic`` and ``asyncio.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
