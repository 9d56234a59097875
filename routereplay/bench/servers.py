"""Server subprocesses (``vllm serve``, ``routereplay serve``) for the benchmark and the tests.

Each runs in its own process group, so stopping it also stops the engine core and workers it
spawned; stopping is by process group id, never by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from routereplay.service.engines.vllm_host import engine_env as host_engine_env
from routereplay.service.engines.vllm_host import on_cpu_host

__all__ = [
    "Server", "engine_env", "launched", "server_process", "server_processes", "stop_process",
    "wait_ready",
]  # fmt: skip


def engine_env(cpu: bool | None = None, **extra: str) -> dict[str, str]:
    """This process's environment plus what vLLM needs on this host (``cpu``: a CPU host;
    default: this one's kind): the CPU engine's variables only where vLLM runs on CPU."""
    cpu = on_cpu_host() if cpu is None else cpu
    return {**os.environ, **host_engine_env(cpu), **extra}


@contextlib.contextmanager
def server_process(
    argv: list[str],
    ready_url: str,
    log: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> Iterator[subprocess.Popen]:
    """Start ``argv`` (output to ``log``); yield once ``ready_url`` answers 200; stop on exit."""
    with server_processes([Server(argv, ready_url, log, env)], timeout_s) as (proc,):
        yield proc


@dataclass(frozen=True)
class Server:
    """One server to start: its command, the URL that answers 200 once it is ready, its log."""

    argv: list[str]
    ready_url: str
    log: Path
    env: dict[str, str] | None = None


@contextlib.contextmanager
def server_processes(
    servers: list[Server], timeout_s: float = 300.0
) -> Iterator[list[subprocess.Popen]]:
    """Start every server at once (their start-ups overlap); yield once each is ready; stop
    them all on exit."""
    with launched(servers) as procs:
        deadline = time.monotonic() + timeout_s
        for s, proc in zip(servers, procs, strict=True):
            _wait_ready(s, proc, deadline, timeout_s)
        yield procs


@contextlib.contextmanager
def launched(servers: list[Server]) -> Iterator[list[subprocess.Popen]]:
    """Start every server and yield at once, before any is ready (:func:`wait_ready` waits);
    stop them all on exit."""
    procs: list[subprocess.Popen] = []
    try:
        for s in servers:
            with open(s.log, "wb") as f:
                proc = subprocess.Popen(
                    s.argv, stdout=f, stderr=subprocess.STDOUT, env=s.env or engine_env(),
                    start_new_session=True,
                )  # fmt: skip
            procs.append(proc)
        yield procs
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def wait_ready(server: Server, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Return once ``server`` (started as ``proc``) answers 200 on its ready URL; raise with its
    log's tail if it exits or is not ready within ``timeout_s``."""
    _wait_ready(server, proc, time.monotonic() + timeout_s, timeout_s)


def _wait_ready(s: Server, proc: subprocess.Popen, deadline: float, timeout_s: float) -> None:
    while True:
        if proc.poll() is not None:
            tail = s.log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{s.argv[:4]} exited {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(s.ready_url, timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            tail = s.log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{s.argv[:4]} not ready in {timeout_s}s:\n{tail}")
        time.sleep(0.5)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc``'s process group (SIGKILL after 30 s), then kill any stragglers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
