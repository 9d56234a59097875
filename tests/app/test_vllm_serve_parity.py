"""Where a client moved from ``vllm serve`` meets the same answers: ``/version``, ``/ping``,
``/invocations``, ``stream_options``' rules and ``prompt_logprobs`` read through the openai SDK.
Each behaviour is vLLM 0.32's (``vllm/entrypoints/serve/instrumentator/basic.py``,
``serve/sagemaker/api_router.py``, ``openai/*/protocol.py``)."""

from __future__ import annotations

import json

import pytest

from .conftest import MODEL, App

MSG = [{"role": "user", "content": "parity"}]


async def test_version_names_the_release_serving(svc: App) -> None:
    r = await svc.http.get("/version")
    assert r.status_code == 200
    body = r.json()
    # The synthetic engine has no vLLM; the service's own release is beside it.
    assert body["version"] is None and isinstance(body["routereplay"], str) and body["routereplay"]


async def test_ping_is_the_health_answer(svc: App) -> None:
    for method in ("GET", "POST"):
        r = await svc.http.request(method, "/ping")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})


@pytest.mark.parametrize("stream", [False, True])
async def test_invocations_dispatch_by_the_body_and_store_routes(svc: App, stream: bool) -> None:
    chat = {"model": MODEL, "messages": MSG, "max_tokens": 4, "stream": stream}
    cmpl = {"model": MODEL, "prompt": "parity", "max_tokens": 4, "stream": stream}
    for kind, body in (("chat", chat), ("cmpl", cmpl)):
        rid = f"inv-{kind}-{int(stream)}"
        r = await svc.http.post("/invocations", json=body, headers={"X-Request-Id": rid})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            obj = chunks[0]["object"]
        else:
            obj = r.json()["object"]
        assert obj == {"chat": "chat.completion", "cmpl": "text_completion"}[kind] + (
            ".chunk" if stream and kind == "chat" else ""
        )
        rec = await svc.http.get(f"/v1/routes/{rid}-0")
        assert rec.status_code == 200, (kind, rec.text)


async def test_invocations_refuse_what_the_routes_they_stand_for_refuse(svc: App) -> None:
    r = await svc.http.post("/invocations", json={"model": MODEL, "prompt": "x", "n": 0})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "n", err
    r = await svc.http.post("/invocations", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = await svc.http.post("/invocations", content=b"{not json")
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["code"]) == (400, "body", "invalid_json")
    r = await svc.http.post("/invocations", json=[1, 2])
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


async def test_stream_options_need_a_stream(svc: App) -> None:
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                                 {"messages": MSG})):  # fmt: skip
        r = await svc.http.post(path, json={"model": MODEL, **body, "max_tokens": 2,
                                            "stream_options": {"include_usage": True}})  # fmt: skip
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "stream_options", err
        assert "stream is true" in err["message"]
        ok = await svc.http.post(path, json={"model": MODEL, **body, "max_tokens": 2,
                                             "stream_options": None})  # fmt: skip
        assert ok.status_code == 200, ok.text


async def test_continuous_usage_needs_include_usage(svc: App) -> None:
    """vLLM puts usage on every chunk only when the final usage chunk is asked for too."""
    r = await svc.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True,
              "stream_options": {"continuous_usage_stats": True}},
    )  # fmt: skip
    chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    assert chunks and not any(c.get("usage") for c in chunks), chunks


async def test_prompt_logprobs_read_as_null_through_the_sdk(svc: App) -> None:
    c = await svc.openai.completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert c.choices[0].prompt_logprobs is None  # type: ignore[attr-defined]
    r = await svc.openai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    assert r.prompt_logprobs is None  # type: ignore[attr-defined]
    assert "prompt_logprobs" in r.model_dump() and "prompt_logprobs" in c.choices[0].model_dump()
