"""vLLM 0.32's own server tests beyond the two completion APIs (``tests/entrypoints/openai/
basic/test_basic.py``, ``basic/test_return_token_ids.py``, ``openai/models/test_models.py``,
``serve/tokenize/test_tokenization.py``, ``serve/instrumentator/test_metrics.py`` and
``test_optional_middleware.py``), restated against ``routereplay serve`` on the real engine with
only the model-specific values adapted (the model's name, path and context, its tokenizer's ids,
its chat template, and the sizes of the cancellation flood for a 2-core host). Each test names
the vLLM test it restates; what differs on purpose is listed in docs/service.md ("vLLM's own
tests")."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines import Service

pytestmark = pytest.mark.vllm


def test_show_version_and_check_health(service: Service) -> None:
    """vLLM: test_show_version (the release serving under ``version``), test_check_health."""
    r = httpx.get(f"{service.url}/version")
    assert r.status_code == 200 and r.json()["version"]
    assert httpx.get(f"{service.url}/health").status_code == 200


def test_request_cancellation(service: Service) -> None:
    """vLLM: test_request_cancellation, scaled to the 2-core host (32 requests of 1000 tokens
    where vLLM sends 200 of 10000): every client times out, and the engine serves the next."""
    msgs = [{"role": "user", "content": "Write a long story"}]

    async def flood() -> list[BaseException | object]:
        async with openai.AsyncOpenAI(base_url=service.v1, api_key="x", max_retries=0,
                                      timeout=0.5) as c:  # fmt: skip
            calls = [c.chat.completions.create(model=service.model, messages=msgs,
                                               max_tokens=1000, extra_body={"min_tokens": 1000})
                     for _ in range(32)]  # fmt: skip
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(flood())
    assert all(isinstance(r, openai.APITimeoutError) for r in results), results
    with openai.OpenAI(base_url=service.v1, api_key="x", max_retries=0, timeout=60) as c:
        r = c.chat.completions.create(model=service.model, messages=msgs, max_tokens=10)
    assert len(r.choices) == 1


def test_request_wrong_content_type(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_request_wrong_content_type."""
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(
            model=service.model, messages=[{"role": "user", "content": "x"}], max_tokens=10,
            extra_headers={"Content-Type": "application/x-www-form-urlencoded"},
        )  # fmt: skip


@pytest.mark.parametrize("return_token_ids", [True, False, None])
def test_basic_completion_with_emoji(
    client: openai.OpenAI, service: Service, tokenizer, return_token_ids: bool | None
) -> None:
    """vLLM: test_basic_completion_with_emoji."""
    prompt = "Complete this sentence with emojis: I love coding 🚀"
    extra = (
        {} if return_token_ids is None else {"extra_body": {"return_token_ids": return_token_ids}}
    )
    c = client.completions.create(model=service.model, prompt=prompt, max_tokens=10,
                                  temperature=0, logprobs=1, **extra)  # fmt: skip
    choice = c.choices[0]
    assert "prompt_token_ids" in choice.model_dump()
    if not return_token_ids:
        assert choice.token_ids is None and choice.prompt_token_ids is None
        return
    want = tokenizer.encode(prompt)
    got = choice.prompt_token_ids
    assert any(got[i : i + len(want)] == want for i in range(len(got) - len(want) + 1))
    assert choice.token_ids and tokenizer.decode(choice.token_ids).startswith(choice.text)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["location"]},
}}]  # fmt: skip


