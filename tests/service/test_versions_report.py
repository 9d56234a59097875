"""``routereplay experiment versions`` end to end on the real engine: the tiny model served as
version "a", a copy with sharper routers loaded in place as "b" (``/reload_weights``), and the
report of both versions' stored routes: one heatmap panel per version, the figures as files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.vllm


def test_two_versions_report(tiny_model: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "models" / "a", tmp_path / "models" / "b"
    shutil.copytree(tiny_model, a)
    shutil.copytree(tiny_model, b)
    state = load_file(b / "model.safetensors")
    for k in state:
        if k.endswith("mlp.gate.weight"):  # the routers: other experts win
            state[k] = (state[k] * 5).flip(0).contiguous()
    save_file(state, b / "model.safetensors", metadata={"format": "pt"})
    out, figs = tmp_path / "report.html", tmp_path / "figs"
    p = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "experiment", "versions", "--model-a", str(a),
         "--label-a", "a", "--model-b", str(b), "--label-b", "b", "--prompts", "3",
         "--max-tokens", "4", "--out", str(out), "--png-dir", str(figs)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "6 routes, weight versions a, b" in p.stdout
    page = out.read_text()
    assert "weight version" in page and page.count("data:image/png;base64,") == 2
    assert sorted(f.name for f in figs.iterdir()) == ["expert-load.png", "expert-utilisation.png"]
