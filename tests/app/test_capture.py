"""RouteCapture against a real Redis, without an engine: what a finished choice becomes."""

from __future__ import annotations

import uuid

import numpy as np
import redis

from routereplay.client import AsyncRouteStore
from routereplay.service.capture import RouteCapture
from routereplay.service.engine import ChoiceFinished
from routereplay.service.metrics import ServiceMetrics
from routereplay.service.model_info import ModelInfo

INFO = ModelInfo(
    name="m", num_layers=3, moe_layers=(1, 2), num_experts=8, top_k=2, max_model_len=64
)


def _finished(prompt: list[int], out: list[int], row_start: int = 0) -> ChoiceFinished:
    T = len(prompt) + len(out)
    rng = np.random.default_rng(len(prompt))
    arr = np.zeros((T - 1 - row_start, 3, 2), np.uint8)
    arr[:, 1:] = np.argsort(rng.random((T - 1 - row_start, 2, 8)), axis=-1)[..., :2]
    return ChoiceFinished(
        index=0, finish_reason="length", stop_reason=None, output_token_ids=out,
        num_cached_tokens=row_start, routed_experts=arr, routes_row_start=row_start,
    )  # fmt: skip


async def test_corrupt_prefix_index_is_best_effort(closing, redis_url: str) -> None:
    prefix = f"cap{uuid.uuid4().hex[:6]}"
    async with AsyncRouteStore.from_url(redis_url, prefix=prefix, block_size=4) as store:
        cap = RouteCapture(INFO, ServiceMetrics(), timeout_s=10)
        prompt = list(range(100, 112))
        first = await cap.capture(store, "a-0", _finished(prompt, [1, 2]), prompt, "a")
        assert first.status == "stored"
        # Corrupt every chunk the index points at; a later request that skipped the cached
        # prefix (rows from 8 on) must still be stored, with the unfillable rows invalid.
        raw = closing(redis.Redis.from_url(redis_url))
        for key in raw.scan_iter(f"{prefix}:c:*"):
            raw.set(key, b"RRTE garbage", keepttl=True)
        second = await cap.capture(
            store, "b-0", _finished(prompt, [3, 4, 5], row_start=8), prompt, "b"
        )
        assert second.status == "stored", second
        rec = await store.get("b-0")
        assert not rec.valid[:8].any() and rec.valid[8:-1].all()
        assert second.num_valid_rows == int(rec.valid.sum())


async def test_unreachable_store_reports_failed_handle() -> None:
    store = AsyncRouteStore.from_url(
        "redis://127.0.0.1:1/0", socket_connect_timeout=0.5, retry=None
    )
    # A deadline far beyond the refused connection: the error must be the connection's.
    cap = RouteCapture(INFO, ServiceMetrics(), timeout_s=120)
    prompt = [5, 6, 7]
    handle = await cap.capture(store, "c-0", _finished(prompt, [8]), prompt, "c")
    assert handle.status == "failed"
    assert "RouteConnectionError" in (handle.error or "")
    await store.close()