def test_chat_completion_with_tool_use(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_chat_completion_with_tool_use (the pythonic parser where vLLM's runs hermes;
    its prompt text is its template's)."""
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What's the weather like in Paris?"}]  # fmt: skip
    kw = dict(model=service.model, messages=msgs, tools=WEATHER, tool_choice="auto",
              max_tokens=100, temperature=0, logprobs=True)  # fmt: skip
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    assert isinstance(r.choices[0].token_ids, list) and isinstance(r.prompt_token_ids, list)
    for call in r.choices[0].message.tool_calls or []:
        assert call.function.name == "get_weather"
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": False})
    assert r.choices[0].token_ids is None and r.prompt_token_ids is None


def test_comparison_with_prompt_logprobs_and_logprobs(
    client: openai.OpenAI, service: Service, tokenizer
) -> None:
    """vLLM: test_comparison_with_prompt_logprobs_and_logprobs."""
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    c = client.completions.create(model=service.model, prompt="Hello, world! How are you today?",
                                  max_tokens=20, temperature=0, echo=True, logprobs=1,
                                  extra_body={**extra, "prompt_logprobs": 1})  # fmt: skip
    ch = c.choices[0]
    assert ch.token_ids and ch.prompt_token_ids and ch.prompt_logprobs and ch.logprobs
    ids = [int(t.split(":", 1)[1]) for t in ch.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in ch.logprobs.tokens)
    assert len(ids) > len(ch.token_ids) and ids[-len(ch.token_ids) :] == ch.token_ids
    assert "Hello, world" in tokenizer.decode(ch.prompt_token_ids)
    assert ch.text.endswith(tokenizer.decode(ch.token_ids))
    stream = client.completions.create(model=service.model, max_tokens=30, temperature=0,
                                       prompt="Tell me a short fact about Python:", logprobs=1,
                                       stream=True, extra_body=extra)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].prompt_token_ids
    got = [t for ch in chunks for t in (ch.choices[0].token_ids or [])]
    lps = [ch.choices[0].logprobs for ch in chunks]
    via_logprobs = [int(t.split(":", 1)[1]) for lp in lps if lp for t in lp.tokens]
    assert got == via_logprobs and got


def test_chat_completion_with_emoji_and_token_ids(
    client: openai.OpenAI, service: Service, tokenizer
) -> None:
    """vLLM: test_chat_completion_with_emoji_and_token_ids (the tiny model stops by length, so
    no end-of-turn token follows the content; the prompt's text is the template's)."""
    msgs = [{"role": "system", "content": "You like to use emojis in your responses."},
            {"role": "user", "content": "Repeat after me: I love cats 🐱"}]  # fmt: skip
    kw = dict(model=service.model, messages=msgs, max_tokens=50, temperature=0,
              extra_body={"return_token_ids": True})  # fmt: skip
    r = client.chat.completions.create(**kw, logprobs=True)
    assert r.choices[0].token_ids is not None and "prompt_token_ids" in r.model_dump()
    prompt_text = tokenizer.decode(r.prompt_token_ids)
    assert "I love cats 🐱" in prompt_text
    assert tokenizer.decode(r.choices[0].token_ids) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert tokenizer.decode(chunks[0].prompt_token_ids) == prompt_text
    assert all("prompt_token_ids" not in ch.model_dump(exclude_unset=True) for ch in chunks[1:])
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    ids = [t for ch in chunks if ch.choices
           for t in (getattr(ch.choices[0], "token_ids", None) or [])]  # fmt: skip
    assert text and ids and tokenizer.decode(ids) == text


def test_check_and_retrieve_models(client: openai.OpenAI, service: Service) -> None:
    """vLLM: test_check_models, test_retrieve_base_model, test_retrieve_unknown_model (``root``
    is the model's path: vLLM's test serves a hub id, which is its own path)."""
    models = client.models.list().data
    assert models[0].id == service.model and models[0].root == str(service.model_path)
    m = client.models.retrieve(service.model)
    assert m.id == service.model and m.root == str(service.model_path)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("this-model-does-not-exist")
    assert "does not exist" in str(e.value)


def tokenize(service: Service, body: dict) -> dict:
    r = httpx.post(f"{service.url}/tokenize", json={"model": service.model, **body})
    assert r.status_code == 200, r.text
    return r.json()


def check_tokens(got: dict, want: list[int]) -> None:
    assert got["tokens"] == want and got["count"] == len(want)
    assert got["max_model_len"] == 2048 and "token_strs" in got and got["token_strs"] is None


@pytest.mark.parametrize("add_special", [False, True])
def test_tokenize_completions(service: Service, tokenizer, add_special: bool) -> None:
    """vLLM: test_tokenize_completions (max_model_len: the service's 2048)."""
    prompt = "vllm1 This is a test prompt."
    got = tokenize(service, {"add_special_tokens": add_special, "prompt": prompt})
    check_tokens(got, tokenizer.encode(prompt, add_special_tokens=add_special))


CONV = [{"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Nice to meet you!"},
        {"role": "user", "content": "Can I ask a question? vllm1"}]  # fmt: skip


@pytest.mark.parametrize("add_special", [False, True])
@pytest.mark.parametrize(("add_generation", "continue_final"), [(False, False), (True, False),
                                                                (False, True)])  # fmt: skip
def test_tokenize_chat(
    service: Service, tokenizer, add_generation: bool, continue_final: bool, add_special: bool
) -> None:
    """vLLM: test_tokenize_chat."""
    conv = CONV + ([{"role": "assistant", "content": "Sure,"}] if continue_final else [])
    text = tokenizer.apply_chat_template(
        conv,
        add_generation_prompt=add_generation,
        continue_final_message=continue_final,
        tokenize=False,
    )
    got = tokenize(service, {"messages": conv, "add_generation_prompt": add_generation,
                             "continue_final_message": continue_final,
                             "add_special_tokens": add_special})  # fmt: skip
    check_tokens(got, tokenizer.encode(text, add_special_tokens=add_special))


def test_tokenize_chat_with_tools(service: Service, tokenizer) -> None:
    """vLLM: test_tokenize_chat_with_tools."""
    conv = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}}}}]  # fmt: skip
    for add_special in (False, True):
        text = tokenizer.apply_chat_template(conv, tools=tools, add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
        got = tokenize(service, {"messages": conv, "tools": tools, "add_generation_prompt": True,
                                 "add_special_tokens": add_special})  # fmt: skip
        check_tokens(got, tokenizer.encode(text, add_special_tokens=add_special))


def test_tokenize_with_return_token_strs_and_detokenize(service: Service, tokenizer) -> None:
    """vLLM: test_tokenize_with_return_token_strs, test_detokenize."""
    prompt = "This is a token_strs test prompt! vllm1"
    got = tokenize(service, {"prompt": prompt, "return_token_strs": True})
    want = tokenizer.encode(prompt, add_special_tokens=True)
    assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == 2048
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(want)
    text = "This is a test prompt. vllm1"
    ids = tokenizer.encode(text, add_special_tokens=False)
    r = httpx.post(f"{service.url}/detokenize", json={"model": service.model, "tokens": ids})
    assert r.json() == {"prompt": text}


def metrics(service: Service) -> dict[str, float]:
    body = httpx.get(f"{service.url}/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(body)
            for s in fam.samples if not s.labels.keys() - {"model_name", "engine"}}  # fmt: skip


def test_metrics_counts(service: Service, tokenizer) -> None:
    """vLLM: test_metrics_counts, every family it means to check (as differences: the shared
    engine served other tests before; ``ignore_eos`` so each request has its 10 tokens)."""
    prompt = tokenizer.encode("Hello my name is Robert and I love magic")
    n, p = 10, len(prompt)
    before = metrics(service)
    for _ in range(n):
        body = {"model": service.model, "prompt": prompt, "max_tokens": 10, "ignore_eos": True}
        r = httpx.post(f"{service.v1}/completions", timeout=60, json=body)
        assert r.status_code == 200, r.text
    after = metrics(service)

    def grew(name: str) -> float:
        return after[f"vllm:{name}"] - before.get(f"vllm:{name}", 0.0)

    for fam in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                "request_queue_time_seconds", "request_inference_time_seconds",
                "request_prefill_time_seconds", "request_decode_time_seconds",
                "request_params_n", "request_prompt_tokens", "request_generation_tokens",
                "request_params_max_tokens"):  # fmt: skip
        assert grew(f"{fam}_count") == n, fam
    assert grew("inter_token_latency_seconds_count") == n * 9
    assert grew("request_prompt_tokens_sum") == n * p and grew("prompt_tokens_total") == n * p
    assert grew("request_generation_tokens_sum") == grew("generation_tokens_total") == n * 10
    assert grew("request_params_max_tokens_sum") == n * 10
    assert grew("iteration_tokens_total_sum") == n * (p + 10)
    assert grew("iteration_tokens_total_count") == n * 10


