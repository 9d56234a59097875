"""``usable_cpus``: the CPUs the decode threads and the route workers are sized for, read from
this process's affinity and its cgroup's CPU quota (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us``), the files a container runtime writes for a pod's ``limits.cpu``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from routereplay.client import default_decode_threads, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _usable(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> int:
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_cgroup)
    return usable_cpus(_tree(tmp_path / "fs", files), proc)


def test_a_v2_quota_is_rounded_up_and_caps_the_affinity(tmp_path: Path) -> None:
    files = {"pod/ctr/cpu.max": "150000 100000\n"}
    assert _usable(tmp_path, "0::/pod/ctr\n", files) == min(AFFINITY, 2)
    files = {"pod/ctr/cpu.max": "50000 100000\n"}
    assert _usable(tmp_path / "b", "0::/pod/ctr\n", files) == 1


def test_an_ancestors_quota_binds_a_cgroup_without_one(tmp_path: Path) -> None:
    # A pod's limit sits on the pod's cgroup; its containers' own cpu.max may say "max".
    files = {"pod/ctr/cpu.max": "max 100000\n", "pod/cpu.max": "100000 100000\n"}
    assert _usable(tmp_path, "0::/pod/ctr\n", files) == 1


def test_a_private_cgroup_namespace_reads_the_mount_itself(tmp_path: Path) -> None:
    assert _usable(tmp_path, "0::/\n", {"cpu.max": "100000 100000\n"}) == 1


def test_a_v1_quota_caps_and_minus_one_means_none(tmp_path: Path) -> None:
    limited = {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    }
    line = "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n"
    assert _usable(tmp_path, line, limited) == 1
    unlimited = {
        "cpu/cpu.cfs_quota_us": "-1\n",
        "cpu/cpu.cfs_period_us": "100000\n",
    }
    assert _usable(tmp_path / "b", "2:cpu:/\n", unlimited) == AFFINITY


def test_no_quota_or_unreadable_files_leave_the_affinity(tmp_path: Path) -> None:
    assert _usable(tmp_path, "0::/x\n", {"x/cpu.max": "max 100000\n"}) == AFFINITY
    assert _usable(tmp_path / "b", "garbage\n0::/x\n", {"x/cpu.max": "a b c\n"}) == AFFINITY
    assert usable_cpus(tmp_path / "none", tmp_path / "missing") == AFFINITY


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is absent")
def test_the_pools_follow_a_narrowed_affinity() -> None:
    code = (
        "from routereplay.client import default_decode_threads, usable_cpus\n"
        "from routereplay.service.settings import default_route_workers\n"
        "print(usable_cpus(), default_decode_threads(), default_route_workers())"
    )
    core = str(min(os.sched_getaffinity(0)))
    out = subprocess.run(
        ["taskset", "-c", core, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["1", "1", "1"]
    assert default_decode_threads() == min(8, usable_cpus())
