"""Expert-load telemetry (service/routing_stats.py): the figures per MoE layer and weight
version over a sliding window, bounded series, the per-expert counter's limit, a queue that holds
only the expert ids and spans and is bounded by bytes (skipping records, never blocking), counting
in blocks, the newest versions kept by first appearance, a shutdown that leaves the event loop
serving, and the metrics on a running app's /metrics."""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import time
import tracemalloc
import weakref

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from routereplay.client import RouteRecord, expert_counts
from routereplay.service import routing_stats
from routereplay.service.routing_stats import RoutingStats, load_figures

from .conftest import MODEL, running_app, until

LAYERS = (1, 2)
E, K = 8, 2


def _record(experts_per_token: list[list[list[int]]], spans=None) -> RouteRecord:
    ex = np.asarray(experts_per_token, np.uint8)  # [T, M, K]
    T = ex.shape[0]
    return RouteRecord(np.arange(T) + 3, ex, np.ones(T, bool), LAYERS, 3, E,
                       weight_versions=spans or [])  # fmt: skip


def _values(stats: RoutingStats) -> dict[tuple, float]:
    out = {}
    for fam in stats.collect():
        for s in fam.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def test_load_figures() -> None:
    balanced = np.full((1, E), 4)
    one = np.zeros((1, E))
    one[0, 3] = 10
    imb, ent, unused = load_figures(np.vstack([balanced, one, np.zeros((1, E))]))
    assert imb[0] == 1.0 and ent[0] == pytest.approx(1.0) and unused[0] == 0.0
    assert imb[1] == E and ent[1] == 0.0 and unused[1] == (E - 1) / E
    assert all(math.isnan(a[2]) for a in (imb, ent, unused))  # no tokens: no figure


def test_window_versions_and_layers() -> None:
    now = [1000.0]
    stats = RoutingStats(LAYERS, E, K, window_s=60, versions=2, clock=lambda: now[0])
    # Layer 1 always picks experts 0, 1; layer 2 spreads over all eight.
    tokens = [[[0, 1], [2 * (t % 4), 2 * (t % 4) + 1]] for t in range(8)]
    stats.count(_record(tokens, [("v1", 0, 4), ("v2", 4, 8)]))
    v = _values(stats)
    key = ("routereplay_expert_load_imbalance", ("layer", "1"), ("weight_version", "v1"))
    assert v[key] == E / 2  # 8 selections on 2 experts: max 4 against a mean of 1
    key = ("routereplay_unused_experts_ratio", ("layer", "2"), ("weight_version", "v2"))
    assert v[key] == 0.0
    key = ("routereplay_routing_entropy", ("layer", "2"), ("weight_version", "v2"))
    assert v[key] == pytest.approx(1.0)
    assert v[("routereplay_routed_tokens_window", ("weight_version", "v1"))] == 4
    # A third version pushes out the least recently seen one: series stay bounded.
    stats.count(_record(tokens[:2], [("v3", 0, 2)]))
    versions = {dict(k[1:]).get("weight_version") for k in _values(stats)} - {None}
    assert versions == {"v2", "v3"}
    # Past the window, the counts leave it.
    now[0] += 61
    assert not any(k[0] == "routereplay_expert_load_imbalance" for k in _values(stats))


def test_per_expert_counter_and_its_limit() -> None:
    stats = RoutingStats(LAYERS, E, K, per_expert=True)
    stats.count(_record([[[0, 1], [0, 7]]] * 3))
    v = _values(stats)
    assert v[("routereplay_expert_tokens_total", ("expert", "7"), ("layer", "2"))] == 3
    assert v[("routereplay_expert_tokens_total", ("expert", "5"), ("layer", "1"))] == 0
    with pytest.raises(ValueError, match="128 experts, more than 64"):
        RoutingStats(LAYERS, 128, K, per_expert=True)


def _big_record(T: int, M: int, K: int, spans=None) -> RouteRecord:
    """A record of ``T`` tokens over ``M`` MoE layers with random ids, routing weights and an
    invalid last row (as an engine returns it)."""
    rng = np.random.default_rng(T)
    ex = rng.integers(0, E, (T, M, K), dtype=np.uint8)
    valid = np.ones(T, bool)
    valid[-1] = False
    weights = np.where(valid[:, None, None], np.float32(0.5), np.float32(0))
    weights = np.broadcast_to(weights, ex.shape).copy()
    return RouteRecord(np.arange(T), ex, valid, tuple(range(M)), M, E,
                       weight_versions=spans or [], weights=weights,
                       weights_dtype="float32")  # fmt: skip


