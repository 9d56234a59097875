"""One OpenAI error schema everywhere, a 4xx naming the field, and nothing stored for a refusal.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` with a string ``code``;
``param`` names the field at fault and the message starts with it.
"""

from __future__ import annotations

import httpx
import pytest

from .conftest import MODEL, App

MSG = [{"role": "user", "content": "hi"}]


def check_error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    e = body["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert isinstance(e["code"], str) and isinstance(e["type"], str) and e["message"], e
    assert e["param"] == param, e
    if param:
        assert (
            e["message"].lower().startswith(param.lower()) or param.lower() in e["message"].lower()
        ), e
    if code:
        assert e["code"] == code, e
    return e


@pytest.fixture()
async def nothing_stored(svc: App):
    before = svc.keys()
    yield
    assert svc.keys() == before, "a refused request wrote to Redis"


def chat(**over: object) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **over}


# (body overrides, param, code): each one field wrong, the rest valid.
CHAT_CASES = [
    # Types are not coerced (the OpenAI API refuses these; pydantic's lax mode would not).
    ({"n": "2"}, "n", "invalid_type"),
    ({"n": True}, "n", "invalid_type"),
    ({"n": 2.0}, "n", "invalid_type"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"stream": 1}, "stream", "invalid_type"),
    ({"temperature": True}, "temperature", "invalid_type"),
    ({"temperature": "0.5"}, "temperature", "invalid_type"),
    ({"max_tokens": "5"}, "max_tokens", "invalid_type"),
    ({"seed": "1"}, "seed", "invalid_type"),
    ({"logprobs": "true"}, "logprobs", "invalid_type"),
    ({"model": 5}, "model", "invalid_type"),
    ({"stop": 5}, "stop", None),
    # Bounds (vLLM's protocol and the OpenAI API).
    ({"n": 0}, "n", "value_below_minimum"),
    ({"n": 65}, "n", "value_above_maximum"),
    ({"max_tokens": 0}, "max_tokens", "value_below_minimum"),
    ({"max_tokens": -1}, "max_tokens", "value_below_minimum"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "value_below_minimum"),
    ({"temperature": 2.5}, "temperature", "value_above_maximum"),
    ({"temperature": -0.1}, "temperature", "value_below_minimum"),
    ({"top_p": 0}, "top_p", "value_below_minimum"),
    ({"top_p": 1.5}, "top_p", "value_above_maximum"),
    ({"min_p": 2}, "min_p", "value_above_maximum"),
    ({"top_k": -2}, "top_k", "value_below_minimum"),
    ({"top_k": 2**70}, "top_k", "value_above_maximum"),
    ({"seed": 2**63}, "seed", "value_above_maximum"),
    ({"seed": -(2**63) - 1}, "seed", "value_below_minimum"),
    ({"presence_penalty": 3}, "presence_penalty", "value_above_maximum"),
    ({"frequency_penalty": -3}, "frequency_penalty", "value_below_minimum"),
    ({"repetition_penalty": 0}, "repetition_penalty", "value_below_minimum"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "value_above_maximum"),
    ({"top_logprobs": 2}, "top_logprobs", None),  # needs logprobs=true: a rule across fields
    ({"min_tokens": -1}, "min_tokens", "value_below_minimum"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "value_below_minimum"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "array_too_short"),
    ({"logit_bias": {"65": 101}}, "logit_bias.65", "value_above_maximum"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ({"bad_words": [""]}, "bad_words", "invalid_value"),
    ({"stop": ["a", ""]}, "stop", "invalid_value"),
    ({"best_of": 3}, "best_of", None),
    ({"routed_experts_prompt_start": -1}, "routed_experts_prompt_start", "value_below_minimum"),
    ({"return_routed_experts": "array"}, "return_routed_experts", "invalid_value"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "invalid_type"),
    ({"stream_options": {"bogus": 1}}, "stream_options.bogus", "unknown_parameter"),
    # Messages: roles and content shapes.
    ({"messages": []}, "messages", "array_too_short"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "invalid_value"),
    ({"messages": [{"role": "user", "content": [[]]}]}, "messages[0].content", "invalid_value"),
    ({"messages": [{"role": "user", "content": [1]}]}, "messages[0].content", "invalid_value"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
        "invalid_value",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        "messages[0].content",
        "invalid_value",
    ),
    (
        {
            "messages": [*MSG, {"role": "user", "content": "x"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        "continue_final_message",
        None,
    ),
]


@pytest.mark.usefixtures("nothing_stored")
@pytest.mark.parametrize(("over", "param", "code"), CHAT_CASES)
async def test_chat_field_validation(svc: App, over: dict, param: str | None, code: str) -> None:
    r = await svc.http.post("/v1/chat/completions", json=chat(**over))
    check_error(r, 400, param, code)


@pytest.mark.usefixtures("nothing_stored")
@pytest.mark.parametrize(
    ("over", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a"] * 257}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [[1], [1, -2]]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, 300]}, "prompt"),
        ({"prompt": [[1, 2], [1, 300]]}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logprob_token_ids": [1]}, "logprob_token_ids"),
        ({"logprobs": 1, "logprob_token_ids": [1, 256]}, "logprob_token_ids"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
        ({"truncation_side": "middle"}, "truncation_side"),
        ({"suffix": "x"}, "suffix"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"n": 2, "temperature": 0}, "n"),
    ],
)
async def test_completion_field_validation(svc: App, over: dict, param: str) -> None:
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream, **over}
        check_error(await svc.http.post("/v1/completions", json=body), 400, param)


async def test_prompt_logprobs_are_refused_on_a_stream_as_vllm(svc: App) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True, "prompt_logprobs": 1}
    e = check_error(await svc.http.post("/v1/completions", json=body), 400, "prompt_logprobs")
    assert "stream" in e["message"]
    body["prompt_logprobs"] = 0  # as vLLM: 0 is allowed (nothing beyond each token's own)
    assert (await svc.http.post("/v1/completions", json=body)).status_code == 200


@pytest.mark.usefixtures("nothing_stored")
@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("functions", [{"name": "f"}]),
        ("response_format", {"type": "json_object"}),
    ],
)
async def test_unimplemented_features_are_refused_by_name(svc: App, field: str, value) -> None:
    e = check_error(
        await svc.http.post("/v1/chat/completions", json=chat(**{field: value})),
        400,
        field,
        "unsupported",
    )
    assert "upstream" in e["message"]


