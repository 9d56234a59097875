"""Retrieval API: binary and JSON get, start offset, batch with missing ids, delete."""

from __future__ import annotations

import httpx
import msgpack
import numpy as np
import pytest

from routereplay.client import decode_record

from .conftest import Service

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def stored(service: Service) -> dict:
    """One completion with n=2 (two routes) for this module."""
    r = httpx.post(
        f"{service.v1}/completions",
        json={"model": service.model, "prompt": "retrieve me " * 10, "max_tokens": 6, "n": 2,
              "temperature": 1.0, "seed": 2, "ignore_eos": True},
        headers={"X-Request-Id": "retrieval-1"}, timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_get_binary_json_and_start(http: httpx.Client, stored: dict) -> None:
    rec = decode_record(http.get("/v1/routes/retrieval-1-0").content)
    j = http.get("/v1/routes/retrieval-1-0", params={"format": "json"}).json()
    assert j["route_id"] == "retrieval-1-0"
    assert j["token_ids"] == rec.token_ids.tolist()
    assert np.array_equal(np.asarray(j["experts"], dtype=np.uint8), rec.experts)
    assert j["valid"] == rec.valid.tolist() and j["moe_layers"] == [0, 1, 2, 3]
    assert j["prompt_len"] == rec.prompt_len and j["num_experts"] == 8 and j["num_layers"] == 4
    j2 = http.get("/v1/routes/retrieval-1-0", headers={"accept": "application/json"}).json()
    assert j2["token_ids"] == j["token_ids"]
    start = rec.prompt_len - 2
    tail = decode_record(http.get("/v1/routes/retrieval-1-0", params={"start": start}).content)
    assert tail.same_routes(rec.rows(start))


def test_batch_with_missing(http: httpx.Client, stored: dict) -> None:
    ids = ["retrieval-1-0", "retrieval-1-1", "retrieval-nope-0"]
    r = http.post("/v1/routes:batch", json={"ids": ids, "start": 3})
    assert r.status_code == 200
    body = msgpack.unpackb(r.content, raw=False)
    assert sorted(body["records"]) == ids[:2] and body["missing"] == ["retrieval-nope-0"]
    for i in ids[:2]:
        single = decode_record(http.get(f"/v1/routes/{i}", params={"start": 3}).content)
        assert decode_record(body["records"][i]).same_routes(single)


def test_delete(http: httpx.Client, stored: dict) -> None:
    assert http.get("/v1/routes/retrieval-1-1").status_code == 200
    r = http.delete("/v1/routes/retrieval-1-1")
    assert r.json() == {"id": "retrieval-1-1", "deleted": True}
    assert http.get("/v1/routes/retrieval-1-1").status_code == 404
    # The sibling sharing its prefix chunks is intact.
    assert http.get("/v1/routes/retrieval-1-0").status_code == 200


def test_routes_client_against_service(service: Service, stored: dict) -> None:
    from routereplay.client import RouteNotFoundError, RoutesClient

    direct = decode_record(httpx.get(f"{service.url}/v1/routes/retrieval-1-0").content)
    with RoutesClient(service.url) as rc:
        rec = rc.get("retrieval-1-0")
        assert rec == direct
        assert rc.get("retrieval-1-0", start=4).same_routes(direct.rows(4))
        many = rc.get_many(["retrieval-1-0", "retrieval-none-0"], missing_ok=True)
        assert many[0].same_routes(direct) and many[1] is None
        with pytest.raises(RouteNotFoundError, match="retrieval-none-0"):
            rc.get("retrieval-none-0")
        assert rc.delete("retrieval-none-0") is False


async def test_async_routes_client_against_service(service: Service, stored: dict) -> None:
    from routereplay.client import AsyncRoutesClient, RouteNotFoundError

    direct = decode_record(httpx.get(f"{service.url}/v1/routes/retrieval-1-0").content)
    async with AsyncRoutesClient(service.url) as rc:
        assert (await rc.get("retrieval-1-0")) == direct
        (only,) = await rc.get_many(["retrieval-1-0"], start=2)
        assert only.same_routes(direct.rows(2))
        with pytest.raises(RouteNotFoundError):
            await rc.get_many(["retrieval-none-0"])
