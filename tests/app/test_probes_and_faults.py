"""Probes, metrics, and what a client sees when the engine or the store fails."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import threading

import pytest

from routereplay.local_redis import redis_server

from .conftest import MODEL, App, HeldEngine, ManualClock, running_app, until

BODY = {"model": MODEL, "prompt": "probe", "max_tokens": 3}


def events(text: str) -> list[str]:
    return [ln[len("data: ") :] for ln in text.splitlines() if ln.startswith("data: ")]


async def test_health_ready_metrics(svc: App) -> None:
    assert (await svc.http.get("/health")).json() == {"status": "ok"}
    assert (await svc.http.get("/ready")).json() == {"status": "ready"}
    for stream in (False, True):
        await svc.http.post("/v1/completions", json={**BODY, "stream": stream})
    await svc.http.post("/v1/completions", json={**BODY, "max_tokens": 0})
    text = (await svc.http.get("/metrics")).text
    for name in (
        "routereplay_requests_total",
        "routereplay_request_latency_seconds_bucket",
        "routereplay_prompt_tokens_total",
        "routereplay_completion_tokens_total",
        "routereplay_route_bytes_stored_total",
        "routereplay_route_store_errors_total",
        "routereplay_engine_queue_depth",
        "routereplay_requests_inflight",
    ):
        assert name in text, name
    assert await svc.metric("routereplay_routes_stored_total") == 2
    # Each stored choice's wait for the store is one observation.
    assert await svc.metric("routereplay_route_store_seconds_count") == 2
    assert 0 < await svc.metric("routereplay_route_store_seconds_sum") < 10
    assert await svc.metric("routereplay_completion_tokens_total") == 6
    assert await svc.metric('routereplay_requests_total{endpoint="completions",status="200"}') == 2
    assert await svc.metric("routereplay_requests_inflight") == 0


async def test_the_metrics_page_renders_off_the_event_loop(
    svc: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    from routereplay.service.routers import probes

    rendered_on = []
    real = probes.generate_latest

    def spy(registry):
        rendered_on.append(threading.get_ident())
        return real(registry)

    monkeypatch.setattr(probes, "generate_latest", spy)
    r = await svc.http.get("/metrics")
    assert r.status_code == 200 and "routereplay_requests_total" in r.text
    assert rendered_on and threading.get_ident() not in rendered_on


async def test_startup_heap_frozen_and_full_collections_timed(redis_url: str) -> None:
    """While the app serves, what it loaded at start is out of the collector's walks (a full
    collection there held every stream) and each collection is on /metrics by generation;
    after it, the host process's heap is whole again."""
    full = 'routereplay_gc_pause_seconds_count{generation="2"}'
    async with running_app(redis_url) as svc:
        assert gc.get_freeze_count() > 10_000
        # Frozen objects still leave when their last reference goes: the count only falls.
        assert await svc.metric("routereplay_gc_frozen_objects") >= gc.get_freeze_count()
        before = await svc.metric(full)
        assert before == 1  # the collection before the freeze
        garbage = [[] for _ in range(1000)]
        for a, b in itertools.pairwise(garbage):
            a.append(b), b.append(a)  # cycles: only the collector frees them
        del garbage
        gc.collect()
        assert await svc.metric(full) == before + 1
        assert 0 < await svc.metric('routereplay_gc_pause_seconds_sum{generation="2"}') < 60
        await svc.http.post("/v1/completions", json=BODY)
        young = 'routereplay_gc_pause_seconds_count{generation="0"}'
        gc.collect(0)
        assert await svc.metric(young) >= 1
    assert gc.get_freeze_count() == 0
    assert all(cb.__qualname__ != "GcPauses._on_gc" for cb in gc.callbacks)


async def test_a_store_not_opened_from_a_url_is_refused_at_start(redis_url: str) -> None:
    """Route workers open their own store from its address: a store built around a client,
    which has none, is refused at start with one line, not found out route by route."""
    import redis.asyncio as aioredis

    from routereplay.client import AsyncRouteStore
    from routereplay.service import Settings, create_app
    from routereplay.service.engines.synthetic import SyntheticBackend
    from routereplay.service.errors import StartupRefused

    backend = SyntheticBackend(MODEL)
    store = AsyncRouteStore(aioredis.Redis.from_url(redis_url), prefix="bare")
    app = create_app(Settings(redis_url=redis_url, route_prefix="bare"), backend=backend,
                     store=store)  # fmt: skip
    await backend.start()
    try:
        with pytest.raises(StartupRefused, match="not opened from a URL"):
            async with app.router.lifespan_context(app):
                pass
        assert "not opened from a URL" in app.state.refused
    finally:
        await store.close()
        await backend.close()


async def test_engine_death_mid_stream_then_503(held_svc: App) -> None:
    svc, engine = held_svc, held_svc.backend
    assert isinstance(engine, HeldEngine)
    engine.hold_after = 3
    stream = asyncio.create_task(
        svc.http.post(
            "/v1/completions",
            json={**BODY, "max_tokens": 500, "stream": True},
            headers={"X-Request-Id": "doomed"},
        )
    )
    # Three tokens streamed, then the engine dies under the running request.
    await until(lambda: engine.held == 1, "the request streaming its first tokens")
    engine.kill()
    engine.let_go()
    r = await stream
    ev = events(r.text)
    assert ev[-1] == "[DONE]"
    err = json.loads(ev[-2])["error"]
    assert err["type"] == "engine_unavailable" and err["code"] == "engine_dead"
    assert sum(len(json.loads(e)["choices"][0]["text"]) for e in ev[:-2]) == 3
    # Later requests fail fast with 503; probes say so; nothing was stored.
    r = await svc.http.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
    assert (await svc.http.get("/health")).status_code == 503
    ready = await svc.http.get("/ready")
    assert ready.status_code == 503 and "engine" in ready.json()
    assert (await svc.http.get("/v1/routes/doomed-0")).status_code == 404
    assert await svc.metric('routereplay_requests_total{endpoint="completions",status="503"}') == 2


