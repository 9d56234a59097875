"""vLLM 0.32's own chat tests (``tests/entrypoints/openai/chat_completion/test_chat.py``,
``test_chat_echo.py``, ``test_chat_logit_bias_validation.py``,
``test_chat_stop_token_ids_validation.py``, ``test_logprob_token_ids.py``), restated against
``routereplay serve`` on the real engine with only the model-specific values adapted (the model's
name and vocabulary, its chat template's token counts, and a ``max_tokens`` where vLLM's test
leaves a larger model to stop by itself). Each test names the vLLM test it restates; what
differs on purpose is listed in docs/service.md ("vLLM's own tests")."""

from __future__ import annotations

import itertools
import math
import re

import httpx
import openai
import pytest

from engines import Service

pytestmark = pytest.mark.vllm

M1 = [{"role": "system", "content": "you are a helpful assistant"},
      {"role": "user", "content": "what is 1+1?"}]  # fmt: skip
SERIES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"},
]
VOCAB = 1024  # the tiny model's config vocab_size (vLLM's tests: Qwen2.5's 151936)


def chat(client: openai.OpenAI, service: Service, messages=M1, **kw):
    return client.chat.completions.create(model=service.model, messages=messages, **kw)


@pytest.mark.parametrize(("logprobs", "top", "size"), [(False, None, None), (True, 0, 0),
                                                       (True, 5, 5)])  # fmt: skip
def test_no_zero_and_some_logprobs_chat(
    client: openai.OpenAI, service: Service, logprobs: bool, top, size
) -> None:
    """vLLM: test_no_logprobs_chat, test_zero_logprobs_chat, test_some_logprobs_chat."""
    kw = {} if top is None else {"top_logprobs": top}
    c = chat(client, service, max_completion_tokens=5, temperature=0.0, logprobs=logprobs, **kw)
    lp = c.choices[0].logprobs
    if size is None:
        assert lp is None
        return
    assert lp.content is not None and len(lp.content[0].top_logprobs) == size


