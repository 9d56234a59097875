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
