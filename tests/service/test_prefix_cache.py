"""Prefix caching: cached prompt rows come back complete and identical on the shared prefix."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from routereplay.client import decode_record

from engines import Service

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


def metric(service: Service, name: str) -> float:
    text = httpx.get(f"{service.url}/metrics").text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " "))


def test_multi_turn_rows_skipped_by_the_engine_are_filled_from_the_index(
    service: Service,
) -> None:
    rng = np.random.default_rng(77)
    turn1 = rng.integers(3, 1000, size=300).tolist()
    _, first = run(service, turn1, "turn-1")
    # Turn 2 = turn 1 + its answer + a new user message.
    turn2 = first.token_ids.tolist() + rng.integers(3, 1000, size=40).tolist()
    filled_before = metric(service, "routereplay_route_rows_filled_total")

    def run2(rid: str, start: int) -> tuple[dict, object]:
        r = httpx.post(
            f"{service.v1}/completions",
            json={"model": service.model, "prompt": turn2, "max_tokens": 4, "temperature": 0.0,
                  "ignore_eos": True, "routed_experts_prompt_start": start},
            headers={"X-Request-Id": rid}, timeout=120,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json(), decode_record(httpx.get(f"{service.url}/v1/routes/{rid}-0").content)

    _, full = run2("turn-2-full", 0)
    # The engine returns rows from 256 on; rows 0..255 (two whole 128-token blocks of turn 1)
    # come from the token-prefix index.
    r_aligned, aligned = run2("turn-2-from256", 256)
    assert complete(aligned) and aligned.same_routes(full)
    assert r_aligned["choices"][0]["routed_experts"]["num_valid_rows"] == full.num_tokens - 1
    assert metric(service, "routereplay_route_rows_filled_total") - filled_before == 256
    # From 300: rows 256..299 sit in a block turn 1 does not share whole: not recoverable,
    # so they are marked invalid (and reported), never passed off as routes.
    r_odd, odd = run2("turn-2-from300", 300)
    assert not odd.valid[256:300].any()
    assert odd.valid[:256].all() and odd.valid[300:-1].all()
    assert r_odd["choices"][0]["routed_experts"]["num_valid_rows"] == full.num_tokens - 1 - 44
    v = odd.valid
    assert np.array_equal(odd.experts[v], full.experts[v])
