"""Reader limits at every reader: a stored record that declares more than a reader's
``ReadLimits`` is refused for that id alone, before any of its chunks is read or decoded
(RouteStore, the service's GET and batch endpoints, and a client over the batch bytes)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from routereplay.client import (
    AsyncRouteStore,
    RawBatch,
    ReadLimits,
    RouteLimitError,
    RouteRecord,
    RouteStore,
)
from routereplay.client._layout import finish_read, plan_read
from routereplay.service.errors import RouteTooLargeResponse
from routereplay.service.protocol import BatchRoutesRequest
from routereplay.service.serving.routes import ServingRoutes

LIMITS = ReadLimits(max_rows=64)


def _record(T: int) -> RouteRecord:
    rng = np.random.default_rng(T)
    return RouteRecord(
        token_ids=rng.integers(0, 1000, T), experts=rng.integers(0, 16, (T, 2, 4)).astype(np.uint8),
        valid=np.ones(T, bool), moe_layers=(0, 1), num_layers=2, num_experts=16,
    )  # fmt: skip


def test_a_store_refuses_only_the_record_over_its_limits(redis_url: str) -> None:
    store = RouteStore.from_url(redis_url, prefix=f"rl{uuid.uuid4().hex[:6]}", limits=LIMITS)
    try:
        store.put("big", _record(65))
        store.put("small", _record(64))
        big, small = store.get_many(["big", "small"], return_exceptions=True)
        assert isinstance(big, RouteLimitError) and "max_rows=64" in str(big)
        assert small == _record(64)
        with pytest.raises(RouteLimitError):
            store.get("big")
        # A tail read is sized by the whole record's manifest, as its chunks are.
        with pytest.raises(RouteLimitError):
            store.get("big", start=60)
    finally:
        store.close()
    plain = RouteStore.from_url(redis_url, prefix=store.keys.prefix)
    try:
        assert plain.get("big") == _record(65)  # the default limits read it
    finally:
        plain.close()


async def test_the_service_refuses_a_route_over_its_limits(redis_url: str) -> None:
    prefix = f"rl{uuid.uuid4().hex[:6]}"
    store = AsyncRouteStore.from_url(redis_url, prefix=prefix, limits=LIMITS)
    try:
        await store.put("big", _record(100))
        await store.put("small", _record(10))
        serving = ServingRoutes(max_batch_ids=16, max_batch_bytes=1 << 20)
        with pytest.raises(RouteTooLargeResponse, match="max_rows=64"):
            await serving.get(store, "big", 0, False)
        resp = await serving.batch(store, BatchRoutesRequest(ids=["big", "small"]))
        raw = RawBatch.unpack(resp.body)
    finally:
        await store.close()
    # The id over the limits crosses as its error alone (code route_too_large), no bytes.
    assert isinstance(raw.errors["big"], RouteLimitError) and "big" not in raw.manifests
    (small,) = finish_read(plan_read(["small"], [raw.manifests["small"]]), raw.chunks)
    assert small == _record(10)
