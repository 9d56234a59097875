"""How many threads the client's and the adapter's parallel parts use. A module of its own, with
no Redis import, so that the trainer adapter can use it where only the codec is installed (the
GPU checks stage that subset: tests/gpu/_common.sh)."""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["DecodePool", "default_decode_threads", "usable_cpus"]

_CGROUP = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cpus(cgroup_root: Path = _CGROUP, proc_cgroup: Path = _PROC_CGROUP) -> int:
    """The CPUs this process may keep busy: its affinity (a cgroup cpuset, taskset), cut to its
    cgroup's CPU quota rounded up (a pod's ``limits.cpu``: 2.5 gives 3). ``os.cpu_count()``
    counts the node's CPUs, which in a pod limited to 4 of 64 would size pools for 64."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        n = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root, proc_cgroup)
    return max(1, min(n, math.ceil(quota))) if quota is not None else max(1, n)


def _cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    """The tightest CPU quota (CPUs' worth) over this process's cgroup and its ancestors, in
    cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us``; None where none is set or readable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: "0::/path"
            quotas += [_v2_quota(d / "cpu.max") for d in _dirs(root, path)]
        elif "cpu" in controllers.split(","):
            # The mount's name varies by distribution; each distinct folder is read once.
            for mount in dict.fromkeys((root / "cpu", root / "cpu,cpuacct", root / controllers)):
                quotas += [_v1_quota(d) for d in _dirs(mount, path)]
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def _dirs(mount: Path, path: str) -> list[Path]:
    # The cgroup's directory and each ancestor's up to the mount. Inside a container whose
    # cgroup namespace is private the path is "/" and the mount is the container's own cgroup.
    parts = [p for p in path.split("/") if p]
    return [mount.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]


def _v2_quota(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None  # -1: no quota


def default_decode_threads() -> int:
    """Decode threads a store uses unless told: the CPUs this process may keep busy
    (``usable_cpus``), up to 8 (a trainer host runs one reader per GPU; on a 16-core host 8
    threads decode a 256k-token step's chunks faster than 4, docs/benchmarks.md)."""
    return min(8, usable_cpus())


class DecodePool:
    """The decode threads of one reader (a store, an HTTP client): started on the first read,
    so a writer never starts them; None with fewer than 2 threads (decode on the caller's)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor | None:
        if self.threads < 2:
            return None
        with self._lock:
            # A forked child (a DataLoader worker, say) inherits the pool object but none of its
            # threads: work submitted there would never run, so the child makes its own.
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(
                    self.threads, thread_name_prefix="routereplay-decode"
                )
                self._pid = os.getpid()
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
