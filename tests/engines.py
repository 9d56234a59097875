"""Real-engine test fixtures (a pytest plugin of tests/conftest.py): one routereplay service (one
vLLM engine) per engine configuration for the whole session, and the helpers that start more.

- ``service``: the embedded default, whose weights never change (other modules compare its
  routes with an offline engine).
- ``rl_service``: the RL control API's engine, as an admin, with file loads under its weights
  root and the scheduler's test hold (``tests/plugins/vllm_test_hold``); its weights change.

Each runs as a real ``routereplay serve`` subprocess on a free loopback port, storing into the
pytest session's private redis-server (``redis_url`` from tests/conftest.py). In one process
both start before the first test when a collected test needs them (:func:`start_engines_early`),
so their start-ups run beside the engine-free tests; under pytest-xdist they start together at
the first test of their group. A test that uses one waits until it is ready.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import routereplay_test_hold as _test_hold

from routereplay.bench.servers import Server, engine_env, launched, server_processes, wait_ready
from routereplay.client import RouteStore
from routereplay.local_redis import free_port
from routereplay.service.tiny_model import ensure_tiny_model

MODEL_NAME = "tiny-qwen3-moe-moe"
RL_ADMIN = "ops:" + "f" * 24
RL_AUTH = {"Authorization": "Bearer " + "f" * 24}


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


def service_spec(
    redis_url: str, tiny_model: Path, log_dir: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[Server, Service]:
    """A ``routereplay serve`` of the tiny model (its own engine) on a free port, to start;
    ``env`` is added to its environment."""
    port = free_port()
    log = log_dir / "serve.log"
    argv = [
        sys.executable, "-m", "routereplay.cli", "serve", "--port", str(port),
        "--redis-url", redis_url, "--model-dir", str(tiny_model.parent),
        "--max-model-len", "2048", "--log-level", "warning",
        # A loaded host can stall a readiness check past the 1 s default: the tests want 200.
        "--ready-timeout-s", "10", *flags,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    server = Server(argv, f"{url}/ready", log, engine_env(**(env or {})))
    return server, Service(url, MODEL_NAME, tiny_model, redis_url, log)


@contextlib.contextmanager
def start_service(
    redis_url: str, tiny_model: Path, log_dir: Path, *flags: str, env: dict[str, str] | None = None
) -> Iterator[tuple[Service, subprocess.Popen]]:
    """:func:`service_spec`, started; yields once it is ready."""
    with start_services([service_spec(redis_url, tiny_model, log_dir, *flags, env=env)]) as [out]:
        yield out


@contextlib.contextmanager
def start_services(
    specs: list[tuple[Server, Service]],
) -> Iterator[list[tuple[Service, subprocess.Popen]]]:
    """Several :func:`service_spec` started at once: their engines' start-ups overlap."""
    with server_processes([server for server, _ in specs]) as procs:
        yield [(svc, proc) for (_, svc), proc in zip(specs, procs, strict=True)]


@dataclass
class Launched:
    """A service whose process is started; :meth:`ready` waits (once) until it serves."""

    server: Server
    service: Service
    proc: subprocess.Popen
    is_ready: bool = False

    def ready(self) -> Service:
        if not self.is_ready:
            wait_ready(self.server, self.proc)
            self.is_ready = True
        return self.service


@contextlib.contextmanager
def launch(spec: tuple[Server, Service]) -> Iterator[Launched]:
    """:func:`service_spec`, started and yielded at once; stopped on exit."""
    server, svc = spec
    with launched([server]) as [proc]:
        yield Launched(server, svc, proc)


# The run's shared engines, by the fixture that starts each: started early when wanted.
EARLY = ("service_engine", "rl_service_engine")


def uses_shared_engines(item: pytest.Item) -> bool:
    """Whether ``item`` needs one of the run's shared engines."""
    return any(name in item.fixturenames for name in EARLY)


def _launch_early(request: pytest.FixtureRequest, items: list[pytest.Item]) -> None:
    """Start (not wait for) the shared engines that one of ``items`` needs."""
    wanted = set().union(*(item.fixturenames for item in items))
    for name in EARLY:
        if name in wanted:
            # A start that fails here fails again, the same way, in each test that uses it
            # (pytest keeps a session fixture's error): the first test, whatever it is, runs.
            with contextlib.suppress(Exception, pytest.skip.Exception, pytest.fail.Exception):
                request.getfixturevalue(name)


@pytest.fixture(scope="session", autouse=True)
def start_engines_early(request: pytest.FixtureRequest) -> None:
    """Start the shared engines that a collected test needs, before the first test: a start
    takes ~30 s, mostly on one core, which the engine-free tests that run first leave idle.
    Under pytest-xdist a worker learns which tests it runs only as they come: the worker that
    receives the shared-engine group starts both engines at its first test of it."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        _launch_early(request, request.session.items)


@pytest.fixture(autouse=True)
def _start_engines_with_their_group(request: pytest.FixtureRequest) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    if "@" not in request.node.nodeid:
        # xdist writes the group into the node id; without it every module's tests, and the
        # shared engines, would be spread over both workers (pytest-xdist#1386).
        pytest.exit(f"pytest-xdist's loadgroup is not in effect ({request.node.nodeid} has no "
                    "group): install the test extra's pytest", returncode=4)  # fmt: skip
    if uses_shared_engines(request.node):
        group = [i for i in request.session.items if uses_shared_engines(i)]
        _launch_early(request, group)


@pytest.fixture(scope="session")
def service_engine(
    redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launched]:
    # With vLLM's pythonic tool parser, which needs no special tokens of the tiny tokenizer.
    flags = ("--tool-call-parser", "pythonic", "--enable-auto-tool-choice")
    spec = service_spec(redis_url, tiny_model, tmp_path_factory.mktemp("service"), *flags)
    with launch(spec) as e:
        yield e


@pytest.fixture(scope="session")
def service(service_engine: Launched) -> Service:
    return service_engine.ready()


@pytest.fixture()
def http(service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=120.0) as c:
        yield c


@dataclass
class RLService:
    """The RL engine: ``weights_root`` is its ``--weights-root``; requests named ``held-*``
    park after their first tokens until :meth:`release` (``tests/plugins/vllm_test_hold``)."""

    service: Service
    proc: subprocess.Popen
    weights_root: Path
    hold_dir: Path

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.service.url, headers=RL_AUTH, timeout=timeout)

    def release(self, request_id: str) -> None:
        assert request_id.startswith(_test_hold.PREFIX), request_id
        (self.hold_dir / request_id).touch()


@pytest.fixture(scope="session")
def rl_service_engine(
    redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launched]:
    """The RL engine's process; its weights root and hold directory are beside its log."""
    d = tmp_path_factory.mktemp("rl-service")
    (d / "weights").mkdir()
    (d / "hold").mkdir()
    flags = ("--route-prefix", "rl", "--admin-keys", RL_ADMIN, "--weights-root", str(d / "weights"))
    env = {_test_hold.ENV: str(d / "hold")}
    with launch(service_spec(redis_url, tiny_model, d, *flags, env=env)) as e:
        yield e


@pytest.fixture(scope="session")
def rl_service(rl_service_engine: Launched) -> RLService:
    svc, d = rl_service_engine.ready(), rl_service_engine.server.log.parent
    return RLService(svc, rl_service_engine.proc, d / "weights", d / "hold")