@pytest.mark.usefixtures("nothing_stored")
async def test_unknown_fields_are_refused_not_ignored(svc: App) -> None:
    for body in (chat(temprature=0.5), {"model": MODEL, "prompt": "x", "guided_json": {}}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        bad = next(k for k in body if k not in ("model", "messages", "max_tokens", "prompt"))
        check_error(await svc.http.post(path, json=body), 400, bad, "unknown_parameter")


@pytest.mark.usefixtures("nothing_stored")
async def test_body_errors(svc: App) -> None:
    r = await svc.http.post(
        "/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert "json" in check_error(r, 400, "body", "invalid_json")["message"].lower()
    check_error(await svc.http.post("/v1/completions", json=[1, 2]), 400, "body")
    check_error(await svc.http.post("/v1/completions", content=b""), 400, "body")
    check_error(
        await svc.http.post("/v1/chat/completions", json={"model": MODEL}),
        400,
        "messages",
        "missing_required_parameter",
    )


@pytest.mark.usefixtures("nothing_stored")
async def test_model_and_context_checks(svc: App) -> None:
    e = check_error(
        await svc.http.post("/v1/chat/completions", json=chat(model="gpt-17")),
        404,
        "model",
        "model_not_found",
    )
    assert "gpt-17" in e["message"] and MODEL in e["message"]
    e = check_error(
        await svc.http.post("/v1/chat/completions", json=chat(max_tokens=10**9)), 400, "max_tokens"
    )
    assert "2048" in e["message"]
    room = {"model": MODEL, "prompt": list(range(3, 200)) * 8, "max_tokens": 1000}
    check_error(await svc.http.post("/v1/completions", json=room), 400, "max_tokens")
    long = {"model": MODEL, "prompt": [5] * 3000, "max_tokens": 1}
    check_error(await svc.http.post("/v1/completions", json=long), 400, "prompt")
    longchat = chat(messages=[{"role": "user", "content": "expert " * 400}])
    check_error(await svc.http.post("/v1/chat/completions", json=longchat), 400, "messages")
    start = {"model": MODEL, "prompt": [5, 6, 7], "routed_experts_prompt_start": 9}
    check_error(
        await svc.http.post("/v1/completions", json=start), 400, "routed_experts_prompt_start"
    )


async def test_model_may_be_left_out(svc: App) -> None:
    # As vLLM allows: the served model answers.
    r = await svc.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL


@pytest.mark.usefixtures("nothing_stored")
@pytest.mark.parametrize("rid", ["has space", "x" * 121, "semi;colon", "ünï", ""])
async def test_invalid_request_id(svc: App, rid: str) -> None:
    r = await svc.http.post(
        "/v1/chat/completions", json=chat(), headers={"X-Request-Id": rid.encode()}
    )
    check_error(r, 400, "X-Request-Id", "invalid_request_id")


async def test_http_level_errors_use_the_schema(svc: App) -> None:
    check_error(await svc.http.get("/v1/nope"), 404, None, "not_found")
    check_error(await svc.http.get("/"), 404, None, "not_found")
    e = check_error(await svc.http.put("/v1/models"), 405, None, "method_not_allowed")
    assert "PUT" in e["message"]
    r = await svc.http.get("/v1/chat/completions")
    check_error(r, 405, None, "method_not_allowed")
    assert r.headers["allow"] == "POST"


@pytest.mark.usefixtures("nothing_stored")
async def test_retrieval_errors(svc: App) -> None:
    e = check_error(
        await svc.http.get("/v1/routes/never-stored-0"), 404, "route_id", "route_not_found"
    )
    assert "never-stored-0" in e["message"]
    check_error(await svc.http.delete("/v1/routes/never-stored-0"), 404, "route_id")
    check_error(await svc.http.get("/v1/routes/bad%20id"), 400, "route_id", "invalid_route_id")
    check_error(await svc.http.get("/v1/routes/x-0", params={"start": "-3"}), 400, "start")
    check_error(await svc.http.get("/v1/routes/x-0", params={"start": "a"}), 400, "start")
    check_error(await svc.http.get("/v1/routes/x-0", params={"format": "xml"}), 400, "format")
    check_error(await svc.http.post("/v1/routes:batch", json={"ids": []}), 400, "ids")
    check_error(await svc.http.post("/v1/routes:batch", json={"ids": ["a b"]}), 400, "route_id")
    check_error(await svc.http.post("/v1/routes:batch", json={"ids": ["a"], "x": 1}), 400, "x")
    check_error(await svc.http.post("/v1/routes:batch", json={"ids": "a"}), 400, "ids")
    check_error(
        await svc.http.post("/v1/routes:batch", content=b"{", headers={"content-type": "x"}),
        400,
        "body",
    )


async def test_openapi_documents_bodies_parameters_and_errors(svc: App) -> None:
    spec = (await svc.http.get("/openapi.json")).json()
    paths = spec["paths"]
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/routes:batch",
        "/tokenize",
        "/detokenize",
    ):
        op = paths[path]["post"]
        assert op["requestBody"]["required"], path
        assert "400" in op["responses"], path
    chat_schema = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "n", "temperature", "seed", "return_routed_experts"} <= set(
        chat_schema["properties"]
    )
    headers = [p["name"] for p in paths["/v1/chat/completions"]["post"]["parameters"]]
    assert headers == ["X-Request-Id"]
    get = paths["/v1/routes/{route_id}"]["get"]
    assert {p["name"] for p in get["parameters"]} >= {"route_id", "start", "format"}
    assert "ErrorResponse" in spec["components"]["schemas"]
    err = spec["components"]["schemas"]["ErrorBody"]["properties"]["code"]
    assert err["type"] == "string"