def test_too_many_chat_logprobs(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_too_many_chat_logprobs (its default max_logprobs, 20)."""
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = chat(client, service, max_completion_tokens=10, logprobs=True, top_logprobs=21,
                      stream=True)  # fmt: skip
        for _ in stream:
            pass
    with pytest.raises(openai.BadRequestError):
        chat(client, service, max_completion_tokens=10, logprobs=True, top_logprobs=30)
    c = chat(client, service, max_completion_tokens=10)
    assert c.choices[0].message.content is not None


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
def test_prompt_logprobs_chat(
    client: openai.OpenAI, service: Service, prompt_logprobs: int | None
) -> None:
    """vLLM: test_prompt_logprobs_chat (with max_tokens: the tiny model stops by length)."""
    extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            chat(client, service, SERIES, max_tokens=5, extra_body=extra)
        return
    c = chat(client, service, SERIES, max_tokens=5, extra_body=extra)
    plp = c.model_extra["prompt_logprobs"]
    if prompt_logprobs is None:
        assert plp is None
    else:
        assert plp is not None and len(plp) > 0


@pytest.mark.parametrize("k", [1, 2])
def test_more_than_one_prompt_logprobs_chat(client: openai.OpenAI, service: Service, k) -> None:
    """vLLM: test_more_than_one_prompt_logprobs_chat (the top k, and the prompt's own token
    when it is not among them)."""
    c = chat(client, service, SERIES, max_tokens=5, extra_body={"prompt_logprobs": k})
    assert k <= len(c.model_extra["prompt_logprobs"][3]) <= k + 1


def test_single_chat_session(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_single_chat_session (its 37 prompt tokens: this template's count)."""
    n_prompt = httpx.post(f"{service.url}/tokenize", json={"messages": M1}).json()["count"]
    c = chat(client, service, max_completion_tokens=5, logprobs=True, top_logprobs=5)
    assert c.id is not None and len(c.choices) == 1
    choice = c.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    usage = (c.usage.completion_tokens, c.usage.prompt_tokens, c.usage.total_tokens)
    assert usage == (5, n_prompt, n_prompt + 5)
    assert choice.message.content is not None and len(choice.message.content) >= 1
    messages = [*M1, {"role": "assistant", "content": choice.message.content},
                {"role": "user", "content": "express your result in json"}]  # fmt: skip
    assert chat(client, service, messages, max_completion_tokens=5).choices[0].message.content


def test_chat_streaming(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_chat_streaming."""
    whole = chat(client, service, max_completion_tokens=10, temperature=0.0).choices[0]
    chunks = list(chat(client, service, max_completion_tokens=10, temperature=0.0, stream=True))
    texts = []
    for ch in chunks:
        delta = ch.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        if delta.content:
            texts.append(delta.content)
    finishes = [i for i, ch in enumerate(chunks) if ch.choices[0].finish_reason is not None]
    assert finishes == [len(chunks) - 1]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert chunks[-1].choices[0].delta.content and "".join(texts) == whole.message.content


FRANCE = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "What is the capital of France?"}]  # fmt: skip


def test_chat_completion_stream_options(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_chat_completion_stream_options, every part (``min_characters`` is another
    release's field)."""
    kw = dict(messages=FRANCE, max_completion_tokens=10, temperature=0.0)
    for ch in chat(client, service, stream=True, stream_options={"include_usage": False}, **kw):
        assert ch.usage is None
    opts = {"include_usage": True, "continuous_usage_stats": False}
    chunks = list(chat(client, service, stream=True, stream_options=opts, **kw))
    last = next(i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].finish_reason)
    assert all(ch.usage is None for ch in chunks[: last + 1])
    u = chunks[last + 1].usage
    assert chunks[last + 1].choices == [] and u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    for opts in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            chat(client, service, stream=False, stream_options=opts, **kw)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(chat(client, service, stream=True, stream_options=opts,
                       extra_body={"min_tokens": 10}, **kw))  # fmt: skip
    counts = []
    for ch in chunks:
        assert ch.usage is not None and ch.usage.prompt_tokens >= 0
        assert ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens
        counts.append(ch.usage.completion_tokens)
    assert all(a < b for a, b in itertools.pairwise(counts[:-1]))
    assert counts[-1] == counts[-2] == 10


LANGS = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift",
         "Kotlin"]  # fmt: skip
LANG_Q = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "The best language for type-safe systems programming is "},
]


