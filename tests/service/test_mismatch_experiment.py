"""The mismatch experiment on the sharp tiny model (bf16 is where routes flip): replay makes the
trainer route exactly as vLLM did and brings its logprobs closer to the engine's; with the
engine's routing weights replayed too, float32 is exact, and the order of a row's slots moves
no logprob. The same rollouts through the Hugging Face trainer: every routing decision is vLLM's
and float32 logprobs equal vLLM's to 1e-5. The numbers themselves are in docs/benchmarks.md;
here only their direction is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.vllm, pytest.mark.megatron]


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """The experiment with the Megatron trainer; its rollouts saved for the HF trainer."""
    d = tmp_path_factory.mktemp("mismatch")
    out, rollouts = d / "mismatch.json", d / "rollouts.json"
    _run(["--model", "sharp", "--dtypes", "float32,bfloat16", "--json", str(out),
          "--save-rollouts", str(rollouts)])  # fmt: skip
    return rollouts, json.loads(out.read_text())


def _run(args: list[str]) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "experiment", "mismatch", *args],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def test_replay_closes_the_gap(megatron_run: tuple[Path, list]) -> None:
    f32, r = megatron_run[1]
    both = f32["replay_ids_weights"]
    assert both["route_agreement"] == 1.0 and both["max_abs_logprob_diff"] < 1e-5
    on, off, both = r["replay_on"], r["replay_off"], r["replay_ids_weights"]
    assert both["route_agreement"] == 1.0
    assert off["mean_abs_logprob_diff"] > both["mean_abs_logprob_diff"]
    assert on["route_agreement"] == 1.0  # every (token, MoE layer) used vLLM's experts
    assert off["route_agreement"] < 1.0  # bf16 flips some of the trainer's own decisions
    assert off["mean_abs_logprob_diff"] > on["mean_abs_logprob_diff"]
    assert off["max_abs_logprob_diff"] > on["max_abs_logprob_diff"]
    assert r["sampled_tokens"] > 300
    # Megatron's router output is a dense [N, E] map: the order of a row's slots cannot matter.
    for row in (f32, r):
        assert row["replay_ids_weights_slots_shuffled"]["route_agreement"] == 1.0
        assert row["slot_order_max_abs_logprob_change"] == 0.0


def test_hf_trainer_replays_vllms_routes_exactly(
    megatron_run: tuple[Path, list], tmp_path: Path
) -> None:
    # The same rollouts, the transformers model as the trainer (HFRouterReplayer).
    out = tmp_path / "hf.json"
    _run(["--from-rollouts", str(megatron_run[0]), "--trainer", "hf", "--json", str(out)])
    f32, r = json.loads(out.read_text())
    for row in (f32, r):
        for name in ("replay_on", "replay_ids_weights"):
            # Every (token, MoE layer) decision the experts used is the one vLLM stored.
            assert row[name]["route_agreement"] == 1.0, (row["dtype"], name)
    assert f32["replay_on"]["max_abs_logprob_diff"] < 1e-5
    # The weights the experts applied: the router's own at the engine's ids (replay on), the
    # engine's themselves (ids + weights); in float32 both are the engine's to a rounding.
    w = {k: f32[k]["max_abs_weight_diff"] for k in ("replay_on", "replay_ids_weights")}
    assert w["replay_on"] < 1e-5 and w["replay_ids_weights"] == 0.0, w
    assert f32["replay_ids_weights"]["max_abs_logprob_diff"] < 1e-5, w
    on, off = r["replay_on"], r["replay_off"]
    assert off["route_agreement"] < 1.0
    assert off["mean_abs_logprob_diff"] > on["mean_abs_logprob_diff"]
    assert off["max_abs_logprob_diff"] > on["max_abs_logprob_diff"]
