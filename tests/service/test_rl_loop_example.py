"""The README's RL-loop example end to end: rollouts through the service (real engine), routes
replayed in a Megatron-Core training step, new weights pushed back, next rollouts stamped with
the new version. The test reads the verdict ``rl-loop --json`` prints and checks each figure
against its threshold itself."""

from __future__ import annotations

import json
import operator
import subprocess
import sys
from typing import Any

import pytest

from routereplay.experiments.rl_loop import (
    MAX_ROUTER_TOKEN_MISMATCH,
    MAX_STEP0_LOGPROB_DIFF,
    verdict,
)

OPS = {"==": operator.eq, "<=": operator.le, "<": operator.lt}


def _row(step: int, weights: str, mismatch: float, dlogp: float) -> dict[str, Any]:
    return {
        "step": step, "weights": weights, "samples": 8, "rows_replayed": 300, "rows_invalid": 8,
        "versions": {weights: 300}, "router_token_mismatch": mismatch,
        "mean_abs_logprob_diff": dlogp,
    }  # fmt: skip


def test_verdict_fails_on_each_figure_past_its_threshold() -> None:
    good = [_row(0, "default", 0.0, 1e-6), _row(1, "step-1", 0.004, 1e-4)]
    v = verdict(good, ["step-2"])
    assert v["ok"] and all(c["ok"] for c in v["checks"].values())

    bad = [_row(0, "default", 0.001, 2e-3), _row(1, "step-1", MAX_ROUTER_TOKEN_MISMATCH, 1e-4)]
    bad[1]["weights"] = "default"  # the update did not reach the rollouts
    bad[1]["versions"] = {"default": 295, "step-1": 5}
    bad[1]["rows_invalid"] = 9
    v = verdict(bad, ["step-1"])
    failed = {name: c["value"] for name, c in v["checks"].items() if not c["ok"]}
    assert not v["ok"]
    assert failed == {
        "rollout_weights": ["default", "default"],
        "rows_from_other_weights": 5,
        "rows_invalid": 17,
        "step0_router_token_mismatch": 0.001,
        "step0_mean_abs_logprob_diff": 2e-3,
        "max_router_token_mismatch": MAX_ROUTER_TOKEN_MISMATCH,
        "next_rollouts_weights": ["step-1"],
    }


@pytest.mark.vllm
@pytest.mark.megatron
def test_rl_loop_example() -> None:
    pytest.importorskip("megatron.core")
    p = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "experiment", "rl-loop", "--steps", "2",
         "--prompts", "2", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads(p.stdout)  # stdout is the JSON object alone; progress went to stderr
    steps, checks = report["steps"], report["checks"]

    # Every check holds, each by its own measured value against its threshold.
    for name, c in checks.items():
        assert OPS[c["op"]](c["value"], c["threshold"]), (name, c)
        assert c["ok"] is True, (name, c)
    assert report["ok"] is True

    # The checks measure the printed figures.
    assert checks["rollout_weights"] == {
        "value": ["default", "step-1"], "op": "==", "threshold": ["default", "step-1"],
        "ok": True,
    }  # fmt: skip
    assert checks["next_rollouts_weights"]["value"] == ["step-2"]
    assert checks["rows_from_other_weights"]["value"] == 0
    assert checks["rows_invalid"]["value"] == sum(s["samples"] for s in steps)
    # Before any update trainer and engine hold the same weights, in float32: exact.
    c = checks["step0_router_token_mismatch"]
    assert c["value"] == steps[0]["router_token_mismatch"] == c["threshold"] == 0.0
    c = checks["step0_mean_abs_logprob_diff"]
    assert c["value"] == steps[0]["mean_abs_logprob_diff"]
    assert c["threshold"] == MAX_STEP0_LOGPROB_DIFF and c["value"] < MAX_STEP0_LOGPROB_DIFF
    c = checks["max_router_token_mismatch"]
    assert c["value"] == max(s["router_token_mismatch"] for s in steps)
    assert c["threshold"] == MAX_ROUTER_TOKEN_MISMATCH and c["value"] < MAX_ROUTER_TOKEN_MISMATCH

    for s in steps:
        assert s["versions"] == {s["weights"]: s["rows_replayed"]}
        assert s["rows_invalid"] == s["samples"]  # each sample's last token only
        assert s["samples"] == 2 * 4  # 2 prompts, n = 4
    assert "rollouts after step 2: weight_version ['step-2']" in p.stderr
