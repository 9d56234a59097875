"""vLLM's request fields beyond OpenAI's on the real engine, each storing its routes as a plain
request does: batched prompts, ``echo``, ``prompt_logprobs``, ``truncate_prompt_tokens``,
``logprob_token_ids`` and ``return_tokens_as_token_ids`` (their shapes:
tests/app/test_vllm_fields.py)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from .test_openai_api import EXTRA, check_handle, fetch
from engines import Service

pytestmark = pytest.mark.vllm


def post(service: Service, path: str, body: dict, rid: str) -> httpx.Response:
    r = httpx.post(f"{service.url}{path}", json={"model": service.model, **body},
                   headers={"X-Request-Id": rid}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return r


def check_record(service: Service, route_id: str, prompt_ids: list[int], out_ids: list[int]):
    rec = fetch(service, route_id)
    assert rec.token_ids.tolist() == prompt_ids + out_ids and rec.prompt_len == len(prompt_ids)
    assert rec.valid[:-1].all() and not rec.valid[-1]
    return rec


def test_a_batch_stores_each_prompts_choices(client: openai.OpenAI, service: Service) -> None:
    prompts = ["The router picks", "Experts two and five"]
    r = client.completions.create(
        model=service.model, prompt=prompts, n=2, max_tokens=4, temperature=0.8, seed=7,
        extra_body={**EXTRA, "return_token_ids": True}, extra_headers={"X-Request-Id": "rb-1"},
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        ids, out = c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
        check_handle(c.model_extra["routed_experts"], service, len(ids) + 4)
        check_record(service, f"rb-1-{c.index}", ids, out)
    ids0, ids1 = (r.choices[i].model_extra["prompt_token_ids"] for i in (0, 2))
    assert ids0 != ids1 and r.usage.prompt_tokens == len(ids0) + len(ids1)
    # Each prompt's rows are its own: the same prompt alone routes its prompt rows the same.
    alone = client.completions.create(
        model=service.model, prompt=prompts[1], max_tokens=1, extra_body=EXTRA,
        extra_headers={"X-Request-Id": "rb-alone"},
    )  # fmt: skip
    assert alone.choices[0].finish_reason == "length"
    a, b = fetch(service, "rb-alone-0"), fetch(service, "rb-1-2")
    n = len(ids1) - 1
    assert np.array_equal(a.experts[:n], b.experts[:n])


def test_a_streamed_batch_stores_every_choice(service: Service) -> None:
    body = {"prompt": ["one", "two three"], "max_tokens": 3, "stream": True, **EXTRA}
    r = post(service, "/v1/completions", body, "rb-s")
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    done = {c["choices"][0]["index"]: c["choices"][0] for c in chunks
            if c["choices"] and c["choices"][0]["finish_reason"]}  # fmt: skip
    assert sorted(done) == [0, 1]
    for i, c in done.items():
        assert c["routed_experts"]["route_id"] == f"rb-s-{i}"
        assert c["routed_experts"]["status"] == "stored"


def test_echo_with_logprobs_shows_the_prompt_and_stores_the_plain_route(service: Service) -> None:
    body = {"prompt": "Echo this prompt", "max_tokens": 3, "echo": True, "logprobs": 1,
            "temperature": 0, **EXTRA}  # fmt: skip
    c = post(service, "/v1/completions", body, "re-1").json()["choices"][0]
    assert c["text"].startswith("Echo this prompt")
    lp = c["logprobs"]
    plain = post(service, "/v1/completions", {**body, "echo": False, "return_token_ids": True},
                 "re-2").json()["choices"][0]  # fmt: skip
    n_prompt = len(plain["prompt_token_ids"])
    assert len(lp["tokens"]) == n_prompt + 3 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and all(len(t) in (1, 2) for t in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"]) == c["text"]
    a, b = fetch(service, "re-1-0"), fetch(service, "re-2-0")
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert np.array_equal(a.experts[:n_prompt], b.experts[:n_prompt])


def test_echo_without_new_tokens_scores_the_prompt(service: Service) -> None:
    body = {"prompt": "Score me", "max_tokens": 0, "echo": True, "logprobs": 0}
    c = post(service, "/v1/completions", body, "re-0").json()["choices"][0]
    assert c["text"] == "Score me" and c["logprobs"]["token_logprobs"][0] is None
    rec = fetch(service, "re-0-0")
    assert rec.prompt_len == len(c["logprobs"]["tokens"]) and rec.valid[: rec.prompt_len].all()


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_prompt_logprobs_match_echoed_logprobs(service: Service, api: str) -> None:
    if api == "chat":
        body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
                "prompt_logprobs": 1, "return_token_ids": True, **EXTRA}  # fmt: skip
        r = post(service, "/v1/chat/completions", body, "rp-chat").json()
        plp, ids = r["prompt_logprobs"], r["prompt_token_ids"]
    else:
        body = {"prompt": "Prompt logprobs here", "max_tokens": 2, "prompt_logprobs": 1,
                "return_token_ids": True, **EXTRA}  # fmt: skip
        c = post(service, "/v1/completions", body, "rp-cmpl").json()["choices"][0]
        plp, ids = c["prompt_logprobs"], c["prompt_token_ids"]
        echo = {"prompt": body["prompt"], "max_tokens": 0, "echo": True, "logprobs": 1}
        lp = post(service, "/v1/completions", echo, "rp-echo").json()["choices"][0]["logprobs"]
        own = [plp[j][str(t)]["logprob"] for j, t in enumerate(ids) if j]
        assert lp["token_logprobs"][1:] == pytest.approx(own, abs=1e-4)
    assert len(plp) == len(ids) and plp[0] is None
    for tok, pos in zip(ids[1:], plp[1:], strict=True):
        assert str(tok) in pos and len(pos) in (1, 2)
    rec = fetch(service, f"rp-{'chat' if api == 'chat' else 'cmpl'}-0")
    assert rec.token_ids.tolist()[: len(ids)] == ids and rec.prompt_len == len(ids)


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncate_prompt_tokens_cuts_the_prompt_and_its_route(service: Service, side: str) -> None:
    ids = list(range(100, 130))
    body = {"prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 8, "truncation_side": side,
            "return_token_ids": True, **EXTRA}  # fmt: skip
    r = post(service, "/v1/completions", body, f"rt-{side}").json()
    c = r["choices"][0]
    want = ids[-8:] if side == "left" else ids[:8]
    assert c["prompt_token_ids"] == want and r["usage"]["prompt_tokens"] == 8
    check_record(service, f"rt-{side}-0", want, c["token_ids"])


def test_logprob_token_ids_and_tokens_as_ids(client: openai.OpenAI, service: Service) -> None:
    wanted = [5, 17, 40]
    r = client.completions.create(
        model=service.model, prompt="Label it", max_tokens=3, logprobs=0,
        extra_body={**EXTRA, "logprob_token_ids": wanted, "return_tokens_as_token_ids": True,
                    "return_token_ids": True},
    )  # fmt: skip
    c = r.choices[0]
    out = c.model_extra["token_ids"]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in out]
    for t, top in zip(out, c.logprobs.top_logprobs, strict=True):
        assert set(top) == {f"token_id:{x}" for x in [t, *wanted]}
    chat = client.chat.completions.create(
        model=service.model, messages=[{"role": "user", "content": "x"}], max_tokens=2,
        logprobs=True, extra_body={**EXTRA, "logprob_token_ids": wanted},
    )  # fmt: skip
    for e in chat.choices[0].logprobs.content:
        assert len(e.top_logprobs) in (3, 4)
