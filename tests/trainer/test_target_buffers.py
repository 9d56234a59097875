"""TargetBuffers: gather_targets writing into memory recycled from earlier steps, never into
memory that targets still in use refer to."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from test_trainer_alignment import MOE, make_record, naive_truth

from routereplay.trainer_adapter import (
    ReplayConfigError,
    TargetBuffers,
    gather_targets,
    padded_position_map,
    sample_from_record,
    thd_position_map,
)


def thd_step(rng, lens, num_experts=16):
    recs = [make_record(rng, rng.integers(0, 999, n), num_experts=num_experts) for n in lens]
    cu = np.concatenate([[0], np.cumsum(lens)])
    pm = thd_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], cu)
    return pm, recs


def test_a_dropped_step_is_recycled_and_every_byte_rewritten():
    rng = np.random.default_rng(1)
    tb = TargetBuffers()
    pm, recs = thd_step(rng, [40, 25, 33])
    tg = gather_targets(pm, recs, MOE, buffers=tb)
    np.testing.assert_array_equal(tg.experts, naive_truth(pm, recs, MOE))
    addr = tg.experts.ctypes.data
    # Poison it: whatever the next step does not write would show as 0xEE.
    tg.experts[...] = 0xEE
    del tg
    pm, recs = thd_step(rng, [30, 50, 18])  # a smaller step: the buffer is large enough
    tg = gather_targets(pm, recs, MOE, buffers=tb)
    assert tg.experts.ctypes.data == addr
    assert tb.reused == 1 and tb.allocated == 1
    np.testing.assert_array_equal(tg.experts, naive_truth(pm, recs, MOE))


@pytest.mark.parametrize("holder", ["targets", "view", "tensor", "memoryview"])
def test_memory_in_use_is_never_handed_out(holder):
    rng = np.random.default_rng(2)
    tb = TargetBuffers(keep=2)
    pm, recs = thd_step(rng, [20, 30])
    tg = gather_targets(pm, recs, MOE, buffers=tb)
    kept = {
        "targets": tg,
        "view": tg.experts[1:, 3:],
        "tensor": torch.from_numpy(tg.experts),
        "memoryview": memoryview(tg.experts),
    }[holder]
    want = tg.experts.copy()
    addr = tg.experts.ctypes.data
    del tg
    for lens in ([20, 30], [25, 25], [10, 40]):  # same sizes: the kept buffer would fit
        pm, recs = thd_step(rng, lens)
        nxt = gather_targets(pm, recs, MOE, buffers=tb)
        assert nxt.experts.ctypes.data != addr
        np.testing.assert_array_equal(nxt.experts, naive_truth(pm, recs, MOE))
        del nxt
    held = {"targets": lambda k: k.experts, "view": None, "tensor": lambda k: k.numpy(),
            "memoryview": np.asarray}[holder]  # fmt: skip
    if held is None:
        np.testing.assert_array_equal(kept, want[1:, 3:])
    else:
        np.testing.assert_array_equal(held(kept), want)
    # Once it goes, its buffer is free again.
    del kept
    pm, recs = thd_step(rng, [20, 30])
    got = [gather_targets(pm, recs, MOE, buffers=tb) for _ in range(2)]
    assert addr in {g.experts.ctypes.data for g in got}


def test_all_buffers_in_use_means_fresh_memory_and_the_pool_stays_bounded():
    rng = np.random.default_rng(3)
    tb = TargetBuffers(keep=2)
    pm, recs = thd_step(rng, [16, 16])
    held = [gather_targets(pm, recs, MOE, buffers=tb) for _ in range(5)]
    assert len({h.experts.ctypes.data for h in held}) == 5
    assert "held=2" in repr(tb) and tb.allocated == 5 and tb.reused == 0
    truth = naive_truth(pm, recs, MOE)
    for h in held:
        np.testing.assert_array_equal(h.experts, truth)


def test_a_larger_step_grows_a_free_buffer():
    rng = np.random.default_rng(4)
    tb = TargetBuffers(keep=1)
    pm, recs = thd_step(rng, [10, 10])
    tg = gather_targets(pm, recs, MOE, buffers=tb)
    del tg
    pm, recs = thd_step(rng, [60, 70])
    tg = gather_targets(pm, recs, MOE, buffers=tb)
    np.testing.assert_array_equal(tg.experts, naive_truth(pm, recs, MOE))
    addr = tg.experts.ctypes.data
    del tg
    # Grown with room to spare: a slightly larger step reuses it.
    pm, recs = thd_step(rng, [64, 72])
    tg = gather_targets(pm, recs, MOE, buffers=tb)
    assert tg.experts.ctypes.data == addr
    np.testing.assert_array_equal(tg.experts, naive_truth(pm, recs, MOE))
    assert "held=1" in repr(tb)


@pytest.mark.parametrize("num_experts", [16, 300])
def test_padded_batches_and_wide_ids_match_fresh_memory(num_experts):
    """B > 1 reorders a batch-major scratch into the output: both come from the pool."""
    rng = np.random.default_rng(5)
    tb = TargetBuffers()
    for _ in range(4):
        recs = [make_record(rng, rng.integers(0, 999, n), num_experts=num_experts)
                for n in rng.integers(3, 12, 3)]  # fmt: skip
        pm = padded_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], 12)
        got = gather_targets(pm, recs, MOE, buffers=tb)
        want = gather_targets(pm, recs, MOE)
        assert got.experts.dtype == want.experts.dtype
        np.testing.assert_array_equal(got.experts, want.experts)
        np.testing.assert_array_equal(got.valid, want.valid)
        assert got.filler_rows == want.filler_rows
        np.testing.assert_array_equal(
            got.experts, naive_truth(pm, recs, MOE, num_experts=num_experts)
        )
    assert tb.reused > 0


def test_threads_sharing_a_pool_get_their_own_memory():
    rng = np.random.default_rng(6)
    steps = [thd_step(rng, list(rng.integers(5, 40, 4))) for _ in range(6)]
    truths = [naive_truth(pm, recs, MOE) for pm, recs in steps]
    tb = TargetBuffers(keep=3)
    errors: list[str] = []

    def worker(i: int) -> None:
        for _ in range(30):
            pm, recs = steps[i]
            tg = gather_targets(pm, recs, MOE, buffers=tb)
            if not np.array_equal(tg.experts, truths[i]):
                errors.append(f"thread {i}: targets differ")
            del tg

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert tb.reused > 0


def test_bad_arguments_are_named():
    rng = np.random.default_rng(7)
    pm, recs = thd_step(rng, [8])
    with pytest.raises(ReplayConfigError, match="pin_memory=True or buffers, not both"):
        gather_targets(pm, recs, MOE, pin_memory=True, buffers=TargetBuffers())
    with pytest.raises(ReplayConfigError, match="keep must be >= 1"):
        TargetBuffers(keep=0)


def test_a_tracer_reading_frame_locals_changes_nothing():
    """Debuggers read f_locals, which takes references in the frames they look at: the pool's
    decision must not depend on such counts."""
    import sys

    def tracer(frame, event, arg):
        _ = frame.f_locals
        return tracer

    rng = np.random.default_rng(8)
    pm, recs = thd_step(rng, [12, 9])
    tb = TargetBuffers(keep=1)
    sys.settrace(tracer)
    try:
        tg = gather_targets(pm, recs, MOE, buffers=tb)
    finally:
        sys.settrace(None)
    kept, want, addr = tg.experts[2:], tg.experts[2:].copy(), tg.experts.ctypes.data
    del tg
    nxt = gather_targets(pm, recs, MOE, buffers=tb)
    assert nxt.experts.ctypes.data != addr
    np.testing.assert_array_equal(kept, want)
    del kept, nxt
    sys.settrace(tracer)
    try:
        again = gather_targets(pm, recs, MOE, buffers=tb)
    finally:
        sys.settrace(None)
    assert again.experts.ctypes.data == addr


@pytest.mark.parametrize("padded", [False, True])
def test_a_prefetcher_recycles_without_touching_the_step_in_use(padded):
    """The trainer holds step k's targets while the Prefetcher prepares k+1 (and k+2 waits):
    each step's targets must still be its own when it trains, and the pool must recycle."""
    from routereplay.trainer_adapter import Prefetcher

    rng = np.random.default_rng(9)
    steps = []
    for _ in range(12):
        recs = [make_record(rng, rng.integers(0, 999, n)) for n in rng.integers(4, 30, 3)]
        samples = [sample_from_record(i, r) for i, r in enumerate(recs)]
        if padded:
            pm = padded_position_map(samples, 30)
        else:
            cu = np.concatenate([[0], np.cumsum([r.num_tokens for r in recs])])
            pm = thd_position_map(samples, cu)
        steps.append((pm, recs))
    truths = [naive_truth(pm, recs, MOE) for pm, recs in steps]
    tb = TargetBuffers()

    def prepare(k: int):
        pm, recs = steps[k]
        return k, gather_targets(pm, recs, MOE, buffers=tb)

    seen = []
    with Prefetcher(prepare, range(len(steps)), depth=1) as pf:
        for k, tg in pf:
            time.sleep(0.005)  # "training": the next step is prepared meanwhile
            np.testing.assert_array_equal(tg.experts, truths[k])
            seen.append(k)
    assert seen == list(range(len(steps)))
    assert tb.reused >= len(steps) // 2 and "held=" in repr(tb)


@pytest.mark.parametrize("order", ["sequence", "batch"])
def test_page_locked_targets_in_either_order(order, monkeypatch):
    """``pin_memory=True`` gives page-locked targets in both row orders of a B > 1 batch (this
    host has no accelerator to pin for: the allocation is recorded instead)."""
    from routereplay.trainer_adapter import _targets

    pinned: list[torch.Tensor] = []

    def empty(n, dt, pin_memory):
        if not pin_memory:
            return None
        pinned.append(torch.empty(n, dtype=torch.uint8 if dt == np.uint8 else torch.uint16))
        return pinned[-1]

    monkeypatch.setattr(_targets, "_empty", empty)
    rng = np.random.default_rng(8)
    recs = [make_record(rng, rng.integers(0, 999, n)) for n in (5, 9, 7)]
    pm = padded_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], 12)
    tg = gather_targets(pm, recs, MOE, pin_memory=True, order=order)
    want = gather_targets(pm, recs, MOE, order=order)
    np.testing.assert_array_equal(tg.experts, want.experts)
    assert tg.pinned is not None and tg.pinned.data_ptr() == tg.experts.ctypes.data
    assert len(pinned) == 1  # one page-locked buffer: the output, never the scratch