def test_the_queue_keeps_the_ids_not_the_record() -> None:
    stats = RoutingStats(LAYERS, E, K)
    rec = _big_record(4096, len(LAYERS), K)
    record, weights, tokens = weakref.ref(rec), weakref.ref(rec.weights), weakref.ref(rec.token_ids)
    with stats._lock:  # the worker waits inside its first count, holding what was queued
        stats.observe(rec)
        del rec
        gc.collect()
        assert record() is None and weights() is None and tokens() is None
    stats.close()
    v = _values(stats)
    assert v[("routereplay_routed_tokens_window", ("weight_version", "unknown"))] == 4095


def test_the_queue_is_bounded_by_bytes_and_skips_past_it() -> None:
    stats = RoutingStats(range(32), E, 8)  # the default bound: 64 MiB
    T, n = 16384, 40  # 4 MiB of expert ids a record
    tracemalloc.start()
    try:
        with stats._lock:  # the worker waits inside its first count: the queue fills
            for i in range(n):
                ex = np.full((T, 32, 8), i % E, np.uint8)
                stats.observe(RouteRecord(np.arange(T), ex, np.ones(T, bool), range(32), 32, E))
                del ex
                assert 0 < stats.queued_bytes <= 64 << 20
            held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held <= 65 << 20, f"{n} records observed, {held} bytes still held"
    assert stats.skipped >= 24
    stats.close()  # counts what was queued
    assert stats.queued_bytes == 0
    v = _values(stats)
    assert v[("routereplay_routed_tokens_window", ("weight_version", "unknown"))] == T * (
        n - stats.skipped
    )
    assert v[("routereplay_routing_stats_skipped_total", ("reason", "queue_full"))] == stats.skipped
    registry = CollectorRegistry()
    registry.register(stats)
    assert b"routereplay_routing_entropy{" in generate_latest(registry)


def test_a_record_larger_than_the_bound_waits_alone() -> None:
    rec = _big_record(1024, len(LAYERS), K)
    stats = RoutingStats(LAYERS, E, K, max_queued_bytes=1024)
    with stats._lock:
        stats.observe(rec)  # counted: nothing else waits
        stats.observe(rec)  # skipped: the first still waits
    stats.close()
    assert stats.skipped == 1 and stats.queued_bytes == 0
    v = _values(stats)
    assert v[("routereplay_routed_tokens_window", ("weight_version", "unknown"))] == 1023


