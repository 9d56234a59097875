"""What ``tool_choice`` needs of the server's flags, as ``vllm serve`` answers it (vLLM 0.32's
``renderers/online_renderer.py``), checked without an engine; the tool calls themselves run on
the real engine (tests/service/test_tools.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from routereplay.service.engines.vllm_tools import ToolCalling
from routereplay.service.errors import InvalidRequestError, StartupRefused
from routereplay.service.protocol import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MSGS = [{"role": "user", "content": "x"}]


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSGS, "tools": TOOLS, **kw})


@pytest.mark.parametrize(
    ("choice", "says"),
    [
        (None, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
        ("auto", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
        ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
        ({"type": "function", "function": {"name": "f"}},
         'tool_choice=function "f" requires --tool-call-parser to be set'),
    ],
)  # fmt: skip
def test_without_a_parser_tool_choice_is_refused_as_vllm(choice, says: str) -> None:
    r = request(**({} if choice is None else {"tool_choice": choice}))
    with pytest.raises(InvalidRequestError) as e:
        ToolCalling(None, False).plan(r)
    assert says in str(e.value) and e.value.param == "tool_choice"


def test_tool_choice_none_needs_no_parser_and_keeps_the_tools_for_the_template() -> None:
    plan = ToolCalling(None, False).plan(request(tool_choice="none"))
    assert plan is not None and plan.choice_kind == "none"
    assert plan.tool_dicts[0]["function"]["name"] == "f"
    assert plan.structured_outputs is None and plan.choice_parser([1]) is None
    assert ToolCalling(None, False).plan(ChatCompletionRequest(messages=MSGS)) is None


def test_auto_without_a_parser_and_an_unknown_parser_are_refused_at_start() -> None:
    with pytest.raises(StartupRefused, match="needs --tool-call-parser"):
        ToolCalling(None, True)
    with pytest.raises(StartupRefused, match="--tool-call-parser no_such_parser"):
        ToolCalling("no_such_parser", False).start(None, SimpleNamespace(model="m"))


@pytest.mark.parametrize("backend", ["synthetic", "upstream"])
def test_tool_flags_belong_to_the_in_process_engine(backend: str) -> None:
    from routereplay.service.app import make_backend
    from routereplay.service.settings import Settings

    for flags in ({"tool_call_parser": "pythonic"}, {"enable_auto_tool_choice": True}):
        s = Settings(backend=backend, upstream_url="http://127.0.0.1:9", **flags)
        with pytest.raises(ValueError, match="the in-process engine's"):
            make_backend(s)
