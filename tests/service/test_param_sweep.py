"""No request parameter can kill or wedge the real engine: every sampling field at its edges,
through the official openai SDK, is served (200) or refused (400 naming the field), and the
engine serves normally afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from engines import Service

pytestmark = pytest.mark.vllm

VOCAB = 1024  # the tiny model's vocabulary
I64 = 2**63 - 1

# (extra fields, expected status). Each request asks for 2 tokens at temperature 1 unless set.
EDGES = [
    ({"top_p": 1e-9}, 200), ({"top_p": 0.5}, 200), ({"top_p": 1.0}, 200),
    ({"top_k": -1}, 200), ({"top_k": 0}, 200), ({"top_k": 1}, 200), ({"top_k": 5}, 200),
    ({"top_k": 10**9}, 200), ({"top_k": I64}, 200), ({"top_k": 3, "top_p": 0.3}, 200),
    ({"min_p": 0.0}, 200), ({"min_p": 1.0}, 200),
    ({"seed": I64}, 200), ({"seed": -(2**63)}, 200), ({"seed": -1}, 200), ({"seed": 0}, 200),
    ({"temperature": 0.0}, 200), ({"temperature": 1e-6}, 200), ({"temperature": 2.0}, 200),
    ({"presence_penalty": 2.0, "frequency_penalty": -2.0}, 200),
    ({"presence_penalty": -2.0, "frequency_penalty": 2.0}, 200),
    ({"repetition_penalty": 0.01}, 200), ({"repetition_penalty": 2.0}, 200),
    ({"logit_bias": {"0": 100}}, 200), ({"logit_bias": {str(VOCAB - 1): -100}}, 200),
    ({"logit_bias": {str(10**6): 5}}, 400),
    ({"allowed_token_ids": [0]}, 200), ({"allowed_token_ids": [VOCAB - 1, 5]}, 200),
    ({"allowed_token_ids": [10**6]}, 400),
    ({"bad_words": ["the", "a"]}, 200), ({"stop": ["a", "b", "c", "d"]}, 200),
    ({"stop_token_ids": [0, VOCAB - 1]}, 200), ({"min_tokens": 2}, 200), ({"min_tokens": 3}, 400),
    ({"ignore_eos": True, "include_stop_str_in_output": True}, 200),
    ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, 200),
    ({"n": 64, "max_tokens": 1}, 200), ({"n": 64, "temperature": 0.0}, 400),
    ({"max_tokens": 1}, 200), ({"logprobs": 20}, 200), ({"logprobs": 0}, 200),
    ({"best_of": 2, "n": 2}, 200),
]  # fmt: skip


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=service.v1, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_every_edge_is_served_or_refused_and_the_engine_lives(
    client: openai.OpenAI, service: Service
) -> None:
    outcomes = []
    for extra, want in EDGES:
        body = {"max_tokens": 2, "temperature": 1.0, **extra}
        top = {k: body.pop(k) for k in ("max_tokens", "temperature", "n", "seed", "top_p",
                                        "presence_penalty", "frequency_penalty", "logprobs",
                                        "stop", "logit_bias", "best_of") if k in body}  # fmt: skip
        try:
            r = client.completions.create(
                model=service.model, prompt="edge case", extra_body=body, **top
            )
            got = 200
            assert all(c.routed_experts["status"] == "stored" for c in r.choices), extra
        except openai.BadRequestError as e:
            got = 400
            assert e.body and e.body.get("param"), (extra, e.body)
        outcomes.append((extra, want, got))
        # The engine is alive after each one.
        assert httpx.get(f"{service.url}/health").status_code == 200, extra
    wrong = [(e, w, g) for e, w, g in outcomes if w != g]
    assert not wrong, wrong
    ok = client.chat.completions.create(
        model=service.model, messages=[{"role": "user", "content": "still there?"}], max_tokens=3
    )
    assert ok.choices[0].routed_experts["status"] == "stored"
