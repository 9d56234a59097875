"""Subprocesses for the service tests: ``routereplay serve`` and ``vllm serve``, on free ports.

Each process gets its own log file (shown when it fails to start) and is stopped by PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from routereplay.service.cpu_setup import cpu_engine_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(cpu_engine_env())
    env.update(extra)
    return env


@contextlib.contextmanager
def process(
    argv: list[str], ready_url: str, log: Path, env: dict[str, str], timeout_s: float = 240.0
) -> Iterator[subprocess.Popen]:
    """Start ``argv``; yield once ``ready_url`` answers 200; SIGTERM (then SIGKILL) on exit."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{argv[:4]} exited {proc.returncode}:\n{log.read_text()[-4000:]}"
                )
            try:
                if httpx.get(ready_url, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{argv[:4]} not ready in {timeout_s}s:\n{log.read_text()[-4000:]}"
                )
            time.sleep(0.5)
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """Stop ``proc`` and its process group (the engine core and workers it spawned)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (engine workers)


def serve_argv(*flags: str) -> list[str]:
    return [sys.executable, "-m", "routereplay.cli", "serve", *flags]


def vllm_serve_argv(model: str, port: int, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "2048", "--enforce-eager", "--gpu-memory-utilization", "0.5",
        "--seed", "0", "--enable-return-routed-experts", "--enable-prefix-caching", *flags,
    ]  # fmt: skip
