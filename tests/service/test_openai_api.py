"""The official openai SDK against the service on the real engine: every choice's routes land in
Redis as vLLM chose them. Request policy, error mapping, SSE framing, retrieval and metrics are
covered engine-free in tests/app; this module keeps what needs the engine."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest

from routereplay.client import MEDIA_TYPE, decode_record

from engines import Service

pytestmark = pytest.mark.vllm

# The tiny random model usually emits EOS at once; ignore_eos gives completions of known length.
EXTRA = {"ignore_eos": True}


def fetch(service: Service, route_id: str, **params: str):
    r = httpx.get(f"{service.url}/v1/routes/{route_id}", params=params, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(MEDIA_TYPE)
    return decode_record(r.content)


def check_handle(h: dict, service: Service, num_rows: int) -> None:
    assert h["status"] == "stored", h
    assert h["num_rows"] == num_rows
    # Every row but the last sampled token's (which no engine routes).
    assert h["num_valid_rows"] == num_rows - 1
    assert h["moe_layers"] == [0, 1, 2, 3] and h["top_k"] == 2 and h["num_experts"] == 8
    assert "error" not in h or h["error"] is None


def test_chat_non_streaming(client: openai.OpenAI, service: Service) -> None:
    r = client.chat.completions.create(
        model=service.model, messages=[{"role": "user", "content": "hello expert router"}],
        max_tokens=6, seed=3, extra_body={**EXTRA, "return_token_ids": True},
        extra_headers={"X-Request-Id": "sdk-chat-1"},
    )  # fmt: skip
    assert r.id == "sdk-chat-1"
    (c,) = r.choices
    assert c.finish_reason == "length" and r.usage.completion_tokens == 6
    h = c.routed_experts
    assert h["route_id"] == "sdk-chat-1-0"
    prompt_ids = r.model_extra["prompt_token_ids"]
    check_handle(h, service, len(prompt_ids) + 6)
    rec = fetch(service, "sdk-chat-1-0")
    assert rec.token_ids.tolist() == prompt_ids + c.model_extra["token_ids"]
    assert rec.prompt_len == len(prompt_ids) == r.usage.prompt_tokens
    assert rec.valid[:-1].all() and not rec.valid[-1]
    assert rec.model == service.model and rec.moe_layers == (0, 1, 2, 3)


def test_completions_non_streaming_with_logprobs(client: openai.OpenAI, service: Service) -> None:
    r = client.completions.create(
        model=service.model, prompt="The router picks", max_tokens=5, logprobs=2, seed=5,
        extra_body=EXTRA,
    )  # fmt: skip
    (c,) = r.choices
    assert len(c.logprobs.tokens) == 5 and len(c.logprobs.token_logprobs) == 5
    # As vLLM's server: the sampled token and the top 2, so 2 entries, or 3 when the sampled
    # token is not among the top 2 (then it is the least likely of the three).
    for tok, lp, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs,
                            strict=True):  # fmt: skip
        assert top[tok] == lp and len(top) in (2, 3), (tok, top)
        if len(top) == 3:
            assert lp == min(top.values()), (tok, top)
    assert "".join(c.logprobs.tokens) == c.text
    zero = client.completions.create(model=service.model, prompt="The router picks", max_tokens=3,
                                     logprobs=0, extra_body=EXTRA)  # fmt: skip
    lz = zero.choices[0].logprobs
    assert [list(t) for t in lz.top_logprobs] == [[tok] for tok in lz.tokens]
    rec = fetch(service, c.routed_experts["route_id"])
    assert rec.num_tokens == r.usage.prompt_tokens + 5
    check_handle(c.routed_experts, service, rec.num_tokens)


def test_chat_logprobs(client: openai.OpenAI, service: Service) -> None:
    r = client.chat.completions.create(
        model=service.model, messages=[{"role": "user", "content": "logprobs please"}],
        max_tokens=4, logprobs=True, top_logprobs=3, extra_body=EXTRA,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.logprob <= 0 for e in content)
    # As vLLM's server: the first top_logprobs candidates, the sampled token first.
    assert all(e.top_logprobs[0].token == e.token for e in content)


def test_completions_streaming_handle_on_finish_chunk(
    client: openai.OpenAI, service: Service
) -> None:
    stream = client.completions.create(
        model=service.model, prompt="Stream the experts", max_tokens=7, stream=True, seed=11,
        stream_options={"include_usage": True}, extra_body={**EXTRA, "return_token_ids": True},
    )  # fmt: skip
    chunks = list(stream)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1
    fc = finishing[0].choices[0]
    # The handle rides on the chunk that carries finish_reason, and only there.
    assert all(
        "routed_experts" not in (c.choices[0].model_extra or {})
        for c in chunks
        if c.choices and not c.choices[0].finish_reason
    )
    h = fc.model_extra["routed_experts"]
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get(
        "token_ids") or []]  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage.completion_tokens == 7 == len(streamed_ids)
    check_handle(h, service, usage.prompt_tokens + 7)
    rec = fetch(service, h["route_id"])
    assert rec.token_ids[rec.prompt_len :].tolist() == streamed_ids
    assert text  # text was streamed
    # As vLLM: the last token's chunk carries the finish (no empty chunk after it).
    assert fc.model_extra["token_ids"] == streamed_ids[-len(fc.model_extra["token_ids"]) :] != []
    assert chunks[-2] is finishing[0]  # then only the usage chunk


def test_chat_streaming_n2(client: openai.OpenAI, service: Service) -> None:
    stream = client.chat.completions.create(
        model=service.model, messages=[{"role": "user", "content": "two samples"}], n=2,
        max_tokens=5, temperature=1.0, seed=7, stream=True, extra_body=EXTRA,
        extra_headers={"X-Request-Id": "sdk-stream-n2"},
    )  # fmt: skip
    handles = {}
    for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason:
                handles[c.index] = c.model_extra["routed_experts"]
    assert sorted(handles) == [0, 1]
    assert [handles[i]["route_id"] for i in (0, 1)] == ["sdk-stream-n2-0", "sdk-stream-n2-1"]
    r0, r1 = (fetch(service, f"sdk-stream-n2-{i}") for i in (0, 1))
    assert r0.prompt_len == r1.prompt_len
    p = r0.prompt_len
    # Same prompt, same routes on every prompt row.
    assert np.array_equal(r0.experts[:p], r1.experts[:p])
    assert np.array_equal(r0.token_ids[:p], r1.token_ids[:p])
    for h, r in ((handles[0], r0), (handles[1], r1)):
        check_handle(h, service, r.num_tokens)


def test_chat_non_streaming_n2(client: openai.OpenAI, service: Service) -> None:
    r = client.chat.completions.create(
        model=service.model, messages=[{"role": "user", "content": "group of two"}], n=2,
        max_tokens=4, temperature=1.0, seed=9, extra_body=EXTRA,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    ids = [c.routed_experts["route_id"] for c in r.choices]
    assert ids == [f"{r.id}-0", f"{r.id}-1"]
    recs = [fetch(service, i) for i in ids]
    assert r.usage.completion_tokens == 8
    assert all(rec.completion_len == 4 for rec in recs)


def test_inline_routes_match_stored(client: openai.OpenAI, service: Service) -> None:
    r = client.completions.create(
        model=service.model, prompt="inline please", max_tokens=4, seed=1,
        extra_body={**EXTRA, "return_routed_experts": "inline"},
    )  # fmt: skip
    c = r.choices[0]
    arr = np.load(io.BytesIO(base64.b64decode(c.model_extra["routed_experts"])))
    h = c.model_extra["routed_experts_handle"]
    rec = fetch(service, h["route_id"])
    # vLLM's array: [T-1, num_layers, K]; the record keeps it (all layers are MoE here).
    assert arr.shape == (rec.num_tokens - 1, 4, 2) and arr.dtype == np.uint8
    assert np.array_equal(arr, rec.experts[:-1])


def test_models_health_ready_metrics(service: Service) -> None:
    m = httpx.get(f"{service.v1}/models").json()
    assert m["data"][0]["id"] == service.model
    # vLLM's clients read the tokenizer location from root.
    assert m["data"][0]["root"] == str(service.model_path)
    assert m["data"][0]["routed_experts"]["moe_layers"] == [0, 1, 2, 3]
    assert httpx.get(f"{service.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{service.url}/ready").json() == {"status": "ready"}
    text = httpx.get(f"{service.url}/metrics").text
    for name in (
        "routereplay_requests_total", "routereplay_request_latency_seconds_bucket",
        "routereplay_prompt_tokens_total", "routereplay_completion_tokens_total",
        "routereplay_route_bytes_stored_total", "routereplay_route_store_errors_total",
        "routereplay_engine_queue_depth", "routereplay_requests_inflight",
    ):  # fmt: skip
        assert name in text, name
    stored = [ln for ln in text.splitlines() if ln.startswith("routereplay_routes_stored_total")]
    assert float(stored[0].split()[-1]) >= 1


def test_sampling_fields_reach_the_engine(service: Service) -> None:
    """Fields vLLM honours change what is generated (none is silently dropped)."""

    def tokens(**extra: object) -> list[int]:
        r = httpx.post(
            f"{service.v1}/completions",
            json={"model": service.model, "prompt": "bias me", "max_tokens": 6, "seed": 1,
                  "temperature": 1.0, "return_token_ids": True, **EXTRA, **extra},
            timeout=120,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    plain = tokens()
    assert tokens(logit_bias={"65": 100}) == [65] * 6
    allowed = tokens(allowed_token_ids=[70, 71])
    assert set(allowed) <= {70, 71}
    banned = {plain[0]}
    assert tokens(logit_bias={str(plain[0]): -100})[0] not in banned


def test_tokenize_matches_the_engine(service: Service) -> None:
    msgs = [{"role": "user", "content": "tokenize me"}]
    tok = httpx.post(f"{service.url}/tokenize", json={"messages": msgs}).json()
    r = httpx.post(
        f"{service.v1}/chat/completions",
        json={"model": service.model, "messages": msgs, "max_tokens": 1, "return_token_ids": True},
        timeout=120,
    ).json()
    assert tok["tokens"] == r["prompt_token_ids"] and tok["max_model_len"] == 2048
    text = httpx.post(f"{service.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert "tokenize me" in text["prompt"]
    plain = httpx.post(f"{service.url}/tokenize", json={"prompt": "abc"}).json()
    assert plain["count"] == len(plain["tokens"]) > 0


def _stored_whole(service: Service, handle: dict, prompt_ids: list[int], out_ids: list[int]):
    check_handle(handle, service, len(prompt_ids) + len(out_ids))
    rec = fetch(service, handle["route_id"])
    assert rec.token_ids.tolist() == prompt_ids + out_ids
    return rec


@pytest.mark.parametrize(
    "constraint, fits",
    [
        ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
        ({"json": {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                   "additionalProperties": False}, "disable_any_whitespace": True},
         lambda t: json.loads(t) in ({"a": "x"}, {"a": "y"})),
    ],
)  # fmt: skip
def test_structured_outputs_constrain_and_store_routes(
    service: Service, constraint: dict, fits
) -> None:
    """vLLM's structured_outputs on the real engine: the text fits the constraint, and the
    route is stored whole, as for a plain request."""
    msgs = [{"role": "user", "content": "A?"}]
    for path, body in (("/completions", {"prompt": "Answer:"}),
                       ("/chat/completions", {"messages": msgs})):  # fmt: skip
        r = httpx.post(
            f"{service.v1}{path}",
            json={"model": service.model, **body, "max_tokens": 48, "temperature": 1.0,
                  "seed": 3, "return_token_ids": True, "structured_outputs": constraint},
            timeout=300,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        out = r.json()
        c = out["choices"][0]
        text = c["text"] if "text" in c else c["message"]["content"]
        assert fits(text), (path, text)
        prompt_ids = c.get("prompt_token_ids") or out["prompt_token_ids"]
        _stored_whole(service, c["routed_experts"], prompt_ids, c["token_ids"])


def test_response_format_json_schema_constrains_chat(
    client: openai.OpenAI, service: Service
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    r = client.chat.completions.create(
        model=service.model, messages=[{"role": "user", "content": "json please"}],
        max_tokens=32, seed=5, extra_body={"return_token_ids": True},
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
    )  # fmt: skip
    c = r.choices[0]
    assert c.message.content.lstrip().startswith("{"), c.message.content
    _stored_whole(service, c.routed_experts, r.model_extra["prompt_token_ids"],
                  c.model_extra["token_ids"])  # fmt: skip
