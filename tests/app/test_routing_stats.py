"""Expert-load telemetry (service/routing_stats.py): the figures per MoE layer and weight
version over a sliding window, bounded series, the per-expert counter's limit, a full queue
skipping records instead of blocking, and the metrics on a running app's /metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from routereplay.client import RouteRecord
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


def test_observe_never_blocks_and_counts_in_its_thread() -> None:
    stats = RoutingStats(LAYERS, E, K, queue_size=1)
    rec = _record([[[0, 1], [2, 3]]] * 4)
    with stats._lock:  # the worker waits inside its first count: the queue fills
        for _ in range(50):
            stats.observe(rec)
    stats.close()  # counts what was queued
    v = _values(stats)
    counted = v[("routereplay_routed_tokens_window", ("weight_version", "unknown"))]
    assert counted == 4 * (50 - stats.skipped) and stats.skipped >= 48
    assert v[("routereplay_routing_stats_skipped_total",)] == stats.skipped
    registry = CollectorRegistry()
    registry.register(stats)
    assert b"routereplay_routing_entropy{" in generate_latest(registry)


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
