"""share_targets on four CPU processes (gloo, two TP2 groups): each group prepares its step
once, and every rank's targets equal, byte for byte, what gather_targets gives that rank on
its own position map (sequence parallel off and on, uint16 ids, a replay mask); a source whose
preparation fails, or that passes no ``prepare``, makes every rank of its group raise, none
waits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from routereplay.local_redis import free_port
from routereplay.trainer_adapter import ReplayTargets, TargetShapeError, sp_slice

HERE = Path(__file__).parent


def test_four_ranks_two_groups_share_their_targets() -> None:
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(HERE / "_share_check.py"), str(r), "4", str(port)],
                         cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(4)
    ]  # fmt: skip
    outs = [p.communicate(timeout=240)[0] for p in procs]
    report = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), report
    for r in range(4):
        for case in ("whole", "sp", "uint16+mask"):
            assert f"rank {r} {case}: same" in report, report
    assert (
        "rank 1 failure: receiver raised" in report and "rank 3 failure: receiver raised" in report
    )
    assert "rank 0 failure: source raised" in report and "rank 2 failure: source raised" in report
    # A source without prepare fails its group too, rather than leaving it waiting.
    for r, who in ((0, "source"), (1, "receiver"), (2, "source"), (3, "receiver")):
        assert f"rank {r} no prepare: {who} raised" in report, report
    # The SP slices hold half the rows each, the whole rows all of them.
    assert "rank 1 sp: same rows 64" in report and "rank 1 whole: same rows 128" in report


def test_sp_slice_refuses_rows_it_cannot_split() -> None:
    t = ReplayTargets((0,), np.zeros((1, 6, 2), np.uint8), 4, batch_shape=(1, 6))
    assert sp_slice(t, 1, 0) is t
    assert sp_slice(t, 2, 1).batch_shape == (1, 3)
    with pytest.raises(TargetShapeError, match="divisible by TP=4"):
        sp_slice(t, 4, 0)
    b = ReplayTargets((0,), np.zeros((1, 6, 2), np.uint8), 4, batch_shape=(1, 6), order="batch")
    with pytest.raises(TargetShapeError, match="'batch' order"):
        sp_slice(b, 2, 0)


def test_bench_tp_reports_one_preparation_per_group() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "bench", "tp", "--tokens", "20000", "--layers",
         "8", "--steps", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["tp"] == 2 and res["same_targets"] is True
    # Rank 1 prepares nothing when shared: its CPU is what it spends receiving.
    assert res["shared"]["cpu_ranks_s"] < res["each"]["cpu_ranks_s"]
