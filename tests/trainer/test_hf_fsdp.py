"""HFRouterReplayer under FSDP2 on two CPU processes (gloo): every router call, forward and
recompute, hands its experts this rank's micro-batch targets, and the sharded gradients equal
the unsharded model's over every rank's micro-batches (tests/trainer/_hf_fsdp_check.py; the
same script runs on two GPUs in tests/gpu/run_hf_fsdp_gpu.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).with_name("_hf_fsdp_check.py")


@pytest.mark.slow  # two ranks, six model families
def test_fsdp2_replay() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT),
         "--device", "cpu", "--model-types", "qwen3_moe,deepseek_v3",
         "--modes", "checkpointing,bf16"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert p.returncode == 0 and len(rows) == 8, p.stdout[-2000:] + p.stderr[-3000:]
    for r in rows:
        assert r["ok"] and r["world"] == 2 and r["targets_exact"] and r["routers"] == 2
        if r["mode"] == "checkpointing":
            assert r["max_grad_diff_vs_unsharded"] < 1e-5
