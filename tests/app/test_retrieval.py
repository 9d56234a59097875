"""The retrieval API and the client library against it: binary and JSON records, ``start``,
batches with missing ids, deletes, ``RoutesClient`` and ``AsyncRoutesClient`` (decoding off the
event loop; a server that defers ids never asked)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from routereplay.client import (
    BATCH_MEDIA_TYPE,
    AsyncRoutesClient,
    RawBatch,
    RouteCorruptError,
    RouteNotFoundError,
    RoutesClient,
    RouteServiceError,
    RouteShapeError,
    decode_record,
)

from .conftest import MODEL, App, running_app


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


async def test_batch_passes_stored_bytes_through(stored: App) -> None:
    http = stored.http
    ids = ["retrieval-1-0", "retrieval-1-1", "retrieval-nope-0"]
    r = await http.post("/v1/routes:batch", json={"ids": ids, "start": 3})
    assert r.status_code == 200 and r.headers["content-type"] == BATCH_MEDIA_TYPE
    raw = RawBatch.unpack(r.content)
    assert sorted(raw.manifests) == ids[:2] and raw.missing == ["retrieval-nope-0"]
    assert not raw.errors and not raw.deferred
    # The two samples share their 120-token prompt: its chunks cross HTTP once (126 rows in
    # blocks of 16: chunks 0-6 hold prompt rows only and are shared; each sample has its own 7).
    assert len(raw.chunks) == 7 + 2
    recs = await stored.store.get_many(ids[:2], start=3)
    async with AsyncRoutesClient(
        "http://testserver", transport=httpx.ASGITransport(app=stored.app)
    ) as rc:
        got = await rc.get_many(ids, start=3, missing_ok=True)
    assert got[0] == recs[0] and got[1] == recs[1] and got[2] is None
    too_many = await http.post("/v1/routes:batch", json={"ids": ["a"] * 1025})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "ids"


async def test_batch_byte_cap_defers_and_the_client_follows_up(redis_url: str) -> None:
    async with running_app(redis_url, max_batch_bytes=1) as svc:
        ids = []
        for i in range(3):
            r = await svc.http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": f"capped {i} " * 20, "max_tokens": 4},
            )
            ids.append(r.json()["choices"][0]["routed_experts"]["route_id"])
        r = await svc.http.post("/v1/routes:batch", json={"ids": ids})
        raw = RawBatch.unpack(r.content)
        # Past the cap after the first id: the others wait for a next request.
        assert list(raw.manifests) == ids[:1] and raw.deferred == ids[1:]
        async with AsyncRoutesClient(
            "http://testserver", transport=httpx.ASGITransport(app=svc.app)
        ) as rc:
            got = await rc.get_many(ids)
        assert [g.token_ids.tolist()[:7] for g in got] == [list(b"capped ")] * 3


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


async def test_corrupt_routes_are_reported_per_id(stored: App) -> None:
    import redis

    from routereplay.client import RouteCorruptError
    from routereplay.client._layout import parse_manifest

    other = await stored.http.post("/v1/completions", json={
        "model": MODEL, "prompt": "someone else entirely " * 4, "max_tokens": 3},
        headers={"X-Request-Id": "other"})  # fmt: skip
    assert other.status_code == 200
    raw = redis.Redis.from_url(stored.redis_url)
    try:
        keys = stored.store.keys
        m1 = parse_manifest("retrieval-1-1", raw.get(keys.manifest("retrieval-1-1")))
        mo = parse_manifest("other-0", raw.get(keys.manifest("other-0")))
        # retrieval-1-1's last chunk (its own, not shared) now holds another route's bytes.
        raw.set(keys.chunk(m1.digests[-1]), raw.get(keys.chunk(mo.digests[0])))
    finally:
        raw.close()
    r = await stored.http.get("/v1/routes/retrieval-1-1")
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "route_corrupt" and err["param"] == "route_id"
    # Another route's chunk declares another shape: refused before it is decompressed.
    assert "retrieval-1-1" in err["message"] and "manifest needs" in err["message"]
    # The batch still answers 200; the reader assembles and reports that one id.
    async with AsyncRoutesClient(
        "http://testserver", transport=httpx.ASGITransport(app=stored.app)
    ) as rc:
        ids = ["retrieval-1-0", "retrieval-1-1", "other-0"]
        got = await rc.get_many(ids, return_exceptions=True)
        assert isinstance(got[1], RouteCorruptError) and "retrieval-1-1" in str(got[1])
        assert got[0].token_ids[0] == ord("r") and got[2].token_ids[0] == ord("s")
        with pytest.raises(RouteCorruptError, match="retrieval-1-1"):
            await rc.get_many(ids)


async def test_async_client_decodes_off_the_event_loop(stored: App, monkeypatch) -> None:
    # A training step's records take a large fraction of a second to decode: the event loop
    # that awaits them serves the caller's other tasks meanwhile, so no chunk is decoded on it.
    import threading

    from routereplay.client import _chunks

    loop_thread = threading.get_ident()
    threads: set[int] = set()
    real_add = _chunks.ChunkDecoder.add

    def add(self, digests, blobs):  # a spy around the real decoder
        threads.add(threading.get_ident())
        return real_add(self, digests, blobs)

    monkeypatch.setattr(_chunks.ChunkDecoder, "add", add)
    direct = decode_record((await stored.http.get("/v1/routes/retrieval-1-0")).content)
    for n in (1, 4):
        async with AsyncRoutesClient(
            "http://testserver", transport=httpx.ASGITransport(app=stored.app), decode_threads=n
        ) as rc:
            got = await rc.get_many(["retrieval-1-0", "retrieval-1-1"])
            assert got[0] == direct and (await rc.get("retrieval-1-0")) == direct
    assert threads and loop_thread not in threads


async def test_a_server_deferring_ids_never_asked_cannot_loop_the_client() -> None:
    # A hostile or broken service answers every batch by deferring ids the client never asked
    # for (and one it did): only asked ids count, so the client stops with an error at once.
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        body = RawBatch(deferred=["a-0", *(f"never-{calls}-{i}" for i in range(50))]).pack()
        return httpx.Response(200, content=body, headers={"content-type": BATCH_MEDIA_TYPE})

    async with AsyncRoutesClient("http://x", transport=httpx.MockTransport(handler)) as rc:
        with pytest.raises(RouteCorruptError, match="no progress"):
            await rc.get_many(["a-0"])
    assert calls == 1


async def test_stop_cuts_both_forms_and_json_is_bounded(stored: App) -> None:
    http = stored.http
    url = "/v1/routes/retrieval-1-0"
    rec = decode_record((await http.get(url)).content)
    part = decode_record((await http.get(url, params={"start": 5, "stop": 40})).content)
    assert part.same_routes(rec.rows(5, 40)) and part.metadata["row_start"] == 5
    j = (await http.get(url, params={"start": 5, "stop": 40, "format": "json"})).json()
    assert j["token_ids"] == rec.token_ids[5:40].tolist() and len(j["experts"]) == 35
    past = decode_record((await http.get(url, params={"start": 120, "stop": 10**6})).content)
    assert past.same_routes(rec.rows(120))  # stop clipped to the route's end
    for params in ({"start": 7, "stop": 7}, {"stop": 0}):
        r = await http.get(url, params=params)
        assert r.status_code in (400, 422) and r.json()["error"]["param"] == "stop", r.text


async def test_a_json_route_over_its_row_bound_names_the_way_to_read_it(
    stored: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    from routereplay.service.serving import routes

    monkeypatch.setattr(routes, "MAX_JSON_ROWS", 64)  # the route has 126 rows
    url = "/v1/routes/retrieval-1-0"
    r = await stored.http.get(url, params={"format": "json"})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("stop", "json_rows_over_limit")
    assert "start and stop" in err["message"] and "binary" in err["message"]
    j = (await stored.http.get(url, params={"format": "json", "start": 64})).json()
    assert len(j["token_ids"]) == 62
    assert (await stored.http.get(url)).status_code == 200  # the binary form has no row bound


async def test_a_page_reads_only_the_chunks_of_its_rows(
    stored: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the route's last chunk (rows 112..126) gone, as an eviction leaves it, a page
    before it reads in either form, and a JSON read without ``stop`` reads no further than
    its row bound; what needs the lost rows is a 404."""
    import redis

    from routereplay.client._layout import parse_manifest
    from routereplay.service.serving import routes

    url = "/v1/routes/retrieval-1-0"
    rec = decode_record((await stored.http.get(url)).content)
    raw = redis.Redis.from_url(stored.redis_url)
    try:
        keys = stored.store.keys
        m = parse_manifest("retrieval-1-0", raw.get(keys.manifest("retrieval-1-0")))
        assert len(m.digests) == 8 and raw.delete(keys.chunk(m.digests[7])) == 1
    finally:
        raw.close()
    j = (await stored.http.get(url, params={"start": 16, "stop": 48, "format": "json"})).json()
    assert j["token_ids"] == rec.token_ids[16:48].tolist()
    assert j["experts"] == rec.experts[16:48].tolist() and j["prompt_len"] == 32
    j = (await stored.http.get(url, params={"stop": 112, "format": "json"})).json()
    assert j["valid"] == rec.valid[:112].tolist() and j["metadata"] == rec.metadata
    part = decode_record((await stored.http.get(url, params={"start": 3, "stop": 112})).content)
    assert part == rec.rows(3, 112)
    for params in ({}, {"format": "json"}, {"start": 100, "stop": 113, "format": "json"}):
        r = await stored.http.get(url, params=params)
        assert r.status_code == 404 and r.json()["error"]["code"] == "route_not_found", params
    # A JSON read stops one row past the larger row bound: a window over it is refused from
    # the rows read, the route's end unknown (its last chunk is never asked for).
    monkeypatch.setattr(routes, "MAX_JSON_ROWS", 32)
    monkeypatch.setattr(routes, "MAX_JSON_WEIGHT_ROWS", 16)
    for params in ({"format": "json"}, {"start": 8, "stop": 500, "format": "json"}):
        err = (await stored.http.get(url, params=params)).json()["error"]
        assert (err["param"], err["code"]) == ("stop", "json_rows_over_limit"), params
        assert f"the rows from {params.get('start', 0)} on exceed 32" in err["message"]
        assert "start and stop" in err["message"] and "binary" in err["message"]
    # Where the read reaches the caller's stop, the message gives the window's rows.
    r = await stored.http.get(url, params={"start": 8, "stop": 41, "format": "json"})
    assert "rows [8, 41) are 33" in r.json()["error"]["message"]
    j = (await stored.http.get(url, params={"start": 80, "stop": 112, "format": "json"})).json()
    assert j["token_ids"] == rec.token_ids[80:112].tolist()


async def test_the_clients_read_a_window_as_the_store_does(stored: App) -> None:
    ids = ["retrieval-1-0", "retrieval-1-1"]
    want = await stored.store.get_many(ids, start=5, stop=40)
    transport = httpx.ASGITransport(app=stored.app)
    async with AsyncRoutesClient("http://testserver", transport=transport) as rc:
        assert await rc.get(ids[0], start=5, stop=40) == want[0]
        assert await rc.get_many(ids, start=5, stop=40) == want
        assert await rc.get(ids[1], start=120, stop=10**6) == await stored.store.get(
            ids[1], start=120
        )
        with pytest.raises(RouteShapeError, match="stop=5 must be greater than start=5"):
            await rc.get_many(ids, start=5, stop=5)
