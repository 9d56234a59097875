"""Expert-load telemetry (service/routing_stats.py): the figures per MoE layer and weight
version over a sliding window, bounded series, the per-expert counter's limit, counting in
blocks, the newest versions kept by first appearance, counts taken in a route worker process
equal to the serving process's own, and the metrics on a running app's /metrics."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

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


def test_counts_from_another_process_are_the_records() -> None:
    # A route worker counts the record it built and sends the counts, pickled, to the serving
    # process: what arrives must add up to what counting the record here adds.
    import pickle
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    rec = _big_record(4096, len(LAYERS), K, spans=[("v1", 0, 1000), ("v2", 1000, 4096)])
    here, there = RoutingStats(LAYERS, E, K), RoutingStats(LAYERS, E, K)
    here.count(rec)
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        counts = pool.submit(routing_stats.version_counts, rec).result()
    assert [v for v, _ in counts] == ["v1", "v2"] and pickle.dumps(counts)
    there.add(counts)
    assert _values(there) == _values(here)
    assert _values(here)[("routereplay_routed_tokens_window", ("weight_version", "v2"))] == 3095


def test_counts_of_another_shape_are_refused() -> None:
    stats = RoutingStats(LAYERS, E, K)
    with pytest.raises(ValueError, match=r"counts of shape \(3, 8\), not \(2, 8\)"):
        stats.add([("v", np.zeros((3, E), np.int64))])
    assert not [k for k in _values(stats) if k[0] == "routereplay_routed_tokens_window"]


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


async def test_metrics_endpoint_shows_the_stored_routes_load(redis_url: str) -> None:
    async with running_app(redis_url, expert_metrics=True) as svc:
        info = svc.backend.info
        await svc.openai.completions.create(model=MODEL, prompt="hello there", max_tokens=6)
        # Counted by the route worker that stored the route.
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
