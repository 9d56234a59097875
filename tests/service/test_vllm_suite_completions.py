"""vLLM 0.32's own completions tests (``tests/entrypoints/openai/completion/test_completion.py``),
restated against ``routereplay serve`` on the real engine with only the model-specific values
adapted: the model's name, its tokenizer's counts, and prompts unique to each test (the shared
engine caches prefixes that vLLM's fixture, ``--no-enable-prefix-caching``, does not). Each test
names the vLLM test it restates; what differs on purpose is listed in docs/service.md ("vLLM's
own tests")."""

from __future__ import annotations

import re

import openai
import pytest

from engines import Service

pytestmark = pytest.mark.vllm


def complete(client: openai.OpenAI, service: Service, **kw):
    return client.completions.create(model=service.model, **kw)


def test_single_completion(client: openai.OpenAI, service: Service, tokenizer) -> None:
    """vLLM: test_single_completion (its prompt's 6 tokens: this tokenizer's count)."""
    prompt = "Hello, my name is Suite-1"
    c = complete(client, service, prompt=prompt, max_tokens=5, temperature=0.0)
    assert c.id is not None and len(c.choices) == 1
    choice = c.choices[0]
    assert choice.text and choice.finish_reason == "length"
    n_prompt = len(tokenizer(prompt).input_ids)
    assert (c.usage.completion_tokens, c.usage.prompt_tokens) == (5, n_prompt)
    assert c.usage.total_tokens == n_prompt + 5
    assert c.usage.prompt_tokens_details is not None
    assert c.usage.prompt_tokens_details.cached_tokens == 0
    c = complete(client, service, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0)
    assert len(c.choices[0].text) >= 1 and c.choices[0].prompt_logprobs is None


