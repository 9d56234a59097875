"""The X-Request-Id policy: generated or echoed, 409 while in flight, reusable after."""

from __future__ import annotations

import asyncio
from functools import partial

import httpx
import pytest
from redis.asyncio import Redis

from routereplay.service.errors import ConflictError
from routereplay.service.request_ids import RequestIds

from .conftest import MODEL, App, HeldEngine, ManualClock, running_app, until

BODY = {"model": MODEL, "prompt": "in flight", "max_tokens": 24}


async def redis_now(redis: Redis) -> int:
    """Redis's clock, Unix ms (the clock its key expiry runs on)."""
    s, us = await redis.time()
    return s * 1000 + us // 1000


async def redis_ms(redis: Redis, after: int) -> bool:
    """Redis's clock is past ``after`` (Unix ms)."""
    return await redis_now(redis) > after


async def expiry_ms(redis: Redis, key: str, after: int | None = None) -> int | bool:
    """When ``key`` expires (Unix ms); with ``after``: whether that is later than ``after``."""
    t = await redis.execute_command("PEXPIRETIME", key)
    return t if after is None else t > after


async def gone(redis: Redis, key: str) -> bool:
    return not await redis.exists(key)


async def test_generated_and_echoed_ids(svc: App) -> None:
    r = await svc.http.post("/v1/completions", json=BODY)
    rid = r.json()["id"]
    assert rid.startswith("cmpl-") and r.headers["x-request-id"] == rid
    r = await svc.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    )
    assert r.json()["id"].startswith("chatcmpl-")
    r = await svc.http.post("/v1/completions", json=BODY, headers={"X-Request-Id": "mine.1:a-b"})
    assert r.json()["id"] == "mine.1:a-b" and r.headers["x-request-id"] == "mine.1:a-b"
    assert r.json()["choices"][0]["routed_experts"]["route_id"] == "mine.1:a-b-0"


async def test_in_flight_id_is_refused_then_reusable(held_svc: App) -> None:
    svc, engine = held_svc, held_svc.backend
    assert isinstance(engine, HeldEngine)
    headers = {"X-Request-Id": "dup-inflight"}
    first = asyncio.create_task(svc.http.post("/v1/completions", json=BODY, headers=headers))
    await until(lambda: engine.held == 1, "the first request generating")
    second = await svc.http.post("/v1/completions", json=BODY, headers=headers)
    assert second.status_code == 409, second.text
    err = second.json()["error"]
    assert err["param"] == "X-Request-Id" and err["code"] == "request_id_in_flight"
    assert "in flight" in err["message"]
    # The refused retry did not disturb the original, whose routes are stored.
    engine.let_go()
    r1 = await first
    h = r1.json()["choices"][0]["routed_experts"]
    assert r1.status_code == 200 and h["status"] == "stored"
    tokens1 = (await svc.http.get("/v1/routes/dup-inflight-0?format=json")).json()["token_ids"]
    # Once finished, reusing the id is an idempotent overwrite (a retry).
    again = await svc.http.post(
        "/v1/completions", json={**BODY, "prompt": "other"}, headers=headers
    )
    assert again.status_code == 200
    tokens2 = (await svc.http.get("/v1/routes/dup-inflight-0?format=json")).json()["token_ids"]
    assert tokens2 != tokens1 and tokens2[:5] == list(b"other")


async def test_streamed_id_is_held_until_the_stream_ends(svc: App) -> None:
    headers = {"X-Request-Id": "dup-stream"}
    r = await svc.http.post("/v1/completions", json={**BODY, "stream": True}, headers=headers)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    # Released when the stream finished: the id is free again.
    r = await svc.http.post("/v1/completions", json=BODY, headers=headers)
    assert r.status_code == 200


async def test_refused_request_releases_its_id(svc: App) -> None:
    headers = {"X-Request-Id": "dup-refused"}
    bad = await svc.http.post(
        "/v1/completions", json={**BODY, "max_tokens": 10**6}, headers=headers
    )
    assert bad.status_code == 400
    ok = await svc.http.post("/v1/completions", json=BODY, headers=headers)
    assert ok.status_code == 200


async def test_claims_hold_across_replicas(redis_url: str) -> None:
    """Two service replicas over one Redis: an id in flight on one is refused on the other."""
    from routereplay.service import Settings, create_app
    from routereplay.service.engines.synthetic import SyntheticBackend

    engine = HeldEngine()
    async with running_app(redis_url, backend=engine) as a:
        # The replica: its own app and engine, the same route store.
        backend = SyntheticBackend(MODEL)
        await backend.start()
        replica = create_app(Settings(redis_url=redis_url), backend=backend, store=a.store)
        async with replica.router.lifespan_context(replica):
            transport = httpx.ASGITransport(app=replica)
            async with httpx.AsyncClient(transport=transport, base_url="http://r") as b:
                headers = {"X-Request-Id": "shared-id"}
                first = asyncio.create_task(a.http.post("/v1/completions", json=BODY,
                                                        headers=headers))  # fmt: skip
                await until(lambda: engine.held == 1, "the request on A generating")
                other = await b.post("/v1/completions", json=BODY, headers=headers)
                assert other.status_code == 409, other.text
                engine.let_go()
                assert (await first).status_code == 200
                # The claim was given back before A answered: a retry right after is taken.
                again = await b.post("/v1/completions", json=BODY, headers=headers)
                assert again.status_code == 200


