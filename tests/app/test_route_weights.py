"""Routing weights beside the ids (``routed_experts_weights``, ``--route-weights``) through the
app, over the synthetic engine: request field, service default, handle, stored record."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from routereplay.service import Settings
from routereplay.service.app import make_backend
from routereplay.service.engines.synthetic import (
    SyntheticBackend,
    synthetic_routes,
    synthetic_weights,
)
from routereplay.service.engines.upstream import UpstreamBackend
from routereplay.service.protocol import CompletionRequest

from .conftest import MODEL, App, running_app


async def _complete(a: App, **body: object) -> dict:
    r = await a.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "weights please", "max_tokens": 5, "seed": 3, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()


def _expected_weights(a: App, token_ids: list[int]) -> np.ndarray:
    info = a.backend.info
    routes = synthetic_routes(
        token_ids, info.num_layers, info.moe_layers, info.num_experts, info.top_k
    )
    return synthetic_weights(routes, info.moe_layers)[:, list(info.moe_layers)]


async def test_weights_stored_when_asked(redis_url: str) -> None:
    async with running_app(redis_url, backend=SyntheticBackend(MODEL)) as a:
        resp = await _complete(a, routed_experts_weights=True, return_token_ids=True)
        handle = resp["choices"][0]["routed_experts"]
        assert handle["status"] == "stored"
        assert handle["weights"] is True and handle["weights_dtype"] == "float32"
        rec = await a.store.get(handle["route_id"])
        tokens = resp["choices"][0]["prompt_token_ids"] + resp["choices"][0]["token_ids"]
        assert rec.weights is not None and rec.weights_dtype == "float32"
        assert rec.weights.shape == rec.experts.shape == (len(tokens), 3, 2)
        # The same rows, layers and slots as the ids; the unrouted last row holds 0.
        want = _expected_weights(a, tokens)
        np.testing.assert_array_equal(rec.weights[:-1], want)
        assert not rec.weights[-1].any() and not rec.valid[-1]
        np.testing.assert_allclose(rec.weights[:-1].sum(-1), 1.0, rtol=1e-6)


async def test_no_weights_unless_asked(redis_url: str) -> None:
    async with running_app(redis_url, backend=SyntheticBackend(MODEL)) as a:
        for body in ({}, {"routed_experts_weights": False}):
            handle = (await _complete(a, **body))["choices"][0]["routed_experts"]
            assert handle["weights"] is False and handle["weights_dtype"] is None
            rec = await a.store.get(handle["route_id"])
            assert rec.weights is None and rec.weights_dtype is None


async def test_service_default_on_and_a_request_opting_out(redis_url: str) -> None:
    backend = SyntheticBackend(MODEL, route_weights="on")
    async with running_app(redis_url, backend=backend) as a:
        assert (await _complete(a))["choices"][0]["routed_experts"]["weights"] is True
        off = await _complete(a, routed_experts_weights=False)
        assert off["choices"][0]["routed_experts"]["weights"] is False


async def test_asking_a_service_without_capture_is_a_400(redis_url: str) -> None:
    async with running_app(redis_url, backend=SyntheticBackend(MODEL, route_weights="off")) as a:
        r = await a.http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2, "routed_experts_weights": True},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "routed_experts_weights"
        assert "--route-weights" in r.json()["error"]["message"]
        assert (await _complete(a))["choices"][0]["routed_experts"]["weights"] is False


async def test_streamed_chat_with_weights(redis_url: str) -> None:
    async with running_app(redis_url, backend=SyntheticBackend(MODEL)) as a:
        body = {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True, "routed_experts_weights": True,
        }  # fmt: skip
        handles = []
        async with a.http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        if c.get("routed_experts"):
                            handles.append(c["routed_experts"])
        assert len(handles) == 1 and handles[0]["weights"] is True
        rec = await a.store.get(handles[0]["route_id"])
        assert rec.weights is not None and rec.weights.shape == rec.experts.shape


def test_request_field_is_strict() -> None:
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"prompt": "x", "routed_experts_weights": "yes"})
    assert CompletionRequest.model_validate({"prompt": "x"}).routed_experts_weights is None


def test_upstream_refuses_weights() -> None:
    with pytest.raises(ValueError, match="--route-weights"):
        make_backend(
            Settings(backend="upstream", upstream_url="http://127.0.0.1:1", route_weights="on")
        )
    up = UpstreamBackend("http://127.0.0.1:1")
    req = CompletionRequest.model_validate({"prompt": "x", "routed_experts_weights": True})
    with pytest.raises(Exception) as e:
        up._body(req)
    assert getattr(e.value, "param", None) == "routed_experts_weights"
    # Never forwarded: vLLM's server would refuse an unknown field with a less useful error.
    plain = CompletionRequest.model_validate({"prompt": "x", "routed_experts_weights": False})
    assert "routed_experts_weights" not in up._body(plain)


async def test_second_turn_fills_skipped_rows_with_weights(redis_url: str) -> None:
    async with running_app(redis_url, backend=SyntheticBackend(MODEL)) as a:
        prompt = list(range(40, 100))

        async def turn(rid: str, **body: object) -> tuple[dict, object]:
            r = await a.http.post(
                "/v1/completions",
                headers={"X-Request-Id": rid},
                json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "seed": 1, **body},
            )
            handle = r.json()["choices"][0]["routed_experts"]
            return handle, await a.store.get(handle["route_id"])

        # Only an ids-only record holds the prefix: the skipped rows cannot get weights.
        await turn("ids-only")
        handle, rec = await turn("w1", routed_experts_weights=True, routed_experts_prompt_start=32)
        assert handle["weights"] is True and not rec.valid[:32].any()
        assert handle["num_valid_rows"] == len(prompt) + 2 - 32 and not rec.weights[:32].any()
        # A record with weights holds it: the skipped rows come back with theirs.
        _, first = await turn("w2", routed_experts_weights=True)
        handle, rec = await turn("w3", routed_experts_weights=True, routed_experts_prompt_start=32)
        assert handle["num_valid_rows"] == len(prompt) + 2 and rec.valid[:-1].all()
        np.testing.assert_array_equal(rec.weights[:-1], first.weights[:-1])


def test_the_capture_flag_leaves_the_settings_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag the service hands vLLM's processes is not a ROUTEREPLAY_ setting: a user's
    ROUTEREPLAY_ROUTE_WEIGHTS is --route-weights, read unchanged after an engine start."""
    from routereplay.service.engines.vllm import VllmBackend
    from routereplay.service.vllm_patches.route_weights import ENV

    monkeypatch.setenv("ROUTEREPLAY_ROUTE_WEIGHTS", "request")
    monkeypatch.setenv(ENV, "unset")  # restored after the test
    VllmBackend("unused", served_model_name="m", route_weights="off")._check_plugins(cpu=True)
    assert os.environ[ENV] == "0"
    assert Settings().route_weights == "request"


