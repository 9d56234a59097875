"""Redis faults survived, with real redis-server processes: killed and restarted (idle and under
load), paused, full. Every route is stored whole and readable or reported failed, no request
answers 5xx, and the first request after Redis is back is stored."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import redis

from routereplay.local_redis import _start, free_port

from .conftest import MODEL, App, HeldEngine, running_app, until


class Redis:
    """A redis-server on a fixed loopback port that a test can kill and start again.

    It fsyncs every write to its append-only file before answering: what Redis acknowledged
    survives SIGKILL, so "stored" must mean readable after the restart too (without persistence a
    restart empties Redis, and that is Redis's durability, not the service's)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = Path(tempfile.mkdtemp(prefix="rr-fault-"))
        self.start()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def start(self) -> None:
        self.proc = _start(self.port, self.dir, "--appendonly", "yes", "--appendfsync", "always")

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@pytest.fixture()
def server() -> Iterator[Redis]:
    r = Redis()
    try:
        yield r
    finally:
        with contextlib.suppress(Exception):
            r.kill()


BODY = {"model": MODEL, "max_tokens": 8, "return_token_ids": True}
STORED = "routereplay_routes_stored_total"
PENDING = "routereplay_route_writes_pending"
ERRORS = "routereplay_route_store_errors_total"
BACKLOG = ERRORS + '{reason="backlog"}'
# Longer than any test here takes: a pause that only the test's UNPAUSE ends.
PAUSE_MS = "600000"


async def metric_is(svc: App, name: str, value: float) -> bool:
    return await svc.metric(name) == value


async def one(svc: App, i: int, stream: bool = False) -> tuple[int, dict | None, list[int]]:
    """One completion: (status, its route handle, its tokens)."""
    r = await svc.http.post("/v1/completions", json={**BODY, "prompt": f"load {i} " * 5,
                                                     "stream": stream})  # fmt: skip
    if r.status_code != 200:
        return r.status_code, None, []
    if stream:
        import json

        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        choice = [c["choices"][0] for c in chunks if c.get("choices")]
        tokens = [t for c in choice for t in c.get("prompt_token_ids", []) + c.get("token_ids", [])]
        (h,) = [c["routed_experts"] for c in choice if c.get("finish_reason")]
        return 200, h, tokens
    c = r.json()["choices"][0]
    return 200, c["routed_experts"], c["prompt_token_ids"] + c["token_ids"]


async def verify(svc: App, results: list[tuple[int, dict | None, list[int]]]) -> dict[str, int]:
    """Every stored handle's record is readable and exactly the engine's tokens and routes."""
    counts = {"stored": 0, "failed": 0}
    for status, h, tokens in results:
        assert status == 200, status
        counts[h["status"]] += 1
        r = await svc.http.get(f"/v1/routes/{h['route_id']}")
        if h["status"] == "failed":
            assert r.status_code == 404, "a failed route must not be readable"
            continue
        assert r.status_code == 200, r.text
        from routereplay.client import decode_record

        rec = decode_record(r.content)
        assert rec.token_ids.tolist() == tokens
        assert np.array_equal(rec.experts[:-1], svc.expected_experts(tokens))
        assert rec.num_tokens == h["num_rows"] and int(rec.valid.sum()) == h["num_valid_rows"]
    return counts


async def met_the_dead_redis(svc: App) -> bool:
    """A write is waiting (retrying) or has given up: pending alone may come and go unseen
    between two polls of a stalled host."""
    return await svc.metric(PENDING) > 0 or await svc.metric(ERRORS) > 0


async def test_killed_and_restarted_while_idle(server: Redis) -> None:
    async with running_app(server.url) as svc:
        await verify(svc, [await one(svc, i) for i in range(3)])
        server.kill()
        server.start()
        # Every pooled connection died with the server: the next requests must not fail on them.
        results = await asyncio.gather(*[one(svc, 100 + i) for i in range(10)])
        assert await verify(svc, list(results)) == {"stored": 10, "failed": 0}
        assert (await svc.http.get("/ready")).status_code == 200


async def test_killed_and_restarted_under_load(server: Redis) -> None:
    """60 requests in flight, held mid-generation; a third finish before Redis dies, a third
    while it is down and restarting (their writes retry), the last third once it is back."""
    engine = HeldEngine(hold_after=4)
    async with running_app(server.url, backend=engine, store_timeout_s=60) as svc:
        load = asyncio.gather(*[one(svc, i, stream=i % 2 == 1) for i in range(60)])
        await until(lambda: engine.held == 60, "60 requests generating")
        engine.let_go(20)
        await until(partial(metric_is, svc, STORED, 20), "the first third stored")
        server.kill()
        engine.let_go(20)
        await until(partial(met_the_dead_redis, svc), "a write meeting the dead Redis")
        await asyncio.to_thread(server.start)
        engine.let_go()
        counts = await verify(svc, list(await load))
        assert counts["stored"] + counts["failed"] == 60 and counts["stored"] >= 40, counts
        # Back to normal: the first request afterwards is stored.
        assert (await one(svc, 999))[1]["status"] == "stored"


