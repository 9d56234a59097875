"""Service test fixtures: ONE routereplay service (one vLLM engine) for the whole session.

The service runs as a real ``routereplay serve`` subprocess on a free loopback port, storing
into the pytest session's private redis-server (``redis_url`` from tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from routereplay.bench.servers import engine_env, server_process
from routereplay.client import RouteStore
from routereplay.local_redis import free_port
from routereplay.service.tiny_model import ensure_tiny_model

MODEL_NAME = "tiny-qwen3-moe-moe"


def engine_core_pids(parent: int) -> list[int]:
    """PIDs of vLLM engine-core processes under ``parent`` (by parent pid, from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"EngineCore" in cmd:
            out.append(int(d.name))
    return out


@dataclass
class Service:
    url: str  # http://127.0.0.1:PORT
    model: str
    model_path: Path
    redis_url: str
    log: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def store(self) -> RouteStore:
        return RouteStore.from_url(self.redis_url)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The shared cache by default (built once per machine); deterministic either way.
    return ensure_tiny_model("moe").parent


@pytest.fixture(scope="session")
def tiny_model(model_dir: Path) -> Path:
    return ensure_tiny_model("moe", model_dir)


@pytest.fixture(scope="session")
def dense_first_model(model_dir: Path) -> Path:
    return ensure_tiny_model("dense-first", model_dir)


@contextlib.contextmanager
def start_service(
    redis_url: str, tiny_model: Path, log_dir: Path, *flags: str, env: dict[str, str] | None = None
) -> Iterator[tuple[Service, subprocess.Popen]]:
    """A ``routereplay serve`` of the tiny model (its own engine) on a free port; ``env`` is
    added to its environment."""
    port = free_port()
    log = log_dir / "serve.log"
    argv = [
        sys.executable, "-m", "routereplay.cli", "serve", "--port", str(port),
        "--redis-url", redis_url, "--model-dir", str(tiny_model.parent),
        "--max-model-len", "2048", "--log-level", "warning", *flags,
    ]  # fmt: skip
    with server_process(
        argv, f"http://127.0.0.1:{port}/ready", log, engine_env(**(env or {}))
    ) as proc:
        url = f"http://127.0.0.1:{port}"
        yield Service(url, MODEL_NAME, tiny_model, redis_url, log), proc


@pytest.fixture(scope="session")
def service(
    redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    with start_service(redis_url, tiny_model, tmp_path_factory.mktemp("service")) as (svc, _):
        yield svc


@pytest.fixture()
def http(service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=120.0) as c:
        yield c
