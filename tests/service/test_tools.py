"""Tool calling on the real engine through vLLM's own tool parser (the shared engine runs with
``--tool-call-parser pythonic --enable-auto-tool-choice``): ``tool_choice`` required, named and
auto, whole and streamed, each turn's routes stored as a plain request's (a tool-call turn and the
turn after it included). The tiny random model calls a tool only when made to: required and named
choices constrain it by the tools' schema (vLLM's adjust_request), auto by a regex in the
pythonic parser's syntax."""

from __future__ import annotations

import json

import openai
import pytest

from .test_openai_api import fetch
from engines import Service

pytestmark = pytest.mark.vllm

TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False},
}}]  # fmt: skip
MSGS = [{"role": "user", "content": "What is the weather?"}]
PYTHONIC = r"\[get_weather\(city='Paris'\)\]"


def check_route(service: Service, r, rid: str) -> None:
    prompt = r.model_extra["prompt_token_ids"]
    c = r.choices[0]
    rec = fetch(service, f"{rid}-0")
    assert rec.token_ids.tolist() == prompt + c.model_extra["token_ids"]
    assert rec.valid[:-1].all() and rec.prompt_len == len(prompt)


def ask(client: openai.OpenAI, service: Service, rid: str, **kw):
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    return client.chat.completions.create(
        model=service.model, messages=kw.pop("messages", MSGS), tools=TOOLS, seed=1,
        temperature=0.3, max_tokens=kw.pop("max_tokens", 400), extra_body=extra,
        extra_headers={"X-Request-Id": rid}, **kw,
    )  # fmt: skip


def test_required_tool_choice_calls_a_tool_and_stores_the_turn(
    client: openai.OpenAI, service: Service
) -> None:
    r = ask(client, service, "tool-req", tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    for call in c.message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    check_route(service, r, "tool-req")
    # The next turn carries the call and its result; its routes are stored as any turn's.
    turn = [
        *MSGS,
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": "sunny"},
    ]
    r2 = ask(client, service, "tool-req-2", messages=turn, tool_choice="none", max_tokens=4,
             extra_body={"ignore_eos": True})  # fmt: skip
    assert r2.choices[0].finish_reason == "length" and not r2.choices[0].message.tool_calls
    check_route(service, r2, "tool-req-2")


def test_named_tool_choice_returns_its_arguments(client: openai.OpenAI, service: Service) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = ask(client, service, "tool-named", tool_choice=named)
    c = r.choices[0]
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and c.message.content == ""
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert c.finish_reason == "stop"  # as vLLM: a named function's call finishes as stop
    check_route(service, r, "tool-named")


def test_auto_tool_choice_parses_the_models_call(client: openai.OpenAI, service: Service) -> None:
    r = ask(client, service, "tool-auto", max_tokens=40,
            extra_body={"structured_outputs": {"regex": PYTHONIC}})  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"},
    )  # fmt: skip
    check_route(service, r, "tool-auto")


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_tool_calls_are_vllms_deltas(
    client: openai.OpenAI, service: Service, choice: str
) -> None:
    extra = {"structured_outputs": {"regex": PYTHONIC}} if choice == "auto" else {}
    stream = ask(client, service, f"tool-s-{choice}", tool_choice=choice, stream=True,
                 extra_body=extra)  # fmt: skip
    args, names, finish = "", set(), None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        for tc in ch.delta.tool_calls or []:
            if tc.index == 0:
                args += (tc.function.arguments or "") if tc.function else ""
                names |= {tc.function.name} if tc.function and tc.function.name else set()
        if ch.finish_reason:
            finish, handle = ch.finish_reason, ch.model_extra["routed_experts"]
    assert finish == "tool_calls" and names == {"get_weather"}
    assert json.loads(args)["city"] in ("Paris", "Rome")
    assert handle["status"] == "stored" and handle["route_id"] == f"tool-s-{choice}-0"


def test_tool_choice_none_answers_plain_content(client: openai.OpenAI, service: Service) -> None:
    r = ask(client, service, "tool-none", tool_choice="none", max_tokens=4,
            extra_body={"ignore_eos": True})  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    assert isinstance(c.message.content, str)
    check_route(service, r, "tool-none")


@pytest.mark.parametrize(
    ("over", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    client: openai.OpenAI, service: Service, over: dict, param: str
) -> None:
    import httpx

    body = {"model": service.model, "messages": MSGS, "tools": TOOLS, **over}
    r = httpx.post(f"{service.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