async def test_docs_serve_the_apps_own_schema(svc: App) -> None:
    """/openapi.json is the app's schema (without the two description endpoints themselves) and
    /docs is a Swagger UI that loads it."""
    r = await svc.http.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == svc.app.openapi()
    assert not {"/openapi.json", "/docs"} & set(r.json()["paths"])
    r = await svc.http.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in r.text and "url: '/openapi.json'" in r.text


@pytest.mark.parametrize(
    "prompt, shown",
    [([-1], "[-1]"), ([5, -3, 2**31], "[-3, 2147483648]"), ([[7, -1]], "[-1]")],
)
async def test_out_of_range_prompt_ids_name_the_bound(svc: App, prompt, shown: str) -> None:
    """As vLLM: the bound is named, not the union's "Input should be a valid string"."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    e = check_error(await svc.http.post("/v1/completions", json=body), 400, "prompt")
    assert ">= 0 and <= 2147483647" in e["message"] and shown in e["message"], e


async def test_every_bad_logit_bias_key_is_named(svc: App) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "logit_bias": {"a": 1, "7": 2, "b": 3}}
    e = check_error(await svc.http.post("/v1/completions", json=body), 400, "logit_bias")
    assert "'a', 'b' are not" in e["message"], e


@pytest.mark.parametrize(
    "over, param, words",
    [
        ({"logit_bias": {"65": 1, "300": 2}}, "logit_bias", "token_id(s) [300] in logit_bias"),
        ({"stop_token_ids": [10, 256, 999]}, "stop_token_ids", "token_id(s) [256, 999]"),
        ({"allowed_token_ids": [65, 4096]}, "allowed_token_ids", "out-of-vocab token id"),
    ],
)
async def test_sampling_ids_outside_the_vocabulary_are_refused(
    svc: App, over: dict, param: str, words: str
) -> None:
    """The synthetic engine refuses them as vLLM's engine does (its vocabulary: 256 bytes)."""
    msgs = [{"role": "user", "content": "x"}]
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                               {"messages": msgs})):  # fmt: skip
        r = await svc.http.post(path, json={"model": MODEL, **body, "max_tokens": 2, **over})
        e = check_error(r, 400, param)
        assert words in e["message"], e
        if param != "allowed_token_ids":
            assert "Vocabulary size: 256" in e["message"], e


@pytest.mark.parametrize(
    "over, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ],
)  # fmt: skip
async def test_structured_output_fields_are_checked(svc: App, over: dict, param: str) -> None:
    """vLLM's shapes: response_format text / json_object / json_schema with a schema, and
    structured_outputs with exactly one constraint of StructuredOutputsParams."""
    e = check_error(await svc.http.post("/v1/chat/completions", json=chat(**over)), 400, param)
    assert e["code"] != "unsupported", e  # refused for its shape, before any engine


async def test_the_synthetic_engine_refuses_to_constrain(svc: App) -> None:
    for over in ({"structured_outputs": {"choice": ["a", "b"]}},
                 {"response_format": {"type": "json_object"}}):  # fmt: skip
        (name,) = over
        e = check_error(await svc.http.post("/v1/chat/completions", json=chat(**over)), 400, name)
        assert e["code"] == "unsupported" and "does not constrain" in e["message"], e
