"""A stall of the event loop is logged once, with the stack of the code that holds the loop,
and counted. The host's own load can stall a test's loop too (a 2-core machine running the suite
in parallel): such a stall is logged with the loop waiting in its selector, so each test looks
for the stall it made."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from routereplay.service.loop_stalls import StallWatch
from routereplay.service.metrics import LOOP_LAG_INTERVAL_S, ServiceMetrics


def hold_the_loop_sleeping(seconds: float) -> None:
    time.sleep(seconds)  # releases the GIL: the watch samples during the stall


def hold_the_loop_spinning(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # pure Python: the GIL switches to the watch every 5 ms
        pass


async def _stalls(hold, seconds: float) -> float:
    """The stalls counted while a loop beats, is held by ``hold``, and beats again."""
    metrics = ServiceMetrics()
    watch = StallWatch(0.1, LOOP_LAG_INTERVAL_S, metrics.loop_stalls)
    watch.start()
    lag = asyncio.create_task(metrics.watch_loop_lag(watch.beat))
    try:
        await asyncio.sleep(0.3)  # beating: no stall yet
        watch.beat()  # a stall of the host's just before is not taken for this one
        hold(seconds)
        await asyncio.sleep(0.3)
    finally:
        lag.cancel()
        watch.stop()
    return metrics.loop_stalls._value.get()


@pytest.mark.parametrize("hold", [hold_the_loop_sleeping, hold_the_loop_spinning])
async def test_a_stall_is_logged_once_with_the_holders_stack(hold, caplog) -> None:
    caplog.set_level(logging.WARNING, "routereplay.service")
    stalls = await _stalls(hold, 1.0)
    logged = [r.getMessage() for r in caplog.records if "event loop stalled" in r.getMessage()]
    lines = [m for m in logged if hold.__name__ in m]
    assert len(lines) == 1 and stalls == len(logged), logged
    assert "test_loop_stalls.py" in lines[0]
    assert float(lines[0].split("stalled for ")[1].split(" ms")[0]) >= 100


def test_two_stalls_are_two_lines() -> None:
    """Each stall once: a second stall after the loop beat again is logged again."""
    counter = Counter("s", "s", registry=CollectorRegistry())
    watch = StallWatch(0.05, 0.01, counter)
    watch.start()
    try:
        for _ in range(2):
            time.sleep(0.2)  # no beat: a stall of this thread's "loop"
            watch.beat()
    finally:
        watch.stop()
    assert counter._value.get() == 2
