"""Routes from a tensor-parallel engine: ``routereplay serve --tensor-parallel-size 2`` on the
CPU host (vLLM's CPU workers, one core each: ``--cpu-bind auto`` splits the allowed cores among
the ranks), its stored routes equal to the tiny model's router recomputed by transformers in
float32 over the same tokens, for greedy and sampled requests, a prompt of three cache blocks
and a prefix served from the cache: the rows vLLM's capture returns from a group of two ranks.
Data and expert parallel are refused on a CPU host (tests/app/test_engine_start.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from engines import Service, start_service

pytestmark = pytest.mark.vllm

PROMPT = [(11 * i + 5) % 1000 + 20 for i in range(300)]  # > 2 cache blocks of 128


@pytest.fixture(scope="module")
def tp2(redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Service]:  # fmt: skip
    log_dir = tmp_path_factory.mktemp("tp2")
    with start_service(redis_url, tiny_model, log_dir, "--tensor-parallel-size", "2") as (svc, _):
        yield svc


def router_topk(model_path: Path, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' float32 router over ``tokens``: each row's top-k experts per MoE layer
    ``[T, M, K]`` (as sets: sorted) and the margin between the k-th and the next logit."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
    top, margin = [], []
    for lg in logits:
        order = torch.argsort(lg.reshape(len(tokens), -1), dim=1, descending=True)
        vals = torch.gather(lg.reshape(len(tokens), -1), 1, order)
        top.append(torch.sort(order[:, :k], dim=1).values.numpy())
        margin.append((vals[:, k - 1] - vals[:, k]).numpy())
    return np.stack(top, axis=1), np.stack(margin, axis=1)


def complete(svc: Service, rid: str, **body: object) -> dict:
    r = httpx.post(
        f"{svc.v1}/completions",
        json={"model": svc.model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True,
              "return_token_ids": True, **body},
        headers={"X-Request-Id": rid}, timeout=300,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(("rid", "body"), [
    ("tp-greedy", {"temperature": 0}),
    ("tp-sampled", {"temperature": 1.0, "seed": 3, "n": 2}),
    ("tp-cached", {"temperature": 0}),  # the greedy prompt again: its blocks from the cache
])  # fmt: skip
def test_tp2_routes_are_the_routers(tp2: Service, rid: str, body: dict) -> None:
    resp = complete(tp2, rid, **body)
    for choice in resp["choices"]:
        handle = choice["routed_experts"]
        assert handle["status"] == "stored", handle
        rec = tp2.store().get(handle["route_id"])
        tokens = choice["prompt_token_ids"] + choice["token_ids"]
        assert rec.token_ids.tolist() == tokens and rec.valid[:-1].all()
        want, margin = router_topk(tp2.model_path, tokens)
        got = np.sort(rec.experts[:-1].astype(np.int64), axis=2)
        differ = (got != want[:-1]).any(axis=2)
        # Only a near tie may differ: the TP group's reduction order moves logits by ~1e-6.
        assert not (differ & (margin[:-1] > 1e-4)).any(), np.argwhere(differ)
        assert differ.mean() < 0.01, differ.mean()
    if rid == "tp-cached":  # the greedy request's prompt was cached on this engine
        assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
