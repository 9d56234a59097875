"""The retrieval API and the client library against it: binary and JSON records, ``start``,
batches with missing ids, deletes, ``RoutesClient`` and ``AsyncRoutesClient``."""

from __future__ import annotations

import httpx
import msgpack
import numpy as np
import pytest

from routereplay.client import (
    BATCH_MEDIA_TYPE,
    AsyncRoutesClient,
    RouteNotFoundError,
    RoutesClient,
    RouteServiceError,
    decode_record,
)

from .conftest import MODEL, App


@pytest.fixture()
async def stored(svc: App) -> App:
    r = await svc.http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "retrieve me " * 10,
            "max_tokens": 6,
            "n": 2,
            "temperature": 1.0,
            "seed": 2,
        },
        headers={"X-Request-Id": "retrieval-1"},
    )
    assert r.status_code == 200, r.text
    return svc


async def test_get_binary_json_and_start(stored: App) -> None:
    http = stored.http
    rec = decode_record((await http.get("/v1/routes/retrieval-1-0")).content)
    j = (await http.get("/v1/routes/retrieval-1-0", params={"format": "json"})).json()
    assert j["route_id"] == "retrieval-1-0" and j["model"] == MODEL
    assert j["token_ids"] == rec.token_ids.tolist()
    assert np.array_equal(np.asarray(j["experts"], dtype=np.uint8), rec.experts)
    assert j["valid"] == rec.valid.tolist() and j["moe_layers"] == [1, 2, 3]
    assert j["prompt_len"] == rec.prompt_len == 120 and j["num_layers"] == 4
    assert j["metadata"]["request_id"] == "retrieval-1" and j["metadata"]["choice"] == 0
    j2 = (await http.get("/v1/routes/retrieval-1-0", headers={"accept": "application/json"})).json()
    assert j2["token_ids"] == j["token_ids"]
    tail = decode_record(
        (await http.get("/v1/routes/retrieval-1-0", params={"start": 118})).content
    )
    assert tail.same_routes(rec.rows(118))
    r = await http.get("/v1/routes/retrieval-1-0", params={"start": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "start"


async def test_batch_with_missing(stored: App) -> None:
    http = stored.http
    ids = ["retrieval-1-0", "retrieval-1-1", "retrieval-nope-0"]
    r = await http.post("/v1/routes:batch", json={"ids": ids, "start": 3})
    assert r.status_code == 200 and r.headers["content-type"] == BATCH_MEDIA_TYPE
    body = msgpack.unpackb(r.content, raw=False)
    assert sorted(body["records"]) == ids[:2] and body["missing"] == ["retrieval-nope-0"]
    for i in ids[:2]:
        single = decode_record((await http.get(f"/v1/routes/{i}", params={"start": 3})).content)
        assert decode_record(body["records"][i]).same_routes(single)
    too_many = await http.post("/v1/routes:batch", json={"ids": ["a"] * 1025})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "ids"


async def test_delete_keeps_shared_chunks(stored: App) -> None:
    http = stored.http
    r = await http.delete("/v1/routes/retrieval-1-1")
    assert r.json() == {"id": "retrieval-1-1", "deleted": True}
    assert (await http.get("/v1/routes/retrieval-1-1")).status_code == 404
    # The sibling sharing its prompt's chunks is intact.
    assert (await http.get("/v1/routes/retrieval-1-0")).status_code == 200


async def test_async_routes_client(stored: App) -> None:
    direct = decode_record((await stored.http.get("/v1/routes/retrieval-1-0")).content)
    async with AsyncRoutesClient(
        "http://testserver", transport=httpx.ASGITransport(app=stored.app)
    ) as rc:
        assert (await rc.get("retrieval-1-0")) == direct
        (only,) = await rc.get_many(["retrieval-1-0"], start=2)
        assert only.same_routes(direct.rows(2))
        many = await rc.get_many(["retrieval-1-0", "retrieval-none-0"], missing_ok=True)
        assert many[0] == direct and many[1] is None
        with pytest.raises(RouteNotFoundError, match="retrieval-none-0"):
            await rc.get_many(["retrieval-none-0"])
        with pytest.raises(RouteNotFoundError):
            await rc.get("retrieval-none-0")
        assert await rc.delete("retrieval-none-0") is False
        with pytest.raises(RouteServiceError, match="start"):
            await rc.get("retrieval-1-0", start=10**6)


def test_sync_routes_client_over_http(live_server) -> None:
    """RoutesClient over real HTTP (a uvicorn on loopback)."""
    body = {"model": MODEL, "prompt": "sync client", "max_tokens": 3}
    r = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=30)
    rid = r.json()["choices"][0]["routed_experts"]["route_id"]
    with RoutesClient(live_server.url) as rc:
        rec = rc.get(rid)
        assert rec.token_ids.tolist()[:11] == list(b"sync client")
        assert rc.get_many([rid])[0] == rec
        assert rc.delete(rid) is True and rc.delete(rid) is False
        with pytest.raises(RouteNotFoundError):
            rc.get(rid)
