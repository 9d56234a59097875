"""Stored routes equal, bit for bit, what vLLM's offline ``LLM.generate`` returns (float32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from routereplay.bench.servers import engine_env
from routereplay.client import decode_record

from engines import Service

pytestmark = pytest.mark.vllm

REQUESTS = [
    # (endpoint, body without model, sampling for the offline run)
    ("completions", {"prompt": list(range(40, 90)), "max_tokens": 12, "temperature": 1.0,
                     "seed": 42, "n": 1}),
    ("chat/completions", {"messages": [{"role": "user", "content": "exact routes, please"}],
                          "max_tokens": 10, "temperature": 0.0, "n": 1}),
    ("completions", {"prompt": "two sampled choices share the prompt", "max_tokens": 8,
                     "temperature": 1.0, "seed": 5, "n": 2}),
]  # fmt: skip


def prompt_ids_of(resp: dict) -> list[int]:
    """As vLLM: chat responses carry the prompt's ids, completions carry them per choice."""
    return resp.get("prompt_token_ids") or resp["choices"][0]["prompt_token_ids"]


@pytest.fixture(scope="module")
def served(service: Service) -> list[dict]:
    out = []
    for i, (ep, body) in enumerate(REQUESTS):
        r = httpx.post(
            f"{service.v1}/{ep}",
            json={"model": service.model, "ignore_eos": True, "return_token_ids": True, **body},
            headers={"X-Request-Id": f"exact-{i}"}, timeout=120,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


@pytest.fixture(scope="module")
def offline(served: list[dict], service: Service, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("offline")
    reqs = [
        {"prompt_token_ids": prompt_ids_of(resp), "seed": body.get("seed"),
         "temperature": body["temperature"], "max_tokens": body["max_tokens"], "n": body["n"]}
        for resp, (_, body) in zip(served, REQUESTS, strict=True)
    ]  # fmt: skip
    (d / "in.json").write_text(json.dumps(reqs))
    script = Path(__file__).with_name("_offline_generate.py")
    p = subprocess.run(
        [sys.executable, str(script), str(service.model_path), str(d / "in.json"),
         str(d / "o.npz")],
        env=engine_env(), capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return dict(np.load(d / "o.npz"))


def test_routes_and_tokens_equal_offline_llm(
    served: list[dict], offline: dict, service: Service
) -> None:
    checked = 0
    for i, resp in enumerate(served):
        prompt_ids = prompt_ids_of(resp)
        for c in resp["choices"]:
            j = c["index"]
            want_tokens = offline[f"tokens_{i}_{j}"]
            want_routes = offline[f"routes_{i}_{j}"]
            # The service's tokens are the engine's tokens...
            assert c["token_ids"] == want_tokens.tolist(), (i, j)
            blob = httpx.get(f"{service.url}/v1/routes/exact-{i}-{j}").content
            rec = decode_record(blob)
            # ...and so are the stored record's, prompt + completion.
            assert rec.token_ids.tolist() == prompt_ids + want_tokens.tolist()
            # vLLM: [T-1, L, K]; every layer of this model is MoE, so the record's rows are it.
            assert want_routes.shape == (rec.num_tokens - 1, 4, 2)
            assert rec.experts.dtype == want_routes.dtype
            assert np.array_equal(rec.experts[:-1], want_routes), (i, j)
            assert rec.valid[:-1].all() and not rec.valid[-1]
            checked += 1
    assert checked == 4
