"""``routereplay report``: the expert load of stored routes per weight version, the trainer's
coverage and disagreement, in one HTML page; opened in headless Chromium, every figure renders
and the page raises no error."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from routereplay.client import RouteRecord, RouteStore
from routereplay.report import usage_by_version

pytest.importorskip("matplotlib")

LAYERS, E, K = (0, 1, 2), 16, 2


def _records(rng: np.random.Generator, version: str, skew: float, n: int) -> list[RouteRecord]:
    """``n`` records of one weight version; ``skew`` concentrates the load on low experts."""
    p = np.exp(-skew * np.arange(E))
    p /= p.sum()
    out = []
    for _ in range(n):
        T = 40
        ex = np.stack([[rng.choice(E, K, replace=False, p=p) for _ in LAYERS] for _ in range(T)])
        valid = np.ones(T, bool)
        valid[-1] = False
        out.append(RouteRecord(rng.integers(3, 500, T), ex.astype(np.uint8), valid, LAYERS, 4, E,
                               weight_versions=[(version, 0, T)]))  # fmt: skip
    return out


def test_usage_by_version_counts_valid_rows_per_span() -> None:
    rng = np.random.default_rng(0)
    rec = _records(rng, "a", 0.0, 1)[0]
    rec = RouteRecord(rec.token_ids, rec.experts, rec.valid, LAYERS, 4, E,
                      weight_versions=[("a", 0, 10), ("b", 10, 40)])  # fmt: skip
    a, b = usage_by_version([rec])
    assert (a.version, a.tokens, b.version, b.tokens) == ("a", 10, "b", 29)
    assert (a.counts.sum(axis=1) == 10 * K).all() and (b.counts.sum(axis=1) == 29 * K).all()


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)


def test_report_from_redis_renders_in_chromium(redis_url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    prefix = f"rep{uuid.uuid4().hex[:6]}"
    with RouteStore.from_url(redis_url, prefix=prefix) as store:
        for i, rec in enumerate(_records(rng, "step-1", 0.05, 6) + _records(rng, "step-2", 0.4, 6)):
            store.put(f"r{i}", rec)
        store.put("other", _records(rng, "step-0", 0.0, 1)[0])  # not asked for
    log = tmp_path / "replay.jsonl"
    log.write_text("\n".join(json.dumps({"step": s, "replay/coverage": 0.9 + s / 100,
        "replay/router_token_mismatch/layer_0": 0.01 * s, "replay/router_token_mismatch/layer_2":
        0.02}) for s in range(5)))  # fmt: skip
    out = tmp_path / "routing.html"
    p = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "report", "--redis-url", redis_url, "--prefix",
         prefix, "--weight-version", "step-1", "--weight-version", "step-2", "--trainer-log",
         str(log), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "12 routes, weight versions step-1, step-2" in p.stdout
    page = out.read_text()
    assert page.count("data:image/png;base64,") == 4  # heatmaps, load bars, coverage, disagreement
    assert "step-0" not in page
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium on this machine (apt-get install chromium): the page is "
                    "checked without a browser")  # fmt: skip
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
         "--dump-dom", out.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    body = re.search(r"<body([^>]*)>", dom).group(1)
    assert 'data-images="4/4"' in body, body  # every image decoded, with a size
    assert 'data-errors="0"' in body, body
    shot = tmp_path / "shot.png"
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
         "--window-size=1400,2400", out.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("L"))
    assert pixels.std() > 10  # figures drawn, not a blank page


def test_report_needs_routes(tmp_path: Path, redis_url: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "report", "--redis-url", redis_url, "--prefix",
         "nothing-here", "--weight-version", "v", "--out", str(tmp_path / "x.html")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 1 and "no routes found" in p.stderr


def test_trainer_figures_are_named_by_what_the_log_holds() -> None:
    # A log of shadow diagnostics only: one figure, the disagreement, under its own name.
    from routereplay.report import figures

    usages = usage_by_version(_records(np.random.default_rng(2), "v", 0.1, 2))
    rows = [{"step": 0, "replay/router_token_mismatch/layer_1": 0.02}]
    assert sorted(figures(usages, rows)) == [
        "expert-load.png", "expert-utilisation.png", "trainer-disagreement.png"]  # fmt: skip
    rows = [{"step": 0, "replay/coverage": 0.9}]
    assert "trainer-coverage.png" in figures(usages, rows)
