"""RouteCapture against a real Redis, without an engine: what a finished choice becomes, built
and stored by route workers (processes, or threads of this process), a worker killed while it
holds a route, a deadline passed before the manifest, and a shutdown that drains the routes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis

from routereplay.client import AsyncRouteStore
from routereplay.service.capture import RouteCapture
from routereplay.service.engine import ChoiceFinished
from routereplay.service.metrics import ServiceMetrics
from routereplay.service.model_info import ModelInfo
from routereplay.service.route_workers import RouteWorkers

INFO = ModelInfo(
    name="m", num_layers=3, moe_layers=(1, 2), num_experts=8, top_k=2, max_model_len=64
)


def _finished(prompt: list[int], out: list[int], row_start: int = 0) -> ChoiceFinished:
    T = len(prompt) + len(out)
    rng = np.random.default_rng(len(prompt))
    arr = np.zeros((T - 1 - row_start, 3, 2), np.uint8)
    arr[:, 1:] = np.argsort(rng.random((T - 1 - row_start, 2, 8)), axis=-1)[..., :2]
    return ChoiceFinished(
        index=0, finish_reason="length", stop_reason=None, output_token_ids=out,
        num_cached_tokens=row_start, routed_experts=arr, routes_row_start=row_start,
    )  # fmt: skip


@pytest.fixture(params=[1, 0], ids=["processes", "threads"])
async def workers(request: pytest.FixtureRequest) -> AsyncIterator[RouteWorkers]:
    w = RouteWorkers(request.param)
    await asyncio.to_thread(w.start)
    yield w
    await w.aclose()


async def test_corrupt_prefix_index_is_best_effort(
    closing, redis_url: str, workers: RouteWorkers
) -> None:
    prefix = f"cap{uuid.uuid4().hex[:6]}"
    async with AsyncRouteStore.from_url(redis_url, prefix=prefix, block_size=4) as store:
        cap = RouteCapture(INFO, ServiceMetrics(), workers=workers, timeout_s=10)
        prompt = list(range(100, 112))
        first = await cap.capture(store, "a-0", _finished(prompt, [1, 2]), prompt, "a")
        assert first.status == "stored"
        # Corrupt every chunk the index points at; a later request that skipped the cached
        # prefix (rows from 8 on) must still be stored, with the unfillable rows invalid.
        raw = closing(redis.Redis.from_url(redis_url))
        for key in raw.scan_iter(f"{prefix}:c:*"):
            raw.set(key, b"RRTE garbage", keepttl=True)
        second = await cap.capture(
            store, "b-0", _finished(prompt, [3, 4, 5], row_start=8), prompt, "b"
        )
        assert second.status == "stored", second
        rec = await store.get("b-0")
        assert not rec.valid[:8].any() and rec.valid[8:-1].all()
        assert second.num_valid_rows == int(rec.valid.sum())


async def test_unreachable_store_reports_failed_handle(workers: RouteWorkers) -> None:
    store = AsyncRouteStore.from_url(
        "redis://127.0.0.1:1/0", socket_connect_timeout=0.5, retry=None
    )
    # A deadline far beyond the refused connection: the error must be the connection's.
    cap = RouteCapture(INFO, ServiceMetrics(), workers=workers, timeout_s=120)
    prompt = [5, 6, 7]
    handle = await cap.capture(store, "c-0", _finished(prompt, [8]), prompt, "c")
    assert handle.status == "failed"
    assert "RouteConnectionError" in (handle.error or "")
    await store.close()


async def test_a_put_past_its_deadline_writes_no_manifest(
    closing, redis_url: str, workers: RouteWorkers
) -> None:
    prefix = f"late{uuid.uuid4().hex[:6]}"
    async with AsyncRouteStore.from_url(redis_url, prefix=prefix) as store:
        cap = RouteCapture(INFO, ServiceMetrics(), workers=workers, timeout_s=1e-6)
        prompt = list(range(40))
        handle = await cap.capture(store, "l-0", _finished(prompt, [1, 2]), prompt, "l")
        assert handle.status == "failed" and "TimeoutError" in (handle.error or ""), handle
        assert not await store.exists("l-0")
    assert not list(closing(redis.Redis.from_url(redis_url)).scan_iter(f"{prefix}:*"))


async def test_start_starts_every_worker_process(redis_url: str) -> None:
    """Each of the N workers is a process of its own once start returns (the pool starts a
    process only while none is idle, so a quick start task could leave most of them for the
    first routes to start)."""
    workers = RouteWorkers(3)
    try:
        pids = await asyncio.to_thread(workers.start)
        assert len(pids) == 3 and all(os.path.exists(f"/proc/{p}") for p in pids)
        assert sorted(p.pid for p in workers._pool._processes.values()) == pids
    finally:
        await workers.aclose()


async def test_a_killed_worker_fails_its_route_and_is_replaced(redis_url: str) -> None:
    workers = RouteWorkers(1)
    (pid,) = await asyncio.to_thread(workers.start)
    # A server that accepts and never answers: the worker waits inside its job.
    mute = socket.create_server(("127.0.0.1", 0))
    port = mute.getsockname()[1]
    metrics = ServiceMetrics()
    cap = RouteCapture(INFO, metrics, workers=workers, timeout_s=60)
    prompt = [1, 2, 3]
    try:
        async with AsyncRouteStore.from_url(f"redis://127.0.0.1:{port}/0", retry=None) as hung:
            held = asyncio.create_task(
                cap.capture(hung, "k-0", _finished(prompt, [4]), prompt, "k")
            )
            conn, _ = await asyncio.to_thread(mute.accept)  # the worker is in its job now
            os.kill(pid, signal.SIGKILL)
            handle = await asyncio.wait_for(held, 30)
            conn.close()
        assert handle.status == "failed", handle
        assert "RouteWorkerError: the route worker exited" in (handle.error or ""), handle
        assert workers.replaced == 1 and cap.pending == 0
        # The next route goes to a new worker and is stored.
        async with AsyncRouteStore.from_url(redis_url, prefix=f"k{uuid.uuid4().hex[:6]}") as st:
            again = await cap.capture(st, "k-1", _finished(prompt, [5]), prompt, "k")
            assert again.status == "stored", again
            assert (await st.get("k-1")).token_ids.tolist() == [1, 2, 3, 5]
    finally:
        mute.close()
        await workers.aclose()
    reasons = {s.labels["reason"] for s in metrics.store_errors.collect()[0].samples}
    assert "RouteWorkerError" in reasons


async def test_shutdown_waits_for_the_routes_in_flight(redis_url: str) -> None:
    workers = RouteWorkers(1)
    await asyncio.to_thread(workers.start)
    cap = RouteCapture(INFO, ServiceMetrics(), workers=workers, timeout_s=60)
    async with AsyncRouteStore.from_url(redis_url, prefix=f"d{uuid.uuid4().hex[:6]}") as store:
        prompts = [list(range(i, i + 60)) for i in range(16)]
        tasks = [
            asyncio.create_task(cap.capture(store, f"d-{i}", _finished(p, [7] * 3), p, "d"))
            for i, p in enumerate(prompts)
        ]
        await asyncio.sleep(0)  # every capture has handed its job over
        await workers.aclose()
        handles = await asyncio.gather(*tasks)
        assert [h.status for h in handles] == ["stored"] * 16, [h.error for h in handles]
        records = await store.get_many([f"d-{i}" for i in range(16)])
        assert [r.token_ids.tolist() for r in records] == [p + [7] * 3 for p in prompts]
        late = await cap.capture(store, "d-late", _finished(prompts[0], [1]), prompts[0], "d")
        assert late.status == "failed" and "shut down" in (late.error or ""), late


async def test_a_job_no_worker_can_take_is_a_failed_route(redis_url: str) -> None:
    # A store opened with a setting that cannot be pickled (a function) cannot be sent to a
    # worker process: the route fails with the reason, the capture does not raise.
    workers = RouteWorkers(1)
    await asyncio.to_thread(workers.start)
    cap = RouteCapture(INFO, ServiceMetrics(), workers=workers, timeout_s=30)
    store = AsyncRouteStore.from_url(redis_url, prefix="u", redis_connect_func=lambda c: None)
    prompt = [1, 2, 3]
    try:
        handle = await cap.capture(store, "u-0", _finished(prompt, [4]), prompt, "u")
    finally:
        await workers.aclose()
        await store.close()
    assert handle.status == "failed" and "pickle" in (handle.error or "").lower(), handle
