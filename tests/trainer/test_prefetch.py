"""Prefetcher: order, overlap with the step, back-pressure, errors at the step they belong to."""

from __future__ import annotations

import threading

import pytest

from routereplay.trainer_adapter import Prefetcher


def test_items_come_in_order_and_the_iteration_ends() -> None:
    with Prefetcher(lambda x: x * x, range(6), depth=2) as p:
        assert list(p) == [0, 1, 4, 9, 16, 25]
        with pytest.raises(StopIteration):
            next(p)


def test_the_next_step_is_prepared_while_the_current_one_runs() -> None:
    started = [threading.Event() for _ in range(3)]

    def prepare(i: int) -> int:
        started[i].set()
        return i

    with Prefetcher(prepare, range(3)) as p:
        assert next(p) == 0
        # Step 0 is "running" (we hold it): step 1's preparation starts without our asking.
        assert started[1].wait(10), "step 1 was not prepared during step 0"
        assert next(p) == 1


def test_back_pressure_bounds_the_work_ahead() -> None:
    prepared: list[int] = []
    gate = threading.Event()

    def prepare(i: int) -> int:
        prepared.append(i)
        if len(prepared) >= 3:
            gate.set()
        return i

    p = Prefetcher(prepare, range(100), depth=2)
    try:
        gate.wait(10)
        threading.Event().wait(0.3)  # let an unbounded worker run ahead, if it would
        # depth ready in the queue + one prepared and waiting to be put.
        assert len(prepared) == 3, prepared
        assert next(p) == 0
    finally:
        p.close()
    assert not p._thread.is_alive()


def test_a_preparation_error_surfaces_at_its_step() -> None:
    def prepare(i: int) -> int:
        if i == 2:
            raise KeyError("route r-2 missing")
        return i

    with Prefetcher(prepare, range(5)) as p:
        assert next(p) == 0 and next(p) == 1
        with pytest.raises(KeyError, match="r-2") as ei:
            next(p)
        assert any("step 2" in n for n in ei.value.__notes__)
        with pytest.raises(StopIteration):
            next(p)


def test_a_source_error_surfaces_too() -> None:
    def source():
        yield 1
        raise RuntimeError("data loader broke")

    with Prefetcher(lambda x: x, source()) as p:
        assert next(p) == 1
        with pytest.raises(RuntimeError, match="data loader broke"):
            next(p)


def test_close_stops_a_blocked_worker() -> None:
    p = Prefetcher(lambda x: x, range(10**9), depth=1)
    p.close()  # the worker is blocked on a full queue: close must still return
    assert not p._thread.is_alive()
    with pytest.raises(StopIteration):
        next(p)


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(lambda x: x, [], depth=0)
