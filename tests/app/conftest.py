"""The in-process tier: the real app (routers, serving, capture, store) driven through
``httpx.ASGITransport`` and the official openai SDK, over the deterministic synthetic engine
backend and a real redis-server. No vLLM, no subprocess: milliseconds per test.

Each test gets its own app, backend and key prefix in the pytest session's redis-server, so tests
can break their engine or store without touching another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from routereplay.client import AsyncRouteStore, RouteRecord, RouteStore
from routereplay.local_redis import free_port
from routereplay.service import Settings, create_app
from routereplay.service.engine import ChoiceDelta, EngineEvent
from routereplay.service.engines.synthetic import SyntheticBackend, synthetic_routes

MODEL = "synthetic-moe"
BASE = "http://testserver"
# How long a test waits for a condition before it fails: far beyond any stall of a loaded
# machine, so only a condition that never comes fails a test.
PATIENCE_S = 120.0


async def until(condition: Callable[[], Any], what: str, timeout_s: float = PATIENCE_S) -> None:
    """Return once ``condition()`` (sync or awaitable) is true; fail naming ``what`` if it is
    not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = condition()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        await asyncio.sleep(0.002)


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = PATIENCE_S) -> None:
    """:func:`until` for tests without an event loop."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.01)


class ManualClock:
    """A service clock (:mod:`routereplay.service.clock`) that moves only when the test calls
    :meth:`advance`: lease renewals and grace periods happen at the step the test chooses."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        entry = (self.now + seconds, asyncio.get_running_loop().create_future())
        self._sleepers.append(entry)
        try:
            await entry[1]
        finally:
            with contextlib.suppress(ValueError):
                self._sleepers.remove(entry)

    @property
    def wakes(self) -> list[float]:
        """When the tasks asleep on this clock wake (a timer task waiting for its next turn)."""
        return sorted(t for t, _ in self._sleepers)

    def advance(self, seconds: float) -> None:
        """Move time on and wake every sleeper that is due."""
        self.now += seconds
        for entry in [e for e in self._sleepers if e[0] <= self.now]:
            self._sleepers.remove(entry)
            if not entry[1].done():
                entry[1].set_result(None)


class HeldEngine(SyntheticBackend):
    """The synthetic engine, except that each request stops after ``hold_after`` tokens (of
    choice 0) until the test lets it go: a request is in flight, mid-generation and mid-stream,
    for exactly as long as the test needs rather than for a guessed time at a paced decode."""

    def __init__(self, name: str = MODEL, *, hold_after: int = 1, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.hold_after = hold_after
        self.held = 0  # requests waiting at their hold now
        self._gate = asyncio.Semaphore(0)
        self._open = False

    def let_go(self, n: int | None = None) -> None:
        """Let ``n`` held requests (or ones yet to arrive) go on; every one, from now on, if
        ``n`` is None."""
        if n is None:
            self._open = True
            n = self.held
        for _ in range(n):
            self._gate.release()

    @property
    def abort_requested(self) -> bool:
        """``pause(mode="abort")`` or ``abort_requests()`` is ending every running request."""
        return self._abort_all

    def generate_chat(self, req):  # type: ignore[no-untyped-def]
        return self._held(super().generate_chat(req))

    def generate_completion(self, req):  # type: ignore[no-untyped-def]
        return self._held(super().generate_completion(req))

    async def _held(self, events: AsyncIterator[EngineEvent]) -> AsyncIterator[EngineEvent]:
        tokens = 0
        async with contextlib.aclosing(events):
            async for ev in events:
                yield ev
                if isinstance(ev, ChoiceDelta) and ev.index == 0:
                    tokens += 1
                    if tokens == self.hold_after and not self._open:
                        self.held += 1
                        try:
                            await self._gate.acquire()
                        finally:
                            self.held -= 1


@dataclass
class App:
    """One app under test and handles on what it is made of."""

    app: object
    backend: SyntheticBackend
    store: AsyncRouteStore
    http: httpx.AsyncClient
    openai: openai.AsyncOpenAI
    redis_url: str
    prefix: str

    def sync_store(self) -> RouteStore:
        return RouteStore.from_url(self.redis_url, prefix=self.prefix)

    def keys(self) -> set[bytes]:
        r = redis.Redis.from_url(self.redis_url)
        try:
            return set(r.scan_iter(f"{self.prefix}:*", count=1000))
        finally:
            r.close()

    def expected_experts(self, token_ids: list[int]) -> object:
        """The MoE-layer rows the synthetic engine routes ``token_ids`` to: ``[T - 1, M, K]``."""
        info = self.backend.info
        full = synthetic_routes(
            token_ids, info.num_layers, info.moe_layers, info.num_experts, info.top_k
        )
        return full[:, list(info.moe_layers), :]

    async def metric(self, name: str) -> float:
        text = (await self.http.get("/metrics")).text
        return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name))


