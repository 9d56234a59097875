"""Run replay_check.py from pytest: world size 1 in one process, or N gloo ranks through
torch.distributed.run; returns each rank's ``RESULT`` record."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from summarize import results

from routereplay.local_redis import free_port

SCRIPT = Path(__file__).resolve().parent / "replay_check.py"


def run_check(
    nproc: int, *args: str, redis_url: str = "", env: dict[str, str] | None = None
) -> list[dict]:
    """``env``: extra environment (e.g. ``PYTHONPATH`` putting another megatron-core first)."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += [
            "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()),
        ]  # fmt: skip
    cmd += [str(SCRIPT), "--device", "cpu", *args]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    res = results(p.stdout)  # ranks share stdout: records may be glued on one line
    assert len(res) == nproc, p.stdout[-2000:]
    return res


def assert_policy(results: list[dict], action: str, *, perturbed: bool = False) -> None:
    """A ``--policy`` run: the stale record (0) and the missing one (6) were the samples at fault
    on every micro-batch; ``own_routing``: every router row of theirs took the router's own top-k
    of the forward's scores (what a forward without replay chose, where one ran), the other rows
    their routes, and recompute the forward's experts; ``drop``: the re-packed batches had
    nothing left to decide."""
    own_rows = 0
    for r in results:
        assert r["ok"], r
        p = r["policy"]
        assert p["ok"] and p["records_at_fault"] == [0, 6], p
        assert p["kinds"] == ["missing", "staleness"] and set(p["samples"]) == {2.0}, p
        assert all(r["replay_mask_equal"]) and all(r["targets_equal_truth"]), r
        for layer, st in r["router_rows"].items():
            assert st["bad"] == 0 and st["rec_differs"] == 0 and st["fwd"] > 0, (layer, st)
            own_rows += st["own"]
            if perturbed and st["own"]:  # a recompute choosing afresh would have differed
                assert st["rec_own_topk_moved"] > 0, (layer, st)
            if not perturbed and action == "own_routing":
                assert st["rec_own_topk_moved"] == 0, (layer, st)
        if action == "drop":
            assert r["repacked_decisions"] == [0] * r["args"]["micro_batches"], r
            assert all(st["own"] == 0 for st in r["router_rows"].values()), r
        elif r["args"]["pp"] == 1:
            free = r["own_vs_free_forward"]
            assert free["differs"] == 0 and free["rows"] > 0, free
            assert free["gate_max_abs_diff"] <= 1e-5, free  # replay_check.GATE_TOL
    assert (own_rows > 0) == (action == "own_routing"), own_rows
