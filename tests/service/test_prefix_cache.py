"""Prefix caching: cached prompt rows come back complete and identical on the shared prefix."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from routereplay.client import decode_record

from .conftest import Service

pytestmark = pytest.mark.vllm

_RNG = np.random.default_rng(20260101)
LONG = _RNG.integers(3, 1000, size=600).tolist()  # unique to this module: a cold cache at first
SHARED = 560
OTHER = LONG[:SHARED] + _RNG.integers(3, 1000, size=50).tolist()


def run(service: Service, prompt: list[int], rid: str) -> tuple[dict, object]:
    r = httpx.post(
        f"{service.v1}/completions",
        json={"model": service.model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
              "ignore_eos": True},
        headers={"X-Request-Id": rid}, timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    rec = decode_record(httpx.get(f"{service.url}/v1/routes/{rid}-0").content)
    return r.json(), rec


def complete(rec) -> bool:
    return bool(rec.valid[:-1].all()) and rec.num_tokens == len(rec.token_ids)


def test_same_long_prompt_twice_and_shared_prefix(service: Service) -> None:
    r1, a = run(service, LONG, "prefix-a")
    r2, b = run(service, LONG, "prefix-b")
    r3, c = run(service, OTHER, "prefix-c")
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # vLLM caches whole blocks: 512 of the 600 (and of the 560 shared) prompt tokens.
    cached_b = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached_c = r3["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached_b >= 512 and cached_c >= 512
    assert b.num_cached_tokens == cached_b and c.num_cached_tokens == cached_c
    for rec in (a, b, c):
        assert complete(rec)
    # Same prompt -> identical prompt rows (and, greedy, identical everything).
    assert np.array_equal(a.experts, b.experts) and np.array_equal(a.token_ids, b.token_ids)
    # Shared prefix -> identical rows on it, cached or not.
    assert np.array_equal(a.experts[:SHARED], c.experts[:SHARED])
    assert not np.array_equal(a.experts[SHARED:600], c.experts[SHARED:600])
