"""The official openai SDK against the app: responses, streams, n > 1, handles, stored routes.

The synthetic engine's routes are predictable (``synthetic_routes``), so every stored record is
checked against the experts the engine chose, not only for its shape.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np

from routereplay.client import MEDIA_TYPE, decode_record

from .conftest import MODEL, App

MSG = [{"role": "user", "content": "hello expert router"}]


async def fetch(svc: App, route_id: str):
    r = await svc.http.get(f"/v1/routes/{route_id}")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(MEDIA_TYPE)
    return decode_record(r.content)


def check_handle(h: dict, num_rows: int) -> None:
    assert h["status"] == "stored" and h.get("error") is None, h
    assert h["num_rows"] == num_rows
    assert h["num_valid_rows"] == num_rows - 1  # the last sampled token has no route
    assert h["moe_layers"] == [1, 2, 3] and h["top_k"] == 2 and h["num_experts"] == 8


async def check_stored(svc: App, route_id: str, token_ids: list[int]):
    """The record under ``route_id`` holds exactly the engine's tokens and chosen experts."""
    rec = await fetch(svc, route_id)
    assert rec.token_ids.tolist() == token_ids
    assert np.array_equal(rec.experts[:-1], svc.expected_experts(token_ids))
    assert rec.valid[:-1].all() and not rec.valid[-1]
    assert rec.moe_layers == (1, 2, 3) and rec.num_layers == 4 and rec.model == MODEL
    return rec


async def test_chat_non_streaming(svc: App) -> None:
    r = await svc.openai.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=6,
        seed=3,
        extra_body={"return_token_ids": True},
        extra_headers={"X-Request-Id": "sdk-chat-1"},
    )
    assert r.id == "sdk-chat-1" and r.object == "chat.completion"
    (c,) = r.choices
    assert c.finish_reason == "length" and r.usage.completion_tokens == 6
    assert c.message.role == "assistant" and len(c.message.content) == 6
    prompt_ids = r.model_extra["prompt_token_ids"]
    assert r.usage.prompt_tokens == len(prompt_ids)
    check_handle(c.routed_experts, len(prompt_ids) + 6)
    assert c.routed_experts["route_id"] == "sdk-chat-1-0"
    rec = await check_stored(svc, "sdk-chat-1-0", prompt_ids + c.model_extra["token_ids"])
    assert rec.prompt_len == len(prompt_ids)


async def test_completions_with_logprobs(svc: App) -> None:
    r = await svc.openai.completions.create(
        model=MODEL,
        prompt="The router picks",
        max_tokens=5,
        logprobs=2,
        seed=5,
        extra_body={"return_token_ids": True},
    )
    (c,) = r.choices
    assert len(c.logprobs.tokens) == 5 and all(len(t) == 2 for t in c.logprobs.top_logprobs)
    assert "".join(c.logprobs.tokens) == c.text
    assert c.logprobs.text_offset == list(range(5))
    # vLLM puts a completion's prompt token ids on each choice.
    prompt_ids = c.model_extra["prompt_token_ids"]
    assert prompt_ids == list(b"The router picks")
    await check_stored(svc, c.routed_experts["route_id"], prompt_ids + c.model_extra["token_ids"])


async def test_chat_logprobs(svc: App) -> None:
    r = await svc.openai.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.logprob <= 0 and e.bytes == list(e.token.encode()) for e in content)
    assert all(e.top_logprobs[0].token == e.token for e in content)  # the sampled one first
    none = await svc.openai.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=2, logprobs=True, top_logprobs=0
    )
    assert [e.top_logprobs for e in none.choices[0].logprobs.content] == [[], []]


async def test_completion_logprobs_zero_is_the_sampled_token(svc: App) -> None:
    """vLLM's ``logprobs: 0``: each position's candidates are the sampled token alone."""
    r = await svc.openai.completions.create(model=MODEL, prompt="abc", max_tokens=3, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]


async def test_completions_stream_handle_on_finish_chunk(svc: App) -> None:
    stream = await svc.openai.completions.create(
        model=MODEL,
        prompt="Stream the experts",
        max_tokens=7,
        stream=True,
        seed=11,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks = [c async for c in stream]
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1
    # The handle rides on the chunk that carries finish_reason, and only there.
    assert all(
        "routed_experts" not in (c.choices[0].model_extra or {})
        for c in chunks
        if c.choices and not c.choices[0].finish_reason
    )
    # As vLLM: prompt_token_ids on the choice's first chunk only.
    with_prompt = [
        c for c in chunks if c.choices and c.choices[0].model_extra.get("prompt_token_ids")
    ]
    assert with_prompt == [chunks[0]]
    prompt_ids = chunks[0].choices[0].model_extra["prompt_token_ids"]
    streamed = [
        t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []
    ]
    usage = chunks[-1].usage
    assert usage.completion_tokens == 7 == len(streamed) and usage.prompt_tokens == len(prompt_ids)
    h = finishing[0].choices[0].model_extra["routed_experts"]
    check_handle(h, len(prompt_ids) + 7)
    await check_stored(svc, h["route_id"], prompt_ids + streamed)
    # As vLLM: one chunk per token, the last token's chunk finishing the choice.
    with_tokens = [c for c in chunks if c.choices and c.choices[0].model_extra.get("token_ids")]
    assert len(with_tokens) == 7 and with_tokens[-1] is finishing[0]
    assert finishing[0].choices[0].text == chr(streamed[-1])


async def test_chat_stream_n2_and_prompt_ids_on_first_chunks(svc: App) -> None:
    stream = await svc.openai.chat.completions.create(
        model=MODEL,
        messages=MSG,
        n=2,
        max_tokens=5,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body={"return_token_ids": True},
        extra_headers={"X-Request-Id": "sdk-stream-n2"},
    )
    chunks = [c async for c in stream]
    # Each choice opens with the assistant role; those chunks carry prompt_token_ids (as vLLM).
    opening = chunks[:2]
    assert [c.choices[0].delta.role for c in opening] == ["assistant", "assistant"]
    prompt_ids = opening[0].model_extra["prompt_token_ids"]
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[2:])
    handles, tokens = {}, {0: [], 1: []}
    for chunk in chunks:
        for c in chunk.choices:
            tokens[c.index] += (c.model_extra or {}).get("token_ids") or []
            if c.finish_reason:
                handles[c.index] = c.model_extra["routed_experts"]
                assert c.delta.content, c  # as vLLM: the last token's chunk finishes it
    assert [handles[i]["route_id"] for i in (0, 1)] == ["sdk-stream-n2-0", "sdk-stream-n2-1"]
    assert tokens[0] != tokens[1]  # two samples, not one twice
    r0, r1 = [await check_stored(svc, f"sdk-stream-n2-{i}", prompt_ids + tokens[i]) for i in (0, 1)]
    p = len(prompt_ids)
    assert np.array_equal(r0.experts[:p], r1.experts[:p])