async def test_weights_through_the_openai_sdk_and_the_field_at_its_edges(redis_url: str) -> None:
    # The official SDK passes the field as extra_body; anything but a JSON boolean is a 400
    # naming it, and nothing is stored for a refused request.
    import openai

    async with running_app(redis_url, backend=SyntheticBackend(MODEL)) as a:
        c = await a.openai.completions.create(
            model=MODEL, prompt="sdk", max_tokens=4, extra_body={"routed_experts_weights": True}
        )
        handle = c.choices[0].model_extra["routed_experts"]
        assert handle["weights"] is True
        assert (await a.store.get(handle["route_id"])).weights is not None
        chat = await a.openai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            extra_body={"routed_experts_weights": False},
        )  # fmt: skip
        assert chat.choices[0].model_extra["routed_experts"]["weights"] is False
        # null is the field unset: the service default (no weights here).
        c = await a.openai.completions.create(
            model=MODEL, prompt="sdk", max_tokens=4, extra_body={"routed_experts_weights": None}
        )
        assert c.choices[0].model_extra["routed_experts"]["weights"] is False
        before = a.keys()
        for bad in ("yes", 1, 0, [True], {"on": True}):
            with pytest.raises(openai.BadRequestError) as e:
                await a.openai.completions.create(
                    model=MODEL, prompt="sdk", max_tokens=4,
                    extra_body={"routed_experts_weights": bad},
                )  # fmt: skip
            assert "routed_experts_weights" in str(e.value), (bad, e.value)
        assert a.keys() == before