def make_app(
    redis_url: str,
    backend: SyntheticBackend | None = None,
    clock: ManualClock | None = None,
    **settings: object,
):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    backend = backend or SyntheticBackend(MODEL)
    store = AsyncRouteStore.from_url(redis_url, prefix=prefix, block_size=16)
    s = Settings(redis_url=redis_url, route_prefix=prefix, block_size=16, **settings)
    return create_app(s, backend=backend, store=store, clock=clock), backend, store, prefix


@contextlib.asynccontextmanager
async def running_app(redis_url: str, **kw: object) -> AsyncIterator[App]:
    app, backend, store, prefix = make_app(redis_url, **kw)
    await backend.start()
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            # As a real server: an unhandled error is a 500 response, not an exception here.
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
            base_url=BASE,
            timeout=30,
        ) as http:
            client = openai.AsyncOpenAI(
                base_url=f"{BASE}/v1", api_key="unused", http_client=http, max_retries=0
            )
            yield App(app, backend, store, http, client, redis_url, prefix)
    await store.close()
    await backend.close()


@pytest.fixture()
def weights_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the apps' /reload_weights may read: the pytest session's temporary directory
    (every test's ``tmp_path`` is inside it)."""
    return tmp_path_factory.getbasetemp()


@pytest.fixture()
async def svc(redis_url: str, weights_root: Path) -> AsyncIterator[App]:
    # Without keys, as most tests here; the RL tests call the RL API, which that needs opening.
    async with running_app(redis_url, weights_root=weights_root, unsafe_no_auth=True) as a:
        yield a


@pytest.fixture()
async def held_svc(redis_url: str, weights_root: Path) -> AsyncIterator[App]:
    """An app over a :class:`HeldEngine` (``app.backend``; its requests hold after one token)."""
    async with running_app(
        redis_url, backend=HeldEngine(), weights_root=weights_root, unsafe_no_auth=True
    ) as a:
        yield a


@dataclass
class LiveServer:
    """The app behind a real uvicorn on loopback (for what ASGITransport cannot show:
    client disconnects, keep-alive connections)."""

    url: str
    backend: SyntheticBackend
    prefix: str


@contextlib.contextmanager
def live(
    redis_url: str, step_delay_s: float = 0.0, backend: SyntheticBackend | None = None
) -> Iterator[LiveServer]:
    """The app over ``backend`` (default: a synthetic engine at ``step_delay_s`` a step)
    behind a real uvicorn on a free loopback port."""
    import asyncio

    import uvicorn

    backend = backend or SyntheticBackend(MODEL, step_delay_s=step_delay_s)
    # The app opens (and closes) its own store, on uvicorn's event loop.
    prefix = f"t{uuid.uuid4().hex[:10]}"
    settings = Settings(redis_url=redis_url, route_prefix=prefix)
    app = create_app(settings, backend=backend)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))

    def run() -> None:
        asyncio.run(backend.start())
        server.run()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_for(lambda: server.started or not t.is_alive(), "uvicorn starting")
    assert server.started, "uvicorn did not start"
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", backend, prefix)
    finally:
        server.should_exit = True
        t.join(timeout=10)


@pytest.fixture()
def live_server(redis_url: str) -> Iterator[LiveServer]:
    with live(redis_url, step_delay_s=0.02) as s:
        yield s


@pytest.fixture(scope="module")
def live_server_module(redis_url: str) -> Iterator[LiveServer]:
    with live(redis_url, step_delay_s=0.0) as s:
        yield s


def record_tokens(rec: RouteRecord) -> list[int]:
    return rec.token_ids.tolist()