async def test_chat_non_streaming_n2_group(svc: App) -> None:
    r = await svc.openai.chat.completions.create(
        model=MODEL, messages=MSG, n=2, max_tokens=4, temperature=1.0, seed=9
    )
    ids = [c.routed_experts["route_id"] for c in r.choices]
    assert ids == [f"{r.id}-0", f"{r.id}-1"] and r.usage.completion_tokens == 8
    recs = [await fetch(svc, i) for i in ids]
    assert all(rec.completion_len == 4 for rec in recs)


async def test_seeded_requests_repeat(svc: App) -> None:
    texts = set()
    for _ in range(2):
        r = await svc.openai.completions.create(model=MODEL, prompt="again", max_tokens=8, seed=42)
        texts.add(r.choices[0].text)
    assert len(texts) == 1


async def test_inline_routes_are_vllms_array_and_match_stored(svc: App) -> None:
    r = await svc.openai.completions.create(
        model=MODEL,
        prompt="inline please",
        max_tokens=4,
        seed=1,
        extra_body={"return_routed_experts": "inline"},
    )
    c = r.choices[0]
    arr = np.load(io.BytesIO(base64.b64decode(c.model_extra["routed_experts"])))
    rec = await fetch(svc, c.model_extra["routed_experts_handle"]["route_id"])
    # vLLM's array: [T-1, num_layers, K], dense layer 0 as zeros; the record drops it.
    assert arr.shape == (rec.num_tokens - 1, 4, 2) and arr.dtype == np.uint8
    assert not arr[:, 0].any()
    assert np.array_equal(arr[:, 1:], rec.experts[:-1])


async def test_handle_is_small_whatever_the_length(svc: App) -> None:
    async def choice_bytes(max_tokens: int) -> int:
        r = await svc.http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "size " * 200, "max_tokens": max_tokens},
        )
        return len(json.dumps(r.json()["choices"][0]["routed_experts"]))

    assert await choice_bytes(2) < 1024 and await choice_bytes(400) < 1024


async def test_continuous_usage_stats(svc: App) -> None:
    r = await svc.http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "abc",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == [1, 2, 3]  # as vLLM: the third token's chunk finishes the choice


async def test_models_and_tokenization(svc: App) -> None:
    models = await svc.openai.models.list()
    (m,) = models.data
    assert m.id == MODEL and m.model_extra["root"] == MODEL
    assert m.model_extra["max_model_len"] == 2048
    assert m.model_extra["routed_experts"] == {
        "num_layers": 4,
        "moe_layers": [1, 2, 3],
        "num_experts": 8,
        "top_k": 2,
    }
    assert (await svc.openai.models.retrieve(MODEL)).id == MODEL
    r = await svc.http.get("/v1/models/other-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

    tok = (
        await svc.http.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True})
    ).json()
    assert tok["tokens"] == list("héllo".encode()) and tok["count"] == 6
    assert tok["max_model_len"] == 2048 and len(tok["token_strs"]) == 6
    detok = await svc.http.post("/detokenize", json={"tokens": tok["tokens"]})
    assert detok.json() == {"prompt": "héllo"}
    # Chat tokenization renders as a chat completion does: the same prompt ids.
    chat_tok = (await svc.http.post("/tokenize", json={"model": MODEL, "messages": MSG})).json()
    r = await svc.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": MSG, "max_tokens": 1, "return_token_ids": True},
    )
    assert chat_tok["tokens"] == r.json()["prompt_token_ids"]
    bad = await svc.http.post("/detokenize", json={"tokens": [1, 300]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


async def test_chat_template_fields_are_honoured(svc: App) -> None:
    async def prompt_ids(**body: object) -> list[int]:
        r = await svc.http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 1, "return_token_ids": True, **body},
        )
        assert r.status_code == 200, r.text
        return r.json()["prompt_token_ids"]

    with_prompt = await prompt_ids(messages=MSG)
    without = await prompt_ids(messages=MSG, add_generation_prompt=False)
    assert bytes(with_prompt).endswith(b"<|assistant|>") and with_prompt[: len(without)] == without
    cont = await prompt_ids(
        messages=[*MSG, {"role": "assistant", "content": "Sure,"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert bytes(cont).endswith(b"<|assistant|>Sure,")
    parts = await prompt_ids(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hello "},
                    {"type": "text", "text": "expert router"},
                ],
            }
        ]
    )
    assert parts == with_prompt