async def test_a_claim_retried_after_a_lost_reply_is_its_own(svc: App) -> None:
    """The connection's Retry sends a claim again when its reply was lost: the lease it already
    took must read as taken by it, not as a conflict (a spurious 409 for a whole lease)."""
    store = svc.store
    assert await store.claim("retried", "token-a", 30)
    assert await store.claim("retried", "token-a", 30)  # the same claim, sent again
    assert not await store.claim("retried", "token-b", 30)  # another holder is still refused
    assert await store.release("retried", "token-a")
    assert await store.claim("retried", "token-b", 30)


async def test_a_long_request_keeps_its_id_past_the_lease(redis_url: str) -> None:
    """The lease is renewed while the request runs: a request lasting several leases still
    holds its id on every replica, and frees it when it ends.

    The leases pass on the service's clock, stepped by the test; in Redis the lease is long
    enough that only a missing renewal, never a slow machine, could let it lapse here. Each
    renewal shows as a later expiry time in Redis."""
    lease = 30.0
    clock, engine = ManualClock(), HeldEngine()
    async with running_app(redis_url, backend=engine, clock=clock, request_id_lease_s=lease) as a:
        redis = a.store.redis
        headers = {"X-Request-Id": "long-one"}
        first = asyncio.create_task(a.http.post("/v1/completions", json=BODY, headers=headers))
        await until(lambda: engine.held == 1, "the request generating")
        key = a.store.keys.claim("long-one")
        expiry = await expiry_ms(redis, key)
        for renewal in range(12):  # four leases
            await until(lambda: clock.wakes == [clock.now + lease / 3], "the renewer asleep")
            # A renewal in the millisecond of the last one would not move the expiry.
            last_set = expiry - int(lease * 1000)
            await until(partial(redis_ms, redis, after=last_set), "Redis's clock moving on")
            clock.advance(lease / 3)
            before = expiry
            await until(partial(expiry_ms, redis, key, after=before), f"renewal {renewal + 1}")
            expiry = await expiry_ms(redis, key)
        assert not first.done()
        assert 0 < await redis.pttl(key) <= lease * 1000
        # Another replica (its own RequestIds, the same Redis) is refused the id.
        other = RequestIds(max_age_s=600, lease_s=lease)
        with pytest.raises(ConflictError):
            await other.claim(a.store, "long-one")
        await other.aclose()
        engine.let_go()
        assert (await first).status_code == 200
        assert not await redis.exists(key), "not released at the end"


async def test_a_dead_replicas_ids_lapse_within_one_lease(redis_url: str) -> None:
    """A replica that dies mid-request renews nothing: its ids are refused while its lease
    lasts, then free again, so a client's retry on another replica is accepted."""
    async with running_app(redis_url) as a:
        redis = a.store.redis
        # A lease of a minute here (longer than any stall), so the refusal is certain.
        clock = ManualClock()
        dead = RequestIds(max_age_s=600, lease_s=60, clock=clock)
        before = await redis_now(redis)
        await dead.claim(a.store, "orphan-held")
        after = await redis_now(redis)
        await dead.aclose()  # the replica is gone: no renewal, no release
        assert clock.wakes == [], "a renewal is still scheduled"
        # Its lease ends one lease after the claim, and nothing will move that.
        expiry = await expiry_ms(redis, a.store.keys.claim("orphan-held"))
        assert before + 60_000 <= expiry <= after + 60_000
        refused = await a.http.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "orphan-held"})  # fmt: skip
        assert refused.status_code == 409
        # Once a lease lapses (a short one here), the id is free for a retry.
        dead = RequestIds(max_age_s=600, lease_s=0.2)
        await dead.claim(a.store, "orphan")
        await dead.aclose()
        key = a.store.keys.claim("orphan")
        await until(partial(gone, redis, key), "the dead replica's lease lapsing")
        again = await a.http.post("/v1/completions", json=BODY,
                                  headers={"X-Request-Id": "orphan"})  # fmt: skip
        assert again.status_code == 200, again.text


async def test_reuse_with_fewer_choices_retires_the_extra_routes(svc: App) -> None:
    headers = {"X-Request-Id": "shrink"}
    r = await svc.http.post("/v1/completions", json={**BODY, "n": 3, "temperature": 1.0},
                            headers=headers)  # fmt: skip
    assert [c["routed_experts"]["status"] for c in r.json()["choices"]] == ["stored"] * 3
    r = await svc.http.post("/v1/completions", json={**BODY, "n": 1}, headers=headers)
    assert r.status_code == 200
    assert (await svc.http.get("/v1/routes/shrink-0")).status_code == 200
    for i in (1, 2):
        # Left over, they would pass for routes of the new generation.
        assert (await svc.http.get(f"/v1/routes/shrink-{i}")).status_code == 404
    # A refused request under the id leaves the current generation alone.
    bad = await svc.http.post("/v1/completions", json={**BODY, "n": 2, "temperature": 0},
                              headers=headers)  # fmt: skip
    assert bad.status_code == 400
    assert (await svc.http.get("/v1/routes/shrink-0")).status_code == 200
