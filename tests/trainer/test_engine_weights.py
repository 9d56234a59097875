"""Engine routing weights: gathered next to the ids (pure numpy), and replayed by
``RouterReplayer(..., weights="engine")`` through a real MoE layer on CPU (megatron-core 0.16 and
each legacy release, in fresh processes: tests/trainer/_engine_weights_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_trainer_alignment import MOE, make_record, naive_truth

from routereplay.trainer_adapter import (
    MissingWeightsError,
    PositionMap,
    gather_targets,
    padded_position_map,
    sample_from_record,
    thd_position_map,
)

CHECK = Path(__file__).with_name("_engine_weights_check.py")


def with_weights(rng, rec, name: str | None = None):
    """``rec`` carrying engine weights (bfloat16 values as float32; 0 at invalid rows)."""
    w = rng.random(rec.experts.shape).astype(np.float32)
    w = (w.view(np.uint32) & 0xFFFF0000).view(np.float32)  # bfloat16-exact
    w[~rec.valid] = 0
    rec.weights, rec.weights_dtype = w, "bfloat16"
    if name is not None:
        rec.metadata = {"request_id": name, "choice": 0}
    return rec


def naive_weights(pm: PositionMap, records, layers) -> np.ndarray:
    """[M, S*B, K] by a per-position loop, sequence-major; 0 where no valid route."""
    B, S = pm.shape
    K = records[0].top_k
    out = np.zeros((len(layers), S * B, K), np.float32)
    for s in range(S):
        for b in range(B):
            r, t = int(pm.record[b, s]), int(pm.token[b, s])
            if r >= 0 and records[r] is not None and records[r].valid[t]:
                for i, layer in enumerate(layers):
                    out[i, s * B + b] = records[r].weights[t, records[r].moe_layers.index(layer)]
    return out


@pytest.fixture
def recs():
    rng = np.random.default_rng(3)
    return [with_weights(rng, make_record(rng, rng.integers(0, 999, n))) for n in (7, 12, 9)]


@pytest.mark.parametrize("cp,tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_weights_follow_the_ids_rows_padded(recs, cp, tp):
    """Left-padded [B, S]: each CP/SP rank's weights sit in the rows of its ids, bit for bit."""
    samples = [sample_from_record(i, r) for i, r in enumerate(recs)]
    full = padded_position_map(samples, 16, padding_side="left", records=recs)
    for cr in range(cp):
        for tr in range(tp):
            pm = full.local(cp_size=cp, cp_rank=cr, tp_size=tp, tp_rank=tr)
            tg = gather_targets(pm, recs, MOE, weights=True)
            np.testing.assert_array_equal(tg.experts, naive_truth(pm, recs, MOE))
            assert tg.weights.dtype == np.float32
            np.testing.assert_array_equal(tg.weights, naive_weights(pm, recs, MOE))
            assert (tg.weights[:, ~tg.valid] == 0).all()
            sub = tg.select((2, 5))
            np.testing.assert_array_equal(sub.weights, tg.weights[[1, 3]])


def test_weights_thd_cp2_and_default_off(recs):
    samples = [sample_from_record(i, r) for i, r in enumerate(recs)]
    cu = np.array([0, 7, 19, 28])
    cup = np.array([0, 8, 20, 32])
    full = thd_position_map(samples, cu, cu_seqlens_padded=cup, records=recs)
    for r in range(2):
        pm = full.local(cp_size=2, cp_rank=r, cu_seqlens_padded=cup)
        tg = gather_targets(pm, recs, MOE, weights=True)
        np.testing.assert_array_equal(tg.weights, naive_weights(pm, recs, MOE))
    assert gather_targets(full, recs, MOE).weights is None  # ids only unless asked


def test_missing_weights_name_the_route(recs):
    rng = np.random.default_rng(4)
    bare = make_record(rng, rng.integers(0, 999, 5))
    bare.metadata = {"request_id": "req-7", "choice": 0}
    records = [*recs, bare]
    samples = [sample_from_record(i, r) for i, r in enumerate(records)]
    pm = padded_position_map(samples, 12, records=records)
    gather_targets(pm, records, MOE)  # ids only: fine
    with pytest.raises(MissingWeightsError, match=r"route req-7-0 \(record 3\) has no engine") as e:
        gather_targets(pm, records, MOE, weights=True)
    assert e.value.kind == "missing_weights" and e.value.route == "req-7-0"
    # A record the store did not have gets fillers (and weight 0), as for the ids.
    records[3] = None
    tg = gather_targets(pm, records, MOE, weights=True)
    assert (tg.weights[:, ~tg.valid] == 0).all()


def _run_check(env: dict[str, str] | None = None, *args: str) -> dict:
    p = subprocess.run(
        [sys.executable, str(CHECK), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )  # fmt: skip
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")] or [p.stderr[-3000:]]
    r = json.loads(line[7:])
    assert p.returncode == 0 and r["ok"], json.dumps(r, indent=1)
    assert set(r["cases"]) == {"softmax_topk_renormalized", "softmax_then_topk", "sigmoid"}
    for c in r["cases"].values():
        assert c["router_grad_max_diff"] == 0.0
        assert set(c["recompute"]) == {"full", "selective"}
        assert c["refused"] == ["no_weights", "raw_ids"]
    assert r["bf16"]["probs_dtype"] == "torch.bfloat16" and r["bf16"]["engine_rows_exact"]
    return r


@pytest.mark.megatron
@pytest.mark.parametrize("forced_legacy", [False, True])
def test_engine_weights_native_megatron(forced_legacy):
    pytest.importorskip("megatron.core")
    r = _run_check(None, *(["--legacy"] if forced_legacy else []))
    assert r["legacy"] == forced_legacy and r["megatron"] >= "0.16"


@pytest.mark.megatron
@pytest.mark.parametrize("version", ["0.12.3", "0.15.3"])
def test_engine_weights_legacy_release(version):
    pytest.importorskip("megatron.core")
    from test_legacy_megatron import release_path

    r = _run_check({"PYTHONPATH": str(release_path(version))})
    assert r["legacy"] and r["megatron"] == version
