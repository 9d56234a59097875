"""Records with routing weights through the retrieval API: binary and JSON records, ``start``,
and batches (``RoutesClient.get_many`` assembling the stored chunks), weights bit for bit."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np

from routereplay.bench.store import softmax_routes
from routereplay.client import AsyncRoutesClient, RawBatch, RouteRecord, decode_record

from .conftest import App

E, K, MOE = 64, 4, (1, 2, 3)


def weighted(tokens: np.ndarray, seed: int, prompt_len: int) -> RouteRecord:
    ex, w = softmax_routes(np.random.default_rng(seed), len(tokens), len(MOE), E, K)
    valid = np.ones(len(tokens), bool)
    valid[-1], ex[-1], w[-1] = False, 0, 0
    return RouteRecord(
        token_ids=tokens, experts=ex, valid=valid, moe_layers=MOE, num_layers=4, num_experts=E,
        prompt_len=prompt_len, model="weighted", weights=w, weights_dtype="bfloat16",
    )  # fmt: skip


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


async def _stored_group(svc: App) -> tuple[RouteRecord, RouteRecord]:
    """Two samples of one 40-token prompt (its ids and weights alike), stored by the app's store."""
    prompt = weighted(np.arange(1000, 1040), 1, 40)
    a = weighted(np.concatenate([prompt.token_ids, [1, 2, 3, 4, 5]]), 2, 40)
    b = weighted(np.concatenate([prompt.token_ids, [6, 7, 8]]), 3, 40)
    a, b = (
        dataclasses.replace(
            r,
            experts=np.concatenate([prompt.experts[:40], r.experts[40:]]),
            weights=np.concatenate([prompt.weights[:40], r.weights[40:]]),
        )
        for r in (a, b)
    )
    await svc.store.put("weighted-a", a)
    await svc.store.put("weighted-b", b)
    return a, b


async def test_get_binary_and_json_carry_the_weights(svc: App) -> None:
    a, _ = await _stored_group(svc)
    got = decode_record((await svc.http.get("/v1/routes/weighted-a")).content)
    assert got == a and same_bits(got.weights, a.weights)
    r = await svc.http.get("/v1/routes/weighted-a", params={"start": 17})
    tail = decode_record(r.content)
    assert tail == a.rows(17)
    j = (await svc.http.get("/v1/routes/weighted-a", params={"format": "json"})).json()
    assert j["weights_dtype"] == "bfloat16"
    assert same_bits(np.asarray(j["weights"], np.float32), a.weights)  # floats are exact in JSON
    assert np.array_equal(np.asarray(j["experts"]), a.experts)


async def test_batch_shares_the_prompt_and_assembles_weights(svc: App) -> None:
    a, b = await _stored_group(svc)
    r = await svc.http.post("/v1/routes:batch", json={"ids": ["weighted-a", "weighted-b"]})
    raw = RawBatch.unpack(r.content)
    assert len(raw.chunks) == 4  # two 16-row prompt chunks once, then each sample's last chunk
    async with AsyncRoutesClient(
        "http://testserver", transport=httpx.ASGITransport(app=svc.app)
    ) as rc:
        got_a, got_b = await rc.get_many(["weighted-a", "weighted-b"])
        assert got_a == a and got_b == b
        part_a, part_b = await rc.get_many(["weighted-a", "weighted-b"], start=20)
        assert same_bits(part_a.weights, a.weights[20:]) and part_b == b.rows(20)
