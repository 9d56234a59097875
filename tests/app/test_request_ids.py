"""The X-Request-Id policy: generated or echoed, 409 while in flight, reusable after."""

from __future__ import annotations

import asyncio

import httpx

from .conftest import MODEL, App, running_app

BODY = {"model": MODEL, "prompt": "in flight", "max_tokens": 24}


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


async def test_in_flight_id_is_refused_then_reusable(svc: App) -> None:
    svc.backend.step_delay_s = 0.01
    headers = {"X-Request-Id": "dup-inflight"}
    first = asyncio.create_task(svc.http.post("/v1/completions", json=BODY, headers=headers))
    while svc.backend.num_unfinished() == 0:
        await asyncio.sleep(0.005)
    second = await svc.http.post("/v1/completions", json=BODY, headers=headers)
    assert second.status_code == 409, second.text
    err = second.json()["error"]
    assert err["param"] == "X-Request-Id" and err["code"] == "request_id_in_flight"
    assert "in flight" in err["message"]
    # The refused retry did not disturb the original, whose routes are stored.
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
    from routereplay.service.synthetic import SyntheticBackend

    async with running_app(redis_url) as a:
        # The replica: its own app and engine, the same route store.
        backend = SyntheticBackend(MODEL)
        await backend.start()
        replica = create_app(Settings(redis_url=redis_url), backend=backend, store=a.store)
        async with replica.router.lifespan_context(replica):
            transport = httpx.ASGITransport(app=replica)
            async with httpx.AsyncClient(transport=transport, base_url="http://r") as b:
                a.backend.step_delay_s = 0.01
                headers = {"X-Request-Id": "shared-id"}
                first = asyncio.create_task(a.http.post("/v1/completions", json=BODY,
                                                        headers=headers))  # fmt: skip
                while a.backend.num_unfinished() == 0:
                    await asyncio.sleep(0.005)
                other = await b.post("/v1/completions", json=BODY, headers=headers)
                assert other.status_code == 409, other.text
                assert (await first).status_code == 200
                await asyncio.sleep(0.05)  # the claim is released in the background
                again = await b.post("/v1/completions", json=BODY, headers=headers)
                assert again.status_code == 200


async def test_a_long_request_keeps_its_id_past_the_lease(redis_url: str) -> None:
    """The lease is renewed while the request runs: a request lasting several leases still
    holds its id on every replica, and frees it when it ends."""
    async with running_app(redis_url, request_id_lease_s=0.3) as a:
        a.backend.step_delay_s = 0.05  # 24 tokens: ~1.2 s, four leases
        headers = {"X-Request-Id": "long-one"}
        first = asyncio.create_task(a.http.post("/v1/completions", json=BODY, headers=headers))
        while a.backend.num_unfinished() == 0:
            await asyncio.sleep(0.005)
        key = a.store.keys.claim("long-one")
        await asyncio.sleep(0.8)
        assert not first.done()
        assert await a.store.redis.exists(key), "the lease lapsed while its request ran"
        assert 0 < await a.store.redis.pttl(key) <= 300
        assert (await first).status_code == 200
        await asyncio.sleep(0.05)
        assert not await a.store.redis.exists(key), "not released at the end"


async def test_a_dead_replicas_ids_lapse_within_one_lease(redis_url: str) -> None:
    """A replica that dies mid-request renews nothing: its ids are free again after one
    lease, so a client's retry on another replica is accepted."""
    from routereplay.service.request_ids import RequestIds

    async with running_app(redis_url, request_id_lease_s=0.4) as a:
        dead = RequestIds(max_age_s=600, lease_s=0.4)
        await dead.claim(a.store, "orphan")
        await dead.aclose()  # the replica is gone: no renewal, no release
        refused = await a.http.post("/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "orphan"})  # fmt: skip
        assert refused.status_code == 409
        await asyncio.sleep(0.5)
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
