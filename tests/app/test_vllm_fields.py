"""vLLM's request fields beyond OpenAI's, as ``vllm serve`` answers them, each with its routes:
batched prompts (every prompt's choices get their own route ids), ``echo``, ``prompt_logprobs``,
``truncate_prompt_tokens``, ``logprob_token_ids`` and ``return_tokens_as_token_ids``. The
shapes are vLLM 0.32's (``vllm/entrypoints/openai/completion/serving.py``,
``chat_completion/serving.py``); the real engine's answers are in
``tests/service/test_vllm_fields.py``."""

from __future__ import annotations

import json

import pytest

from .conftest import MODEL, App
from .test_openai_sdk import check_stored

PROMPTS = ["first prompt", "the second one", "3rd"]


def sse(text: str) -> list[dict]:
    return [json.loads(x[6:]) for x in text.splitlines() if x.startswith("data: {")]


async def test_a_batch_numbers_choices_by_prompt_and_stores_each(svc: App) -> None:
    r = await svc.openai.completions.create(
        model=MODEL,
        prompt=PROMPTS,
        n=2,
        max_tokens=3,
        extra_body={"return_token_ids": True},
        extra_headers={"X-Request-Id": "batch-1"},
    )
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        prompt = PROMPTS[c.index // 2]
        ids = c.model_extra["prompt_token_ids"]
        assert ids == list(prompt.encode())
        h = c.model_extra["routed_experts"]
        assert h["route_id"] == f"batch-1-{c.index}"
        await check_stored(svc, h["route_id"], ids + c.model_extra["token_ids"])
    assert r.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    assert r.usage.completion_tokens == 6 * 3


async def test_a_streamed_batch_finishes_every_choice_with_its_handle(svc: App) -> None:
    body = {"model": MODEL, "prompt": [[65, 66, 67], [68, 69]], "n": 2, "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    r = await svc.http.post("/v1/completions", json=body, headers={"X-Request-Id": "batch-s"})
    assert r.status_code == 200, r.text
    chunks = sse(r.text)
    finished = [
        c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert sorted(c["index"] for c in finished) == [0, 1, 2, 3]
    for c in finished:
        assert c["routed_experts"]["route_id"] == f"batch-s-{c['index']}"
        assert c["routed_experts"]["status"] == "stored"
    assert chunks[-1]["usage"]["prompt_tokens"] == 5


async def test_one_bad_prompt_refuses_the_batch_and_stores_nothing(svc: App) -> None:
    before = svc.keys()
    long = "x" * (svc.backend.info.max_model_len + 5)
    r = await svc.http.post("/v1/completions", json={"model": MODEL, "prompt": ["ok", long]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert svc.keys() == before


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_puts_the_prompt_before_the_text_and_its_logprobs(
    svc: App, stream: bool
) -> None:
    body = {"model": MODEL, "prompt": "echo me", "max_tokens": 3, "echo": True, "logprobs": 1,
            "stream": stream}  # fmt: skip
    r = await svc.http.post(
        "/v1/completions", json=body, headers={"X-Request-Id": f"echo-{stream}"}
    )
    assert r.status_code == 200, r.text
    if stream:
        parts = [c["choices"][0] for c in sse(r.text) if c["choices"]]
        text = "".join(p["text"] for p in parts)
        tokens = [t for p in parts if p["logprobs"] for t in p["logprobs"]["tokens"]]
        lps = [v for p in parts if p["logprobs"] for v in p["logprobs"]["token_logprobs"]]
        offsets = [v for p in parts if p["logprobs"] for v in p["logprobs"]["text_offset"]]
    else:
        c = r.json()["choices"][0]
        text, tokens = c["text"], c["logprobs"]["tokens"]
        lps, offsets = c["logprobs"]["token_logprobs"], c["logprobs"]["text_offset"]
    assert text.startswith("echo me") and len(text) == len("echo me") + 3
    assert "".join(tokens) == text and len(tokens) == 7 + 3
    assert lps[0] is None and all(v is not None for v in lps[1:])
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    rec = await svc.http.get(f"/v1/routes/echo-{stream}-0", params={"format": "json"})
    assert rec.json()["prompt_len"] == 7  # the route is the plain request's


async def test_echo_with_no_new_tokens_scores_the_prompt(svc: App) -> None:
    body = {"model": MODEL, "prompt": "score", "max_tokens": 0, "echo": True, "logprobs": 0}
    r = await svc.http.post("/v1/completions", json=body, headers={"X-Request-Id": "score"})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] == "score" and c["logprobs"]["tokens"] == list("score")
    # As vLLM: the engine samples one token (not shown), so the prompt's every row is routed.
    assert r.json()["usage"]["completion_tokens"] == 1
    rec = (await svc.http.get("/v1/routes/score-0", params={"format": "json"})).json()
    assert rec["prompt_len"] == 5 and all(rec["valid"][:5])


async def test_echo_with_token_ids_returned_shows_ids_not_text(svc: App) -> None:
    # vLLM's rule: with return_token_ids the echoed prompt is in prompt_token_ids alone.
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "echo": True,
            "return_token_ids": True}  # fmt: skip
    c = (await svc.http.post("/v1/completions", json=body)).json()["choices"][0]
    assert len(c["text"]) == 2 and c["prompt_token_ids"] == [97, 98, 99]


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_prompt_logprobs_cover_every_prompt_token(svc: App, api: str) -> None:
    if api == "chat":
        r = await svc.openai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"prompt_logprobs": 2, "return_token_ids": True},
        )  # fmt: skip
        plp, ids = r.model_extra["prompt_logprobs"], r.model_extra["prompt_token_ids"]
    else:
        r = await svc.openai.completions.create(
            model=MODEL, prompt="prompt lp", max_tokens=2,
            extra_body={"prompt_logprobs": 2, "return_token_ids": True},
        )  # fmt: skip
        c = r.choices[0]
        plp, ids = c.prompt_logprobs, c.model_extra["prompt_token_ids"]  # type: ignore[attr-defined]
    assert len(plp) == len(ids) and plp[0] is None
    for tok, pos in zip(ids[1:], plp[1:], strict=True):
        assert str(tok) in pos and 2 <= len(pos) <= 3
        assert set(pos[str(tok)]) == {"logprob", "rank", "decoded_token"}


@pytest.mark.parametrize(("side", "k"), [(None, 4), ("left", 4), ("right", 4), (None, -1)])
async def test_truncate_prompt_tokens_cuts_the_prompt_and_its_route(
    svc: App, side: str | None, k: int
) -> None:
    prompt = list(range(40, 60))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": k,
            "return_token_ids": True, **({"truncation_side": side} if side else {})}  # fmt: skip
    r = await svc.http.post("/v1/completions", json=body, headers={"X-Request-Id": f"tr-{side}{k}"})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    want = prompt if k == -1 else (prompt[:k] if side == "right" else prompt[-k:])
    assert c["prompt_token_ids"] == want and r.json()["usage"]["prompt_tokens"] == len(want)
    await check_stored(svc, f"tr-{side}{k}-0", want + c["token_ids"])


