"""The experiments' trained models end to end on CPU (a few steps, not a learned model):
``train_tiny train --shape moe64`` builds the 64-expert top-8 shape in Megatron-Core and exports
it, ``finish`` makes a checkpoint directory of it, the bridge reads the raw export as the same
weights, and ``stats`` measures its routing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron


def _tiny(*args: str) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "routereplay.experiments.train_tiny", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def test_moe64_trains_exports_and_has_routing_stats(tmp_path: Path) -> None:
    import torch

    from routereplay.experiments import bridge
    from routereplay.experiments.train_tiny import MOE64

    corpus = tmp_path / "corpus.npy"
    np.save(corpus, np.random.default_rng(0).integers(3, 1024, 20_000).astype(np.uint16))
    raw, model = tmp_path / "raw", tmp_path / "model"
    log = _tiny("train", "--shape", "moe64", "--corpus", str(corpus), "--out", str(raw),
                "--steps", "2", "--batch", "2", "--seq", "32", "--device", "cpu")  # fmt: skip
    assert json.loads(log.strip().splitlines()[-1])["step"] == 1
    _tiny("finish", "--weights", str(raw), "--out", str(model))

    cfg, exported = bridge.load_hf_checkpoint(raw)  # config.json + weights.pt (bf16)
    served_cfg, served = bridge.load_hf_checkpoint(model)  # model.safetensors (float32)
    assert cfg == served_cfg == json.loads(json.dumps(MOE64))
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]) == (64, 8, 8)
    assert exported.keys() == served.keys()
    assert all(torch.equal(exported[k], served[k]) for k in served)
    assert all(v.dtype == torch.float32 for v in exported.values())

    stats = json.loads(_tiny("stats", "--model", str(model), "--corpus", str(corpus)))
    assert (stats["experts"], stats["top_k"], len(stats["layers"])) == (64, 8, 8)
    for layer in stats["layers"]:
        assert 8 / 64 <= layer["topk_mass"] <= 1.0  # the top-8 hold at least their share
        assert layer["load_max_over_mean"] >= 1.0
        assert 0.0 <= layer["unused_experts"] < 1.0


def test_moe128_has_the_production_router_and_trains(tmp_path: Path) -> None:
    """The wider shape (Qwen3-30B-A3B's 128 experts, top-8, over 16 MoE layers) builds, takes a
    training step and exports a checkpoint of that layout."""
    from routereplay.experiments import bridge
    from routereplay.service.model_info import moe_layout

    corpus = tmp_path / "corpus.npy"
    np.save(corpus, np.random.default_rng(0).integers(3, 1024, 5_000).astype(np.uint16))
    raw = tmp_path / "raw"
    log = _tiny("train", "--shape", "moe128", "--corpus", str(corpus), "--out", str(raw),
                "--steps", "1", "--batch", "1", "--seq", "16", "--device", "cpu")  # fmt: skip
    assert json.loads(log.strip().splitlines()[-1])["step"] == 0
    cfg, weights = bridge.load_hf_checkpoint(raw)
    _, moe, experts, top_k = moe_layout(cfg)
    assert (len(moe), experts, top_k) == (16, 128, 8)
    gates = [k for k in weights if k.endswith("mlp.gate.weight")]
    assert len(gates) == 16 and all(tuple(weights[k].shape) == (128, 128) for k in gates)