def test_completion_truncation_side_controls_prompt_truncation(
    client: openai.OpenAI, service: Service
) -> None:
    """vLLM: test_completion_truncation_side_controls_prompt_truncation."""
    ids = list(range(8))
    for side, kept in (("right", ids[:4]), ("left", ids[-4:])):
        extra = {"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side}
        c = complete(client, service, prompt=ids, max_tokens=1, temperature=0.0, extra_body=extra)
        assert c.choices[0].prompt_token_ids == kept, side


@pytest.mark.parametrize(("logprobs", "sizes"), [(None, None), (0, (1, 1)), (5, (5, 6))])
def test_no_zero_and_some_logprobs(
    client: openai.OpenAI, service: Service, logprobs: int | None, sizes
) -> None:
    """vLLM: test_no_logprobs, test_zero_logprobs, test_some_logprobs."""
    c = complete(client, service, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0,
                 logprobs=logprobs)  # fmt: skip
    lp = c.choices[0].logprobs
    if sizes is None:
        assert lp is None
        return
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert sizes[0] <= len(lp.top_logprobs[0]) <= sizes[1]


def test_too_many_completion_logprobs(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_too_many_completion_logprobs (its default max_logprobs, 20)."""
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        complete(client, service, prompt=[0] * 5, max_tokens=5, temperature=0.0, logprobs=21)
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = complete(client, service, prompt=[0] * 5, max_tokens=5, temperature=0.0,
                          logprobs=30, stream=True)  # fmt: skip
        for _ in stream:
            pass
    c = complete(client, service, prompt=[0] * 5, max_tokens=5, temperature=0.0)
    assert len(c.choices[0].text) >= 0


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_completion(
    client: openai.OpenAI, service: Service, prompt_logprobs: int | None
) -> None:
    """vLLM: test_prompt_logprobs_completion (its default max_tokens, 16)."""
    kw: dict = {"prompt": ["A robot may not injure another robot", "My name is"]}
    if prompt_logprobs is not None:
        kw["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            complete(client, service, **kw)
        return
    c = complete(client, service, **kw)
    if prompt_logprobs is None:
        assert c.choices[0].prompt_logprobs is None
        return
    for choice in c.choices[:2]:
        assert choice.prompt_logprobs is not None and len(choice.prompt_logprobs) > 0


def test_completion_streaming(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_completion_streaming."""
    prompt = "What is an LLM? Suite-2"
    whole = complete(client, service, prompt=prompt, max_tokens=5, temperature=0.0)
    stream = complete(client, service, prompt=prompt, max_tokens=5, temperature=0.0, stream=True)
    texts, finishes = [], 0
    for chunk in stream:
        texts.append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and chunk.choices[0].finish_reason == "length"
    assert chunk.choices[0].text and "".join(texts) == whole.choices[0].text


def test_parallel_no_streaming(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_parallel_no_streaming, without its "finished at different times" check: the
    tiny random model reaches its end-of-text token too rarely for 50 tokens to show it."""
    c = complete(client, service, prompt="What is an LLM?", max_tokens=50, n=3, temperature=1.0,
                 logprobs=0, seed=42)  # fmt: skip
    assert len(c.choices) == 3
    for i, choice in enumerate(c.choices):
        assert choice.index == i and choice.finish_reason is not None
        assert len(choice.logprobs.tokens) <= 50
    assert len({choice.text for choice in c.choices}) == 3


def test_parallel_streaming(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_parallel_streaming, without the "finished at different times" check (as
    above)."""
    stream = complete(client, service, prompt="What is an LLM?", max_tokens=50, n=3,
                      temperature=1.0, stream=True, seed=42)  # fmt: skip
    parts: list[list[str]] = [[] for _ in range(3)]
    finishes = 0
    for chunk in stream:
        parts[chunk.choices[0].index].append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 3
    assert all(len(p) <= 50 for p in parts) and len({"".join(p) for p in parts}) == 3


def _usage_ok(u) -> bool:
    return (
        u.prompt_tokens > 0
        and u.completion_tokens > 0
        and (u.total_tokens == u.prompt_tokens + u.completion_tokens)
    )


@pytest.mark.parametrize(("include", "continuous"), [(False, False), (False, True), (True, False),
                                                     (True, True), (None, None)])  # fmt: skip
def test_completion_stream_options(
    client: openai.OpenAI, service: Service, include: bool | None, continuous: bool | None
) -> None:
    """vLLM: test_completion_stream_options, streamed (``None``: ``stream_options: {}``)."""
    opts = {} if include is None else {"include_usage": include,
                                       "continuous_usage_stats": continuous}  # fmt: skip
    stream = complete(client, service, prompt="What is the capital of France?", max_tokens=5,
                      temperature=0.0, stream=True, stream_options=opts)  # fmt: skip
    chunks = list(stream)
    if not include:
        assert all(ch.usage is None for ch in chunks)
        return
    last = next(i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].finish_reason)
    final = chunks[last + 1]
    assert final.choices == [] and final.usage is not None and _usage_ok(final.usage)
    for ch in chunks[: last + 1]:
        assert (ch.usage is not None and _usage_ok(ch.usage)) if continuous else ch.usage is None


@pytest.mark.parametrize("opts", [{"include_usage": None}, {"include_usage": True},
                                  {"continuous_usage_stats": None},
                                  {"continuous_usage_stats": True}])  # fmt: skip
def test_completion_stream_options_without_stream(
    client: openai.OpenAI, service: Service, opts: dict
) -> None:
    """vLLM: test_completion_stream_options, its ``stream: false`` half."""
    with pytest.raises(openai.BadRequestError):
        complete(client, service, prompt="What is the capital of France?", max_tokens=5,
                 temperature=0.0, stream=False, stream_options=opts)  # fmt: skip


@pytest.mark.parametrize("prompts", [["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2])
def test_batch_completions(client: openai.OpenAI, service: Service, prompts: list) -> None:
    """vLLM: test_batch_completions, without its ``n: 2`` with ``use_beam_search`` part (beam
    search is not served: docs/service.md)."""
    batch = complete(client, service, prompt=prompts, max_tokens=5, temperature=0.0)
    assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
    stream = complete(client, service, prompt=prompts, max_tokens=5, temperature=0.0, stream=True)
    texts = ["", ""]
    for chunk in stream:
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts[0] == texts[1]


@pytest.mark.parametrize("logprobs", [1, 0])
@pytest.mark.parametrize("prompt", ["Hello, my name is", [0, 0, 0, 0, 0]])
def test_echo_logprob_completion(
    client: openai.OpenAI, service: Service, tokenizer, logprobs: int, prompt
) -> None:
    """vLLM: test_echo_logprob_completion."""
    c = complete(client, service, prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
                 logprobs=logprobs)  # fmt: skip
    text = tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
    assert re.search("^" + re.escape(text), c.choices[0].text)
    lp = c.choices[0].logprobs
    assert len(lp.text_offset) > 5 and len(lp.tokens) > 5
    assert len(lp.token_logprobs) > 5 and lp.token_logprobs[0] is None
    assert len(lp.top_logprobs) > 5 and lp.top_logprobs[0] is None
    for top in lp.top_logprobs[1:]:
        assert max(logprobs, 1) <= len(top) <= logprobs + 1


INVALID_SCHEMA = {
    "properties": {"brand": {"type": "string"}, "foo": "bar"},
    "required": ["brand"], "type": "object",
}  # fmt: skip
INVALID_GRAMMAR = 'root ::= select_statementinvalidsyntax\nselect_statement ::= "SELECT "'


@pytest.mark.parametrize("constraint", [{"json": INVALID_SCHEMA}, {"regex": r"[.*"},
                                        {"grammar": INVALID_GRAMMAR}])  # fmt: skip
def test_invalid_json_schema_regex_and_grammar(
    client: openai.OpenAI, service: Service, constraint: dict
) -> None:
    """vLLM: test_invalid_json_schema, test_invalid_regex, test_invalid_grammar."""
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        complete(client, service, prompt="Generate one", max_tokens=5,
                 extra_body={"structured_outputs": constraint})  # fmt: skip
    c = complete(client, service, prompt="still serving", max_tokens=2)
    assert c.choices[0].finish_reason == "length"