async def test_logprob_token_ids_are_each_positions_candidates(svc: App) -> None:
    ids = [65, 66, 67]
    r = await svc.openai.completions.create(
        model=MODEL, prompt="x", max_tokens=3, logprobs=0,
        extra_body={"logprob_token_ids": ids},
    )  # fmt: skip
    for tok, top in zip(r.choices[0].logprobs.tokens, r.choices[0].logprobs.top_logprobs,
                        strict=True):  # fmt: skip
        assert set(top) == {tok, "A", "B", "C"}
    chat = await svc.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, logprobs=True,
        extra_body={"logprob_token_ids": ids},
    )  # fmt: skip
    for e in chat.choices[0].logprobs.content:
        assert {t.token for t in e.top_logprobs} == {e.token, "A", "B", "C"}


async def test_tokens_as_token_ids(svc: App) -> None:
    r = await svc.openai.completions.create(
        model=MODEL, prompt="ids", max_tokens=3, logprobs=1, echo=True,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )  # fmt: skip
    c = r.choices[0]
    want = c.model_extra["prompt_token_ids"] + c.model_extra["token_ids"]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in want]
    assert all(k.startswith("token_id:") for top in c.logprobs.top_logprobs[1:] for k in top)


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_echo_puts_the_last_assistant_message_first(svc: App, stream: bool) -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer"}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 3, "echo": True, "stream": stream,
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    r = await svc.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        deltas = [c["choices"][0]["delta"] for c in sse(r.text) if c["choices"]]
        content = "".join(d.get("content") or "" for d in deltas)
        assert deltas[1] == {"content": "The answer"}  # vLLM's chunk after the role's
    else:
        content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("The answer") and len(content) == len("The answer") + 3
    body.update(messages=[{"role": "user", "content": "q"}], continue_final_message=False,
                add_generation_prompt=True)  # fmt: skip
    r = await svc.http.post("/v1/chat/completions", json=body)
    if not stream:  # the last message is not the assistant's: nothing echoed
        assert len(r.json()["choices"][0]["message"]["content"]) == 3
