"""The README's RL-loop example end to end: rollouts through the service (real engine), routes
replayed in a Megatron-Core training step, new weights pushed back, next rollouts stamped with
the new version."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.vllm, pytest.mark.megatron]


def test_rl_loop_example(tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    p = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "experiment", "rl-loop", "--steps", "2",
         "--prompts", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.strip().endswith("PASS")
    steps = json.loads(out.read_text())
    assert [s["weights"] for s in steps] == ["default", "step-1"]
    for s in steps:
        assert s["versions"] == {s["weights"]: s["rows_replayed"]}
        assert s["rows_invalid"] == s["samples"]  # each sample's last token only
        assert 0 <= s["router_token_mismatch"] < 0.05
    # Before any update trainer and engine hold the same weights, in float32: exact.
    assert steps[0]["router_token_mismatch"] == 0.0
    assert steps[0]["mean_abs_logprob_diff"] < 1e-3
    assert "rollouts after step 2: weight_version ['step-2']" in p.stdout
