"""deploy/grafana/routereplay-dashboard.json holds: it validates against Grafana's dashboard JSON
schema (deploy/grafana/dashboard.schema.json; deploy/grafana/README.md names its source), every
query reads a metric the service exports with labels that metric has, panel ids are unique, and
every panel has a place on the grid that no other panel takes.

The service's metric names and labels come from its own definitions (``ServiceMetrics``); vLLM's
from the list docs/service.md documents (its Metrics section).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import jsonschema
import numpy as np
from prometheus_client.metrics import MetricWrapperBase

from routereplay.client import RouteRecord
from routereplay.service.metrics import ServiceMetrics
from routereplay.service.routing_stats import RoutingStats

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "routereplay-dashboard.json"
SCHEMA = GRAFANA / "dashboard.schema.json"
# grafana-foundation-sdk v0.0.18 jsonschema/dashboard.jsonschema.json (deploy/grafana/README.md)
SCHEMA_SHA256 = "67451cd5b288f97e3f68eccd52ffa4f75151fc87c669b8cd93c051056b294265"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
TARGET_LABELS = {"job", "instance"}  # Prometheus adds them to every scraped series
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
}
VLLM_LABELS = {"model_name", "engine"}  # docs/service.md: "labelled `model_name` ... and `engine`"
KEYWORDS = {"and", "or", "unless", "bool", "offset"}

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
STRING = r'"(?:[^"\\]|\\.)*"'
SELECTOR = re.compile(rf"({NAME})?\s*\{{([^}}]*)\}}")
MATCHER = re.compile(rf"\s*({NAME})\s*(?:=~|!~|!=|=)\s*{STRING}\s*(?:,|$)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(rf"^label_values\((.*),\s*({NAME})\)$")


def service_series() -> dict[str, set[str]]:
    """Every series name the app's own registry exposes -> its label names."""
    out: dict[str, set[str]] = {}
    for metric in vars(ServiceMetrics()).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        (family,) = metric.describe()
        labels = set(metric._labelnames)  # prometheus_client has no public accessor for them
        for suffix in SUFFIXES[family.type]:
            out[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    assert out, "no metrics found in ServiceMetrics"
    return out | routing_series()


def routing_series() -> dict[str, set[str]]:
    """The expert-load collector's series (service/routing_stats.py), read from what it exports
    after counting one record, per-expert counter included."""
    stats = RoutingStats((0, 1), 4, 2, per_expert=True)
    ex = np.zeros((3, 2, 2), np.uint8)
    ex[..., 1] = 1
    stats.count(RouteRecord(np.arange(3), ex, np.ones(3, bool), (0, 1), 2, 4))
    out: dict[str, set[str]] = {}
    for family in stats.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def vllm_series() -> dict[str, set[str]]:
    """The ``vllm:*`` series docs/service.md lists (its table of vLLM's metrics)."""
    text = (ROOT / "docs" / "service.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    assert all(f"`{label}`" in section for label in VLLM_LABELS)
    out: dict[str, set[str]] = {}
    for line in section.splitlines():
        if not line.startswith("| `vllm:"):
            continue
        names_cell, what = line.strip("|").rsplit("|", 1)
        histogram = "histogram" in what
        for name in re.findall(r"`(vllm:[a-z0-9_]+)`", names_cell):
            for suffix in ("_bucket", "_sum", "_count") if histogram else ("",):
                out[name + suffix] = VLLM_LABELS | ({"le"} if suffix == "_bucket" else set())
    assert out, "no vllm:* metrics found in docs/service.md"
    return out


KNOWN = service_series() | vllm_series()


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Top-level panels and those inside rows."""
    return [q for p in dashboard["panels"] for q in (p, *p.get("panels", []))]


def expr_problems(expr: str, where: str) -> list[str]:
    """What is wrong with the metrics and labels ``expr`` uses (PromQL, Grafana variables)."""
    problems: list[str] = []
    rest = re.sub(r"\[[^\]]*\]", " ", re.sub(r"\$\{?\w+\}?", "0", expr))  # ranges out
    metrics: list[str] = []

    def selector(m: re.Match) -> str:
        name, body = m.group(1), m.group(2)
        matched = MATCHER.findall(body)
        if MATCHER.sub("", body).strip():
            problems.append(f"{where}: cannot parse the matchers {{{body}}}")
        if name and name in KNOWN:
            for label in set(matched) - KNOWN[name] - TARGET_LABELS:
                problems.append(f"{where}: {name} has no label {label!r}")
        if name and not TARGET_LABELS <= set(matched):
            problems.append(f"{where}: {name} is not filtered by $job and $instance")
        return f" {name or ''} "

    rest = SELECTOR.sub(selector, rest)
    grouped = [g.strip() for m in GROUPING.finditer(rest) for g in m.group(1).split(",")]
    rest = GROUPING.sub(" ", rest)
    rest = re.sub(rf"{NAME}\s*\(", " ", rest)  # function names
    rest = re.sub(r"\b\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\b", " ", rest)  # numbers
    for name in re.findall(NAME, rest):
        if name in KEYWORDS:
            continue
        if name not in KNOWN:
            problems.append(f"{where}: {name} is not a metric the service exports")
        metrics.append(name)
    if not metrics:
        problems.append(f"{where}: no metric in {expr!r}")
    labels = TARGET_LABELS.union(*(KNOWN.get(n, set()) for n in metrics))
    for label in set(filter(None, grouped)) - labels:
        problems.append(f"{where}: groups by {label!r}, a label none of its metrics has")
    return problems


def dashboard_problems(dashboard: dict) -> list[str]:
    """Everything wrong with ``dashboard`` beyond the schema: metrics, labels, ids, layout,
    datasources, variables."""
    problems: list[str] = []
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables.get("datasource", {})
    if (ds.get("type"), ds.get("query")) != ("datasource", "prometheus"):
        problems.append("no datasource variable of type datasource for prometheus")
    for name in ("job", "instance"):
        v = variables.get(name)
        if v is None or v.get("type") != "query" or v.get("datasource") != DATASOURCE:
            problems.append(f"no query variable {name!r} on ${{datasource}}")
            continue
        m = LABEL_VALUES.match(v["query"])
        if m is None or m.group(2) != name:
            problems.append(f"variable {name!r}: not label_values(..., {name})")
            continue
        problems += [
            p
            for p in expr_problems(m.group(1), f"variable {name}")
            if "not filtered" not in p  # the variables are what filters the panels
        ]

    panels = all_panels(dashboard)
    ids = [p.get("id") for p in panels]
    if None in ids or len(ids) != len(set(ids)):
        problems.append(f"panel ids missing or repeated: {ids}")
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        where = f"panel {p.get('id')} {p.get('title')!r}"
        g = p.get("gridPos")
        if g is None:
            problems.append(f"{where}: no gridPos")
            continue
        if g["x"] + g["w"] > 24:
            problems.append(f"{where}: wider than the grid")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    problems.append(f"{where}: overlaps {cells[x, y]} at x={x} y={y}")
                cells[x, y] = where
        if p["type"] == "row":
            continue
        if p["type"] not in ("timeseries", "stat"):
            problems.append(f"{where}: panel type {p['type']!r}")
        if p.get("datasource") != DATASOURCE or not p.get("targets"):
            problems.append(f"{where}: datasource is not ${{datasource}}, or no queries")
        for t in p.get("targets", []):
            if t.get("datasource") != DATASOURCE:
                problems.append(f"{where} {t.get('refId')}: datasource is not ${{datasource}}")
            problems += expr_problems(t["expr"], f"{where} {t.get('refId')}")
    return problems


def schema_errors(dashboard: dict) -> list[str]:
    schema = json.loads(SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in cls(schema).iter_errors(dashboard)
    ]


def test_dashboard_validates_against_grafanas_schema() -> None:
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SHA256, "schema edited"
    d = load()
    assert schema_errors(d) == []
    assert (d["title"], d["uid"]) == ("routereplay", "routereplay")
    assert d["schemaVersion"] >= 39


def test_dashboard_queries_metrics_the_service_exports() -> None:
    assert dashboard_problems(load()) == []


def test_dashboard_covers_the_operators_metrics() -> None:
    """The panels an operator needs are there: each of these series is queried somewhere."""
    exprs = " ".join(t["expr"] for p in all_panels(load()) for t in p.get("targets", []))
    for name in (
        "routereplay_requests_total", "routereplay_request_latency_seconds_bucket",
        "routereplay_requests_inflight", "routereplay_engine_queue_depth",
        "routereplay_routes_stored_total", "routereplay_route_store_errors_total",
        "routereplay_route_bytes_stored_total", "routereplay_route_writes_pending",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
        "vllm:num_preemptions_total",
    ):  # fmt: skip
        assert re.search(rf"(?<![\w:]){re.escape(name)}(?![\w:])", exprs), name
    assert 'status="499"' in exprs and 'status=~"5.."' in exprs


def test_an_unknown_metric_or_label_is_caught() -> None:
    d = load()
    broken = copy.deepcopy(d)
    target = next(p for p in all_panels(broken) if p["type"] != "row")["targets"][0]
    target["expr"] = target["expr"].replace(
        "routereplay_requests_total", "routereplay_request_total"
    )
    assert any("routereplay_request_total is not a metric" in p for p in dashboard_problems(broken))
    assert any(
        "has no label 'code'" in p
        for p in expr_problems(
            'rate(routereplay_requests_total{job=~"$job", instance=~"$instance", code="500"}[5m])',
            "x",
        )
    )
    assert any(
        "groups by 'code'" in p
        for p in expr_problems(
            'sum by (code) (routereplay_requests_inflight{job=~"$job", instance=~"$instance"})', "x"
        )
    )


def test_the_schema_catches_a_misspelled_field() -> None:
    d = load()
    panel = next(p for p in d["panels"] if p["type"] != "row")
    panel["gridpos"] = panel.pop("gridPos")
    assert any("gridpos" in e for e in schema_errors(d))