def test_structured_outputs_choice_chat(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_structured_outputs_choice_chat, without "the second answer differs" (a
    judgement of the model's)."""
    extra = {"structured_outputs": {"choice": LANGS}}
    first = chat(client, service, LANG_Q, max_completion_tokens=10, temperature=0.7,
                 extra_body=extra).choices[0].message.content  # fmt: skip
    assert first in LANGS
    messages = [*LANG_Q, {"role": "assistant", "content": first},
                {"role": "user", "content": "I disagree, pick another one"}]  # fmt: skip
    second = chat(client, service, messages, max_completion_tokens=10, temperature=0.7,
                  extra_body=extra).choices[0].message.content  # fmt: skip
    assert second in LANGS


IPV4 = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


def test_structured_outputs_regex_chat(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_structured_outputs_regex_chat, without "the second address differs"."""
    q = [{"role": "user", "content": f"Give an example IPv4 address with this regex: {IPV4}"}]
    extra = {"structured_outputs": {"regex": IPV4}}
    ip = chat(client, service, q, max_completion_tokens=20, extra_body=extra)
    assert re.fullmatch(IPV4, ip.choices[0].message.content)
    messages = [*q, {"role": "assistant", "content": ip.choices[0].message.content},
                {"role": "user", "content": "Give me a different one"}]  # fmt: skip
    ip2 = chat(client, service, messages, max_completion_tokens=20, extra_body=extra)
    assert re.fullmatch(IPV4, ip2.choices[0].message.content)


def test_structured_outputs_type_error(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_structured_outputs_type_error."""
    with pytest.raises(openai.BadRequestError):
        chat(client, service, LANG_Q, extra_body={"structured_outputs": {
            "regex": {1: "Python", 2: "C++"}}})  # fmt: skip


def test_structured_outputs_choice_chat_logprobs(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_structured_outputs_choice_chat_logprobs."""
    c = chat(client, service, LANG_Q, max_completion_tokens=10, logprobs=True, top_logprobs=5,
             extra_body={"structured_outputs": {"choice": LANGS}})  # fmt: skip
    content = c.choices[0].logprobs.content
    assert content is not None
    assert all(t.logprob >= -9999.0 for t in content[0].top_logprobs)


def test_response_format_text(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_response_format_text."""
    for _ in range(2):
        c = chat(client, service, [{"role": "user", "content": "what is 1+1?"}],
                 max_completion_tokens=10, response_format={"type": "text"})  # fmt: skip
        assert c.choices[0].message.content is not None


def test_extra_fields_allowed(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_extra_fields_allowed (a message's extra key)."""
    msg = {"role": "user", "content": "what is 1+1?", "extra_field": "0"}
    c = chat(client, service, [msg], max_completion_tokens=5, temperature=0, seed=0)
    assert c.choices[0].message.content is not None


def test_complex_message_content(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_complex_message_content, without its "the answer is 2" (the model's)."""
    parts = [{"type": "text", "text": "what is 1+1? please provide the result without any "
              "other text."}]  # fmt: skip
    c = chat(client, service, [{"role": "user", "content": parts}], max_completion_tokens=5,
             temperature=0, seed=0)  # fmt: skip
    assert c.choices[0].message.content is not None


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
def test_long_seed(client: openai.OpenAI, service: Service, seed: int) -> None:
    """vLLM: test_long_seed (vLLM's message: pydantic's error type; here the bound, named)."""
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, service, [{"role": "system", "content": "hi"}], temperature=0, seed=seed)
    assert "seed" in str(e.value) and ("greater than or equal" in str(e.value)
                                       or "less than or equal" in str(e.value))  # fmt: skip


def test_invocations(service: Service) -> None:
    """vLLM: test_invocations (chat through SageMaker's route: the same fields and choices as
    /v1/chat/completions; vLLM's compares the SDK's dump, whose fields follow the SDK's
    release)."""
    body = {"model": service.model, "messages": M1, "max_completion_tokens": 5,
            "temperature": 0, "logprobs": False}  # fmt: skip
    answers = []
    for path in ("/v1/chat/completions", "/invocations"):
        r = httpx.post(f"{service.url}{path}", json=body, timeout=120)
        r.raise_for_status()
        answers.append(r.json())
    chat_, inv = answers
    assert chat_.keys() == inv.keys()
    assert [c["message"] for c in chat_["choices"]] == [c["message"] for c in inv["choices"]]


def test_chat_completion_n_parameter(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_chat_completion_n_parameter_non_streaming, _streaming, _n_with_seed and
    _n_equals_1."""
    big = [{"role": "user", "content": "What is the opposite of big?"}]
    c = chat(client, service, big, n=3, temperature=1.0, max_completion_tokens=50, seed=42)
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    assert all(ch.message.content for ch in c.choices)
    assert len({ch.message.content for ch in c.choices}) > 1
    got = {0: "", 1: ""}
    for ch in chat(client, service, FRANCE[1:], n=2, temperature=0.7, max_completion_tokens=15,
                   stream=True):  # fmt: skip
        for choice in ch.choices:
            got[choice.index] += choice.delta.content or ""
    assert got[0] and got[1]
    c = chat(client, service, [{"role": "user", "content": "Say hello."}], n=2, seed=42,
             temperature=0.8, max_completion_tokens=10)  # fmt: skip
    assert [ch.index for ch in c.choices] == [0, 1] and all(ch.message.content for ch in c.choices)
    c = chat(client, service, [{"role": "user", "content": "Hello!"}], n=1, temperature=0.7,
             max_completion_tokens=10)  # fmt: skip
    assert len(c.choices) == 1 and c.choices[0].index == 0 and c.choices[0].message.content


SAYING = "An apple a day, keeps"


@pytest.mark.parametrize("echo", [True, False])
def test_chat_session_with_echo_and_continue_final_message(
    client: openai.OpenAI, service: Service, echo: bool
) -> None:
    """vLLM: test_chat_session_with_echo_and_continue_final_message (the tiny model may stop by
    length, as vLLM's basic/ variant allows)."""
    messages = [
        {"role": "user", "content": "tell me a common saying"},
        {"role": "assistant", "content": f"Here is a common saying about apple. {SAYING}"},
    ]
    c = chat(client, service, messages, max_tokens=10, extra_body={
        "echo": echo, "continue_final_message": True, "add_generation_prompt": False})  # fmt: skip
    choice = c.choices[0]
    assert c.id is not None and len(c.choices) == 1 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert (SAYING in choice.message.content) == echo


@pytest.mark.parametrize(("key", "ok"), [(str(VOCAB - 1), True), (str(VOCAB + 1), False)])
def test_chat_logit_bias_valid_and_invalid(
    client: openai.OpenAI, service: Service, key: str, ok: bool
) -> None:
    """vLLM: test_chat_logit_bias_valid, test_chat_logit_bias_invalid."""
    q = [{"role": "user", "content": "Testing valid logit bias"}]
    if ok:
        assert chat(client, service, q, max_tokens=5, logit_bias={key: 1.0}).choices[0].message
        return
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, service, q, max_tokens=5, logit_bias={key: 1.0})
    assert str(VOCAB + 1) in str(e.value) and str(VOCAB) in str(e.value)


BAD_BIAS = [
    ({"not_a_token_id": 50}, ["not_a_token_id"]),
    ({"1": "not_a_number"}, []),
    ({"bad1": 50.0, "bad2": 20.0}, ["bad1", "bad2"]),
]


@pytest.mark.parametrize(("bias", "words"), BAD_BIAS)
def test_chat_logit_bias_bad_keys_and_values(
    client: openai.OpenAI, service: Service, bias: dict, words: list[str]
) -> None:
    """vLLM: test_chat_logit_bias_non_integer_key, _non_numeric_value and
    _multiple_non_integer_keys."""
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, service, [{"role": "user", "content": "x"}], max_tokens=5, logit_bias=bias)
    assert "logit_bias" in str(e.value) and all(w in str(e.value) for w in words)


@pytest.mark.parametrize(("ids", "ok"), [([VOCAB - 1], True), ([VOCAB + 1], False), ([-1], False)])
def test_chat_stop_token_ids_validation(
    client: openai.OpenAI, service: Service, ids: list[int], ok: bool
) -> None:
    """vLLM: test_chat_stop_token_ids_valid, _out_of_vocab, _negative."""
    q = [{"role": "user", "content": "Testing stop token ids"}]
    kw = dict(max_tokens=5, extra_body={"stop_token_ids": ids})
    if ok:
        assert chat(client, service, q, **kw).choices[0].message.content is not None
        return
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, service, q, **kw)
    if ids[0] > 0:
        assert str(VOCAB + 1) in str(e.value) and str(VOCAB) in str(e.value)


def test_logprob_token_ids_returns_requested_ids(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_logprob_token_ids_returns_requested_ids (ids within the tiny vocabulary)."""
    wanted = {100, 500, 1000}
    c = chat(client, service, [{"role": "user", "content": "Hello"}], max_tokens=1,
             temperature=0, logprobs=True, top_logprobs=3,
             extra_body={"logprob_token_ids": sorted(wanted),
                         "return_tokens_as_token_ids": True})  # fmt: skip
    top = c.choices[0].logprobs.content[0].top_logprobs
    assert all(t.token.startswith("token_id:") for t in top)
    ids = {int(t.token.split(":", 1)[1]) for t in top}
    assert len(ids & wanted) >= (3 if ids <= wanted else 2)
    assert all(isinstance(t.logprob, float) and math.isfinite(t.logprob) for t in top)


def test_logprob_token_ids_default_behavior_unchanged(
    client: openai.OpenAI, service: Service
) -> None:
    """vLLM: test_logprob_token_ids_default_behavior_unchanged."""
    c = chat(client, service, [{"role": "user", "content": "Hello"}], max_tokens=1,
             temperature=0, logprobs=True, top_logprobs=5)  # fmt: skip
    top = c.choices[0].logprobs.content[0].top_logprobs
    assert len(top) == 5 and all(t.logprob <= 0.0 for t in top)