async def test_down_for_good_routes_failed_fast_enough(server: Redis) -> None:
    # The write's deadline is far off: a failure naming the connection (not TimeoutError) is
    # the retries with backoff giving up by themselves, not a hang cut short by the deadline.
    async with running_app(server.url, store_timeout_s=120) as svc:
        server.kill()
        status, h, _ = await one(svc, 1)
        assert status == 200 and h["status"] == "failed" and "Connection" in h["error"], h
        ready = await svc.http.get("/ready")
        assert ready.status_code == 503 and "redis" in ready.json()


async def test_client_pause_ready_answers_fast_and_writes_resume(server: Redis) -> None:
    async with running_app(server.url, store_timeout_s=120, ready_timeout_s=0.5) as svc:
        admin = server.client()
        try:
            admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
            # Redis stays paused until the UNPAUSE below: /ready answered on its own timeout.
            ready = await svc.http.get("/ready")
            assert ready.status_code == 503 and "0.5 s" in ready.json()["redis"], ready.text
            # A route finished during the pause waits for it and is stored.
            load = asyncio.gather(*[one(svc, i) for i in range(4)])
            await until(partial(metric_is, svc, PENDING, 4), "four writes waiting on the pause")
            assert await svc.metric(STORED) == 0
            admin.execute_command("CLIENT", "UNPAUSE")
            assert await verify(svc, list(await load)) == {"stored": 4, "failed": 0}
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
            admin.close()
        assert (await svc.http.get("/ready")).status_code == 200


async def test_full_redis_is_not_ready_and_routes_fail_whole(server: Redis) -> None:
    async with running_app(server.url) as svc:
        admin = server.client()
        try:
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", 1)
            ready = await svc.http.get("/ready")
            assert ready.status_code == 503 and "OutOfMemory" in ready.json()["redis"], ready.text
            results = [await one(svc, i) for i in range(3)]
            assert await verify(svc, results) == {"stored": 0, "failed": 3}
        finally:
            admin.config_set("maxmemory", 0)
            admin.close()
        assert (await svc.http.get("/ready")).status_code == 200
        assert (await one(svc, 9))[1]["status"] == "stored"


async def test_pending_writes_are_bounded(server: Redis) -> None:
    async with running_app(server.url, store_timeout_s=120, max_pending_writes=2) as svc:
        admin = server.client()
        try:
            admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
            load = asyncio.gather(*[one(svc, i) for i in range(6)])
            await until(partial(metric_is, svc, BACKLOG, 4), "four writes refused")
            assert await svc.metric(PENDING) == 2
            admin.execute_command("CLIENT", "UNPAUSE")
            results = await load
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
            admin.close()
        handles = [h for _, h, _ in results]
        backlog = [h for h in handles if "backlog" in (h["error"] or "")]
        # Two writes waited out the pause and were stored; the rest failed fast.
        assert len(backlog) == 4 and sum(h["status"] == "stored" for h in handles) == 2
        assert await svc.metric("routereplay_route_writes_pending") == 0
        # The two that were stored met a backlog of one, then of two (themselves included); the
        # refused ones never joined it.
        assert await svc.metric("routereplay_route_write_backlog_count") == 2
        assert await svc.metric('routereplay_route_write_backlog_bucket{le="1.0"}') == 1
        assert await svc.metric('routereplay_route_write_backlog_bucket{le="2.0"}') == 2


async def test_a_streams_choices_store_their_routes_together(server: Redis) -> None:
    """The choices of a streamed request that finish in one engine step (a GRPO group) store
    their routes at once, so the request waits for its slowest store, not for their sum: while
    Redis holds writes, all four are pending. Once it answers, each choice's finishing chunk,
    its last, carries its stored handle, and every record reads back as the engine made it."""
    import json

    async with running_app(server.url, store_timeout_s=120) as svc:
        admin = server.client()
        body = {**BODY, "prompt": "group " * 5, "n": 4, "stream": True}
        try:
            admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
            request = asyncio.ensure_future(svc.http.post("/v1/completions", json=body))
            await until(partial(metric_is, svc, PENDING, 4), "four stores pending together")
            admin.execute_command("CLIENT", "UNPAUSE")
            r = await request
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
            admin.close()
        assert r.status_code == 200, r.text
        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks if c.get("choices")]
        last = {c["index"]: c for c in choices}  # each choice's last chunk
        assert sorted(last) == [0, 1, 2, 3]
        assert all(c["finish_reason"] == "length" for c in last.values())
        assert sum(bool(c.get("finish_reason")) for c in choices) == 4  # one finishing chunk each
        results = []
        for i, c in last.items():
            mine = [ch for ch in choices if ch["index"] == i]
            tokens = [t for ch in mine for t in ch.get("prompt_token_ids", []) + ch["token_ids"]]
            results.append((200, c["routed_experts"], tokens))
        assert await verify(svc, results) == {"stored": 4, "failed": 0}
