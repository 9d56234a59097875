"""The mismatch experiment on the sharp tiny model (bf16 is where routes flip): replay makes the
trainer route exactly as vLLM did and brings its logprobs closer to the engine's; with the
engine's routing weights replayed too, float32 is exact, and the order of a row's slots moves
no logprob. The numbers themselves are in docs/benchmarks.md; here only their direction is
asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.vllm, pytest.mark.megatron]


def test_replay_closes_the_gap(tmp_path: Path) -> None:
    out = tmp_path / "mismatch.json"
    p = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "experiment", "mismatch", "--model", "sharp",
         "--dtypes", "float32,bfloat16", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    f32, r = json.loads(out.read_text())
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