EXPECTED = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions_total", "prompt_tokens_total",
    "generation_tokens_total", "iteration_tokens_total", "cache_config_info",
    "request_success_total",
    *(f"{h}_{part}" for h in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n",
        "request_params_max_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds") for part in ("sum", "bucket", "count")),
]  # fmt: skip


def test_metrics_exist(service: Service) -> None:
    """vLLM: test_metrics_exist."""
    body = {"model": service.model, "prompt": "Hello, my name is", "max_tokens": 5,
            "temperature": 0}  # fmt: skip
    r = httpx.post(f"{service.v1}/completions", timeout=60, json=body)
    assert r.status_code == 200
    body = httpx.get(f"{service.url}/metrics")
    assert body.status_code == 200
    missing = [m for m in EXPECTED if f"vllm:{m}" not in body.text]
    assert not missing
    infos = [s for fam in text_string_to_metric_families(body.text)
             for s in fam.samples if s.name.startswith("vllm:cache_config_info")]  # fmt: skip
    assert infos
    for s in infos:
        for label in ("kv_cache_size_tokens", "kv_cache_max_concurrency"):
            assert s.labels.get(label) not in (None, "None", ""), label


def test_abort_metrics_reset(service: Service, tokenizer) -> None:
    """vLLM: test_abort_metrics_reset."""
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    assert [metrics(service)[g] for g in gauges] == [0, 0, 0]
    prompt = tokenizer.encode("Hello my name is Robert and I love magic")

    async def run_and_cancel() -> list[float]:
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"model": service.model, "prompt": prompt, "max_tokens": 500, "temperature": 0}
            tasks = [asyncio.create_task(c.post(f"{service.v1}/completions", json=body))
                     for _ in range(3)]  # fmt: skip
            seen: list[float] = [0, 0, 0]
            for _ in range(100):
                await asyncio.sleep(0.1)
                seen = [metrics(service)[g] for g in gauges]
                if seen[0] > 0:
                    break
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return seen

    running, _, kv = asyncio.run(run_and_cancel())
    assert running > 0 and kv > 0
    deadline = time.monotonic() + 10
    while (now := [metrics(service)[g] for g in gauges]) != [0, 0, 0]:
        assert time.monotonic() < deadline, now
        time.sleep(0.2)


def test_no_api_token_and_no_request_id_header(service: Service) -> None:
    """vLLM: test_no_api_token, test_no_request_id_header (a service without keys)."""
    assert httpx.get(f"{service.v1}/models").status_code == 200
    assert "X-Request-Id" not in httpx.get(f"{service.url}/health").headers