async def test_unexpected_failure_mid_stream_ends_the_stream_well(svc: App, caplog) -> None:
    fault = svc.backend.fault = RuntimeError("boom in the engine")
    r = await svc.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True},
    )
    ev = events(r.text)
    assert ev[-1] == "[DONE]"
    err = json.loads(ev[-2])["error"]
    assert err["type"] == "internal_error" and "RuntimeError" in err["message"]
    assert "boom" not in err["message"]  # details go to the log, not to clients
    # ...with the traceback: the log record carries the engine's exception itself.
    assert any(r.exc_info and r.exc_info[1] is fault for r in caplog.records)
    assert await svc.metric('routereplay_requests_total{endpoint="chat",status="500"}') == 1
    # Not streamed: a 500 in the schema.
    r = await svc.http.post("/v1/completions", json=BODY)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"


async def test_store_down_routes_failed_completions_served(redis_url: str) -> None:
    with redis_server() as url:
        cm = running_app(url, store_timeout_s=2)
        svc = await cm.__aenter__()
    try:
        # Its redis-server is gone: the completion is served, its route reported failed.
        r = await svc.http.post("/v1/completions", json=BODY, headers={"X-Request-Id": "nostore"})
        assert r.status_code == 200
        h = r.json()["choices"][0]["routed_experts"]
        assert h["status"] == "failed" and h["num_valid_rows"] == 0 and h["error"], h
        assert await svc.metric("routereplay_route_store_errors_total") == 1
        ready = await svc.http.get("/ready")
        assert ready.status_code == 503 and "redis" in ready.json()
        r = await svc.http.get("/v1/routes/nostore-0")
        assert r.status_code == 503 and r.json()["error"]["type"] == "store_unavailable"
    finally:
        await cm.__aexit__(None, None, None)


async def test_redis_full_routes_reported_failed_never_half_written() -> None:
    import redis

    with redis_server() as url:
        async with running_app(url, store_timeout_s=5) as svc:
            ok = await svc.http.post("/v1/completions", json=BODY)
            assert ok.json()["choices"][0]["routed_experts"]["status"] == "stored"
            r = redis.Redis.from_url(url)
            # Redis full: every write is refused (reads still work), mid-put if need be.
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", 1)
            try:
                for stream in (False, True):
                    rid = f"full-{int(stream)}"
                    resp = await svc.http.post("/v1/completions", json={**BODY, "stream": stream},
                                               headers={"X-Request-Id": rid})  # fmt: skip
                    assert resp.status_code == 200
                    if stream:
                        chunks = [json.loads(e) for e in events(resp.text) if e.startswith("{")]
                        (h,) = [
                            c["choices"][0]["routed_experts"]
                            for c in chunks
                            if c["choices"] and c["choices"][0].get("finish_reason")
                        ]
                    else:
                        h = resp.json()["choices"][0]["routed_experts"]
                    # The completion is served; its routes are reported failed, with the reason...
                    assert h["status"] == "failed" and h["num_valid_rows"] == 0, h
                    assert "OOM" in h["error"] or "memory" in h["error"], h
                    # ...and no partial record is readable under its id.
                    assert (await svc.http.get(f"/v1/routes/{rid}-0")).status_code == 404
            finally:
                r.config_set("maxmemory", 0)
                r.close()
            assert await svc.metric("routereplay_route_store_errors_total") == 2
            again = await svc.http.post("/v1/completions", json=BODY)
            assert again.json()["choices"][0]["routed_experts"]["status"] == "stored"


async def test_engine_death_is_fatal_after_the_grace_period(redis_url: str) -> None:
    import httpx

    from routereplay.service import Settings, create_app
    from routereplay.service.app import ENGINE_CHECK_INTERVAL_S as LOOK
    from routereplay.service.engines.synthetic import SyntheticBackend

    grace = 30.0
    clock = ManualClock()
    fatal: list[str] = []
    backend = SyntheticBackend(MODEL)
    await backend.start()
    settings = Settings(redis_url=redis_url, route_prefix="fatal", engine_death_grace_s=grace)
    app = create_app(settings, backend=backend, on_fatal=fatal.append, clock=clock)

    async def watcher_sleeps(seconds: float) -> None:
        """The watcher has acted on what it saw and sleeps ``seconds`` on the clock."""
        await until(lambda: clock.wakes == [clock.now + seconds], f"the watcher asleep {seconds}")

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            # Alive: the watcher looks again and again, and nothing happens.
            for _ in range(5):
                await watcher_sleeps(LOOK)
                clock.advance(LOOK)
            await watcher_sleeps(LOOK)
            assert not fatal
            # Dead: its next look sees it, and it waits out the grace period...
            backend.kill()
            clock.advance(LOOK)
            await watcher_sleeps(grace)
            assert not fatal
            # ...meanwhile the service answers 503...
            assert (await c.get("/health")).status_code == 503
            clock.advance(grace / 2)
            assert not fatal and clock.wakes
            # ...and once it is over, the service is told to stop.
            clock.advance(grace)
            await until(lambda: fatal, "on_fatal after the grace period")
            assert "engine died" in fatal[0]


@pytest.mark.parametrize("path", ["/health", "/ready", "/v1/models"])
async def test_probes_before_the_lifespan_are_503(path: str, redis_url: str) -> None:
    import httpx

    from routereplay.service import Settings, create_app

    app = create_app(Settings(redis_url=redis_url, backend="synthetic"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get(path)
    assert r.status_code == 503 and r.json()["error"]["code"] == "starting"