def test_counting_copies_a_block_not_the_record() -> None:
    rec = _big_record(65536, 48, 8)  # 24 MiB of uint8 ids: 192 MiB as int64
    stats = RoutingStats(range(48), E, 8)
    tracemalloc.start()
    try:
        stats.count(rec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < rec.experts.nbytes / 4, f"counting allocated {peak} bytes at its peak"
    (_, want, _), = expert_counts(rec)  # fmt: skip
    first = stats._bucket(stats.clock()) - 11
    np.testing.assert_array_equal(stats._windows["unknown"].total(first), want)


def test_a_late_record_of_an_old_version_leaves_the_live_window() -> None:
    stats = RoutingStats(LAYERS, E, K, versions=2)
    tokens = [[[0, 1], [2, 3]]] * 4

    def versions() -> set[str]:
        return {dict(k[1:])["weight_version"] for k in _values(stats)
                if k[0] == "routereplay_routed_tokens_window"}  # fmt: skip

    for v in ("v1", "v2", "v3"):  # v3 is live; v1 is pushed out
        stats.count(_record(tokens, [(v, 0, 4)]))
    assert versions() == {"v2", "v3"}
    stats.count(_record(tokens, [("v2", 0, 4)]))  # late, but kept: counted
    stats.count(_record(tokens, [("v1", 0, 4)]))  # late, pushed out already: dropped
    assert versions() == {"v2", "v3"}
    stats.count(_record(tokens, [("v1", 0, 2), ("v3", 2, 4)]))  # only v1's rows dropped
    v = _values(stats)
    assert v[("routereplay_routed_tokens_window", ("weight_version", "v2"))] == 8
    assert v[("routereplay_routed_tokens_window", ("weight_version", "v3"))] == 6
    assert v[("routereplay_routing_stats_skipped_total", ("reason", "retired_version"))] == 2
    stats.count(_record(tokens, [("v4", 0, 4)]))  # a version seen first is the newest
    assert versions() == {"v3", "v4"}


async def test_aclose_drains_while_the_loop_runs() -> None:
    stats = RoutingStats(LAYERS, E, K)
    stats._lock.acquire()  # the worker waits inside its count until the loop lets it go
    stats.observe(_record([[[0, 1], [2, 3]]] * 4))
    closing = asyncio.create_task(stats.aclose())
    for _ in range(3):  # the loop keeps running while the close waits for the worker
        await asyncio.sleep(0.01)
    assert not closing.done()
    stats._lock.release()
    await closing
    v = _values(stats)
    assert v[("routereplay_routed_tokens_window", ("weight_version", "unknown"))] == 4


def test_a_record_after_close_starts_no_worker() -> None:
    stats = RoutingStats(LAYERS, E, K)
    stats.observe(_record([[[0, 1], [2, 3]]] * 4))
    stats.close()
    stats.observe(_record([[[0, 1], [2, 3]]] * 4))  # a store that finished during shutdown
    assert stats._thread is None
    assert not [t for t in threading.enumerate() if t.name == "routing-stats"]
    v = _values(stats)
    assert v[("routereplay_routing_stats_skipped_total", ("reason", "closed"))] == 1
    assert v[("routereplay_routed_tokens_window", ("weight_version", "unknown"))] == 4


async def test_shutdown_drains_the_routing_stats_off_the_loop(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A close that blocked the loop would wait out its whole timeout (the worker finishes only
    # once the loop runs): far beyond any stall a loaded host makes, so the two cannot be confused.
    monkeypatch.setattr(routing_stats, "_CLOSE_TIMEOUT_S", 120.0)
    ticks: list[float] = []
    shutting_down = asyncio.Event()
    async with running_app(redis_url) as svc:
        stats, info = svc.app.state.service.capture.stats, svc.backend.info
        T, M = 64, len(info.moe_layers)
        rec = RouteRecord(np.arange(T), np.zeros((T, M, info.top_k), np.uint8), np.ones(T, bool),
                          info.moe_layers, info.num_layers, info.num_experts)  # fmt: skip
        stats._lock.acquire()  # the worker waits inside its count: closing waits for it
        stats.observe(rec)

        async def tick() -> None:
            await shutting_down.wait()
            closing = 0
            while True:
                ticks.append(time.monotonic())
                closing += stats._thread is None  # the close has begun
                if closing == 3 and stats._lock.locked():
                    stats._lock.release()  # only a running loop lets the worker finish
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        shutting_down.set()
        start = time.monotonic()
    ticks.append(time.monotonic())
    ticker.cancel()
    if stats._lock.locked():
        stats._lock.release()
    stalls = np.diff([start, *ticks])
    assert stalls.max() < 60, f"the event loop stood still {stalls.max():.1f} s in the shutdown"
    v = _values(stats)
    assert v[("routereplay_routed_tokens_window", ("weight_version", "unknown"))] == T


async def test_metrics_endpoint_shows_the_stored_routes_load(redis_url: str) -> None:
    async with running_app(redis_url, expert_metrics=True) as svc:
        info = svc.backend.info
        await svc.openai.completions.create(model=MODEL, prompt="hello there", max_tokens=6)
        # Counted in the stats worker after the route is stored.
        await until(lambda: svc.metric("routereplay_routed_tokens_window"), "the load counted")
        text = (await svc.http.get("/metrics")).text
    layers = {ln.split('layer="')[1].split('"')[0] for ln in text.splitlines()
              if ln.startswith("routereplay_routing_entropy{")}  # fmt: skip
    assert layers == {str(x) for x in info.moe_layers}
    assert "routereplay_expert_load_imbalance{" in text
    assert "routereplay_unused_experts_ratio{" in text
    assert "routereplay_expert_tokens_total{" in text


def test_report_from_a_service_by_ids(live_server, tmp_path) -> None:
    # routereplay report --url: routes fetched over HTTP by id (the synthetic engine's).
    import httpx

    from routereplay.report import main as report_main

    pytest.importorskip("matplotlib")
    ids = []
    with httpx.Client(base_url=live_server.url, timeout=60) as http:
        for i in range(3):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": f"report {i}",
                                                   "max_tokens": 5})  # fmt: skip
            ids.append(r.json()["choices"][0]["routed_experts"]["route_id"])
    out = tmp_path / "r.html"
    assert report_main(["--url", live_server.url, "--ids", *ids, "--out", str(out)]) == 0
    page = out.read_text()
    assert page.count("data:image/png;base64,") == 2 and "weight version" in page


def test_report_answers_a_bad_source_in_one_line(live_server, capsys) -> None:
    from routereplay.report import main as report_main

    cases = [
        (["--url", live_server.url, "--ids", "nope-0"], "RouteNotFoundError: route 'nope-0' not"),
        (["--url", live_server.url, "--ids", "bad id{"], "RouteShapeError: invalid route id"),
        (["--redis-url", "redis://127.0.0.1:1/0", "--weight-version", "v"], "ConnectionError"),
    ]
    for argv, want in cases:
        assert report_main([*argv, "--out", "/nonexistent/never-written.html"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("routereplay report: ") and want in err, err
        assert "Traceback" not in err
