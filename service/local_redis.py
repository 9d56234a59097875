"""A private redis-server for the embedded default (no Redis URL configured)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["LocalRedis"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """redis-server on a free loopback port in its own temp dir; no persistence; killed on stop."""

    def __init__(self, maxmemory: str = "1gb") -> None:
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self, timeout_s: float = 10.0) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "no Redis configured (ROUTEREPLAY_REDIS_URL / --redis-url) and redis-server is not "
                "on PATH to start a local one"
            )
        self._dir = tempfile.TemporaryDirectory(prefix="routereplay-redis-")
        port = _free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", self._dir.name, "--maxmemory", self.maxmemory,
             # Routes carry a TTL; under memory pressure the soonest-expiring go first.
             "--maxmemory-policy", "volatile-ttl"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        self.url = f"redis://127.0.0.1:{port}/0"
                        return self.url
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"local redis-server on port {port} did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    @property
    def directory(self) -> Path | None:
        return Path(self._dir.name) if self._dir else None
