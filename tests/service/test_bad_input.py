"""Bad input: OpenAI-schema 4xx naming the field, and nothing stored."""

from __future__ import annotations

import httpx
import pytest
import redis

from engines import Service

pytestmark = pytest.mark.vllm


def keys(service: Service) -> set[bytes]:
    """The session Redis's keys but the readiness probes' (``<prefix>:probe``, which any
    service's ``/ready`` writes with a 10 s expiry)."""
    r = redis.Redis.from_url(service.redis_url)
    try:
        return {k for k in r.scan_iter(count=1000) if not k.endswith(b":probe")}
    finally:
        r.close()


def err(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    e = resp.json()["error"]
    assert set(e) >= {"message", "type", "param", "code"}
    assert e["param"] == param, e
    if param:
        assert param.split(".")[0].lower() in e["message"].lower(), e
    return e


def chat(http: httpx.Client, service: Service, rid: str, **body):
    body = {"model": service.model, "messages": [{"role": "user", "content": "hi"}], **body}
    return http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid})


@pytest.fixture()
def nothing_stored(service: Service):
    before = keys(service)
    yield
    # No route id of these requests exists and no chunk or index key was added.
    assert keys(service) == before


@pytest.mark.usefixtures("nothing_stored")
class TestBadInput:
    """What only the engine can judge (its tokenizer, its vocabulary, its own checks); every
    field-level refusal is covered engine-free in tests/app/test_errors.py."""

    def test_max_tokens_beyond_context_after_prompt(
        self, http: httpx.Client, service: Service
    ) -> None:
        r = http.post(
            "/v1/completions", headers={"X-Request-Id": "bad-room"},
            json={"model": service.model, "prompt": list(range(3, 1503)), "max_tokens": 1000},
        )  # fmt: skip
        err(r, 400, "max_tokens")

    def test_overlong_prompt_completions(self, http: httpx.Client, service: Service) -> None:
        r = http.post(
            "/v1/completions", headers={"X-Request-Id": "bad-long-cmpl"},
            json={"model": service.model, "prompt": [5] * 3000, "max_tokens": 1},
        )  # fmt: skip
        err(r, 400, "prompt")

    def test_overlong_prompt_chat(self, http: httpx.Client, service: Service) -> None:
        long = "expert router " * 2000
        body = {"model": service.model, "messages": [{"role": "user", "content": long}]}
        r = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "bad-long2"})
        err(r, 400, "messages")

    def test_token_id_outside_vocabulary(self, http: httpx.Client, service: Service) -> None:
        r = http.post(
            "/v1/completions", headers={"X-Request-Id": "bad-vocab"},
            json={"model": service.model, "prompt": [5, 10**6], "max_tokens": 1},
        )  # fmt: skip
        assert r.status_code == 400, r.text

    def test_greedy_with_n2(self, http: httpx.Client, service: Service) -> None:
        # vLLM checks this only when the request reaches the engine: still a 400, before any body.
        for stream in (False, True):
            r = chat(http, service, f"bad-greedy-n2-{stream}", n=2, temperature=0, stream=stream)
            e = err(r, 400, "n")
            assert "greedy" in e["message"]

    def test_prompt_start_beyond_prompt(self, http: httpx.Client, service: Service) -> None:
        r = http.post(
            "/v1/completions", headers={"X-Request-Id": "bad-start"},
            json={"model": service.model, "prompt": [5, 6, 7], "routed_experts_prompt_start": 9},
        )  # fmt: skip
        err(r, 400, "routed_experts_prompt_start")

    def test_unknown_model(self, http: httpx.Client, service: Service) -> None:
        e = err(chat(http, service, "bad-model", model="gpt-17"), 404, "model")
        assert "gpt-17" in e["message"]
