"""Bad input: OpenAI-schema 4xx naming the field, and nothing stored."""

from __future__ import annotations

import httpx
import pytest
import redis

from .conftest import Service

pytestmark = pytest.mark.vllm


def keys(service: Service) -> set[bytes]:
    r = redis.Redis.from_url(service.redis_url)
    try:
        return set(r.scan_iter(count=1000))
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
    def test_malformed_json(self, http: httpx.Client) -> None:
        r = http.post(
            "/v1/chat/completions", content=b'{"model": "x", "messages": [',
            headers={"content-type": "application/json", "X-Request-Id": "bad-json"},
        )  # fmt: skip
        e = err(r, 400, "body")
        assert "json" in e["message"].lower()

    def test_body_not_an_object(self, http: httpx.Client) -> None:
        err(http.post("/v1/completions", json=[1, 2]), 400, "body")

    def test_unknown_model(self, http: httpx.Client, service: Service) -> None:
        e = err(chat(http, service, "bad-model", model="gpt-17"), 404, "model")
        assert "gpt-17" in e["message"]

    def test_missing_messages(self, http: httpx.Client, service: Service) -> None:
        r = http.post("/v1/chat/completions", json={"model": service.model})
        err(r, 400, "messages")

    @pytest.mark.parametrize("value", [-1, 0])
    def test_non_positive_max_tokens(self, http: httpx.Client, service: Service, value) -> None:
        err(chat(http, service, f"bad-neg{value}", max_tokens=value), 400, "max_tokens")

    def test_huge_max_tokens(self, http: httpx.Client, service: Service) -> None:
        e = err(chat(http, service, "bad-huge", max_tokens=10**9), 400, "max_tokens")
        assert "2048" in e["message"]

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

    @pytest.mark.parametrize("rid", ["has space", "x" * 121, "semi;colon", "ünï"])
    def test_invalid_request_id(self, http: httpx.Client, service: Service, rid: str) -> None:
        r = http.post(
            "/v1/chat/completions",
            json={"model": service.model, "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Request-Id": rid.encode("utf-8")},
        )
        err(r, 400, "X-Request-Id")

    def test_temperature_out_of_range(self, http: httpx.Client, service: Service) -> None:
        err(chat(http, service, "bad-temp", temperature=7), 400, "temperature")

    def test_greedy_with_n2(self, http: httpx.Client, service: Service) -> None:
        # vLLM checks this only when the request reaches the engine: still a 400, before any body.
        for stream in (False, True):
            r = chat(http, service, f"bad-greedy-n2-{stream}", n=2, temperature=0, stream=stream)
            e = err(r, 400, "n")
            assert "greedy" in e["message"]

    @pytest.mark.parametrize(
        ("field", "value"),
        [("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
         ("tool_choice", "required"), ("response_format", {"type": "json_object"})],
    )  # fmt: skip
    def test_unsupported_features_refused(
        self, http: httpx.Client, service: Service, field: str, value: object
    ) -> None:
        err(chat(http, service, f"bad-{field}", **{field: value}), 400, field)

    def test_prompt_start_beyond_prompt(self, http: httpx.Client, service: Service) -> None:
        r = http.post(
            "/v1/completions", headers={"X-Request-Id": "bad-start"},
            json={"model": service.model, "prompt": [5, 6, 7], "routed_experts_prompt_start": 9},
        )  # fmt: skip
        err(r, 400, "routed_experts_prompt_start")

    def test_echo_unsupported(self, http: httpx.Client, service: Service) -> None:
        r = http.post("/v1/completions", json={"model": service.model, "prompt": "a", "echo": True})
        err(r, 400, "echo")

    def test_unknown_route_id(self, http: httpx.Client) -> None:
        e = err(http.get("/v1/routes/never-stored-0"), 404, "route_id")
        assert "never-stored-0" in e["message"]
        err(http.delete("/v1/routes/never-stored-0"), 404, "route_id")

    def test_invalid_route_id(self, http: httpx.Client) -> None:
        err(http.get("/v1/routes/bad%20id"), 400, "route_id")

    def test_bad_start(self, http: httpx.Client) -> None:
        err(http.get("/v1/routes/whatever-0", params={"start": "-3"}), 400, "start")

    def test_batch_bad_body(self, http: httpx.Client) -> None:
        err(http.post("/v1/routes:batch", json={"ids": []}), 400, "ids")
        err(http.post("/v1/routes:batch", content=b"{", headers={"content-type": "x"}), 400, "body")


def test_failed_requests_left_no_routes(service: Service) -> None:
    # The route ids the bad requests above would have used were never written.
    st = service.store()
    try:
        for rid in ("bad-json", "bad-model", "bad-huge", "bad-room", "bad-long-cmpl", "bad-long2"):
            assert not st.exists(f"{rid}-0")
    finally:
        st.close()
