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
from pathlib import Path

import httpx

from routereplay.service.vllm_engine import engine_env as host_engine_env
from routereplay.service.vllm_engine import on_cpu_host

__all__ = ["engine_env", "server_process", "stop_process"]


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
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env or engine_env(),
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"{argv[:4]} exited {proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"{argv[:4]} not ready in {timeout_s}s:\n{tail}")
            time.sleep(0.5)
        yield proc
    finally:
        stop_process(proc)


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
