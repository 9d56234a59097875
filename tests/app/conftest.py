"""The in-process tier: the real app (routers, serving, capture, store) driven through
``httpx.ASGITransport`` and the official openai SDK, over the deterministic synthetic engine
backend and a real redis-server. No vLLM, no subprocess: milliseconds per test.

Each test gets its own app, backend and key prefix in the session's redis-server, so tests can
break their engine or store without touching another's.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis

from routereplay.client import AsyncRouteStore, RouteRecord, RouteStore
from routereplay.local_redis import free_port
from routereplay.service import Settings, create_app
from routereplay.service.synthetic import SyntheticBackend, synthetic_routes

MODEL = "synthetic-moe"
BASE = "http://testserver"


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


def make_app(redis_url: str, backend: SyntheticBackend | None = None, **settings: object):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    backend = backend or SyntheticBackend(MODEL)
    store = AsyncRouteStore.from_url(redis_url, prefix=prefix, block_size=16)
    s = Settings(redis_url=redis_url, route_prefix=prefix, block_size=16, **settings)
    return create_app(s, backend=backend, store=store), backend, store, prefix


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
async def svc(redis_url: str) -> AsyncIterator[App]:
    async with running_app(redis_url) as a:
        yield a


@dataclass
class LiveServer:
    """The app behind a real uvicorn on loopback (for what ASGITransport cannot show:
    client disconnects, keep-alive connections)."""

    url: str
    backend: SyntheticBackend
    prefix: str


@contextlib.contextmanager
def _live(redis_url: str, step_delay_s: float) -> Iterator[LiveServer]:
    import asyncio

    import uvicorn

    backend = SyntheticBackend(MODEL, step_delay_s=step_delay_s)
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
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", backend, prefix)
    finally:
        server.should_exit = True
        t.join(timeout=10)


@pytest.fixture()
def live_server(redis_url: str) -> Iterator[LiveServer]:
    with _live(redis_url, step_delay_s=0.02) as s:
        yield s


@pytest.fixture(scope="module")
def live_server_module(redis_url: str) -> Iterator[LiveServer]:
    with _live(redis_url, step_delay_s=0.0) as s:
        yield s


def record_tokens(rec: RouteRecord) -> list[int]:
    return rec.token_ids.tolist()
