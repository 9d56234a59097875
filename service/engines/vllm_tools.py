"""Tool calling on the in-process engine, as ``vllm serve`` does it and with vLLM's own parts.

``--tool-call-parser NAME`` picks one of vLLM's tool parsers (``ParserManager``, the same
registry ``vllm serve --tool-call-parser`` reads) and ``--enable-auto-tool-choice`` lets the model
decide (``tool_choice: "auto"``). A chat request with ``tools`` is validated by vLLM's
``ChatCompletionRequest``; its tools reach the chat template; the parser's ``adjust_request``
turns ``tool_choice: "required"`` or a named function into vLLM's structured-output constraint;
each choice's output is parsed by its own parser instance (``parse`` whole, ``parse_delta``
streamed), so a tool-call turn's message and deltas are vLLM's. The routes are the tokens'
whatever the parse: a tool-call turn stores its rows as any other.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError, StartupRefused
from ..protocol import ChatCompletionRequest

__all__ = ["ChoiceToolParser", "ToolCalling", "ToolPlan"]

log = logging.getLogger("routereplay.service")

# The service's own fields, which vLLM's request model does not know.
_OWN_FIELDS = ("return_routed_experts", "routed_experts_weights")


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _tool_call_json(fc: Any) -> dict[str, Any]:
    """A parsed ``FunctionCall`` as OpenAI's message ``tool_calls`` entry."""
    return {
        "id": getattr(fc, "id", None) or _call_id(),
        "type": "function",
        "function": {"name": fc.name, "arguments": fc.arguments},
    }


class ChoiceToolParser:
    """One choice's parser (vLLM's parsers keep state per output)."""

    def __init__(self, plan: ToolPlan, prompt_ids: list[int]) -> None:
        self._plan = plan
        self._parser = plan.parser_cls(plan.tokenizer, plan.vreq.tools, **plan.parser_kwargs)
        self._prompt_ids = prompt_ids
        self.called = False  # a tool call was streamed or parsed

    def message(self, text: str, token_ids: list[int]) -> dict[str, Any]:
        """The whole output as the message's ``content`` and ``tool_calls`` (vLLM's rules)."""
        p = self._plan
        try:
            _, content, calls = self._parser.parse(
                text, p.vreq, enable_auto_tools=p.auto, model_output_token_ids=token_ids
            )
        except Exception:
            # As vLLM's parsers do with output they cannot read: the text is the content.
            log.warning("tool parser %s failed on an output", p.parser_cls, exc_info=True)
            return {"content": text}
        forced = p.choice_kind in ("required", "named")
        if not forced and not (p.auto and p.choice_kind == "auto"):
            return {"content": content}
        tool_calls = [_tool_call_json(fc) for fc in calls or []]
        if p.vreq.parallel_tool_calls is False:
            tool_calls = tool_calls[:1]
        self.called = bool(tool_calls)
        if forced:
            return {"content": content or "", "tool_calls": tool_calls}
        return {"content": content, "tool_calls": tool_calls}

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict[str, Any] | None:
        """A streamed output as vLLM's ``DeltaMessage``; None: nothing to send yet."""
        d = self._parser.parse_delta(
            delta_text=text,
            delta_token_ids=list(token_ids),
            request=self._plan.vreq,
            prompt_token_ids=self._prompt_ids,
            finished=finished,
        )
        if d is None:
            return None
        if d.tool_calls:
            self.called = True
            if self._plan.vreq.parallel_tool_calls is False:
                d.tool_calls = [tc for tc in d.tool_calls if tc.index == 0]
        return d.model_dump(mode="json", exclude_unset=True)

    def finish_reason(self, reason: str) -> str:
        """vLLM's: ``tool_calls`` when tools were called by auto or required choice and the
        model stopped; a named function's call finishes as ``stop``."""
        if self.called and reason == "stop" and self._plan.choice_kind != "named":
            return "tool_calls"
        return reason


@dataclass
class ToolPlan:
    """What a chat request with tools needs from vLLM: its validated request, the tools for
    the chat template, the constraint ``tool_choice`` implies, and the parser."""

    vreq: Any  # vLLM's ChatCompletionRequest, after the parser's adjust_request
    tool_dicts: list[dict[str, Any]] | None
    choice_kind: str  # none, auto, required or named
    parser_cls: Any
    parser_kwargs: dict[str, Any]
    tokenizer: Any
    auto: bool

    @property
    def structured_outputs(self) -> Any:
        """vLLM's ``StructuredOutputsParams`` for required or named tool choice, else None."""
        return self.vreq.structured_outputs if self.choice_kind in ("required", "named") else None

    def choice_parser(self, prompt_ids: list[int]) -> ChoiceToolParser | None:
        if self.parser_cls is None or self.choice_kind == "none":
            return None
        return ChoiceToolParser(self, prompt_ids)


class ToolCalling:
    """vLLM's tool parser for this engine (``parser`` None: no tool parsing, as vLLM without
    ``--tool-call-parser``)."""

    def __init__(self, parser: str | None, auto: bool) -> None:
        if auto and not parser:
            raise StartupRefused("--enable-auto-tool-choice needs --tool-call-parser")
        self.parser_name = parser
        self.auto = auto
        self._parser_cls: Any = None
        self._tokenizer: Any = None
        self._model_config: Any = None

    def start(self, tokenizer: Any, model_config: Any) -> None:
        """Resolve the parser once the engine's tokenizer exists; refuse an unknown one."""
        self._tokenizer, self._model_config = tokenizer, model_config
        if not self.parser_name:
            return
        from vllm.parser.parser_manager import ParserManager
        from vllm.tool_parsers import ToolParserManager

        try:  # vLLM reads the name only with --enable-auto-tool-choice: a typo is refused here
            ToolParserManager.get_tool_parser(self.parser_name)
        except KeyError as e:
            raise StartupRefused(f"--tool-call-parser {self.parser_name}: {e}") from e
        kw: dict[str, Any] = dict(
            tool_parser_name=self.parser_name,
            enable_auto_tools=self.auto,
            model_name=str(model_config.model),
        )
        if "tokenizer" in inspect.signature(ParserManager.get_parser).parameters:
            kw["tokenizer"] = tokenizer
        try:
            self._parser_cls = ParserManager.get_parser(**kw)
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise StartupRefused(f"--tool-call-parser {self.parser_name}: {e}") from e

    def plan(self, r: ChatCompletionRequest) -> ToolPlan | None:
        """The tool plan of ``r``; None when it has no tools; 400 for what vLLM refuses."""
        if r.tools is None and not r.functions and r.tool_choice in (None, "none"):
            return None
        if r.functions or r.function_call is not None:
            field = "functions" if r.functions else "function_call"
            raise InvalidRequestError(
                f"{field} is OpenAI's deprecated form, which vLLM does not serve: send tools "
                "and tool_choice",
                param=field,
                code="unsupported",
            )
        from vllm.exceptions import VLLMClientError

        vreq = self._vllm_request(r)
        kind = self._choice_kind(vreq)
        self._check_choice(vreq, kind)
        kw: dict[str, Any] = {"model_config": self._model_config}
        if self._parser_cls is not None and kind != "none":
            try:
                parser = self._parser_cls(self._tokenizer, vreq.tools, **kw)
                vreq = parser.adjust_request(vreq)
            except (ValueError, VLLMClientError) as e:  # a named function not among the tools
                raise InvalidRequestError(f"tool_choice: {e}", param="tool_choice") from e
        tools = None if vreq.tools is None else [t.model_dump() for t in vreq.tools]
        return ToolPlan(vreq, tools, kind, self._parser_cls, kw, self._tokenizer, self.auto)

    @staticmethod
    def _vllm_request(r: ChatCompletionRequest) -> Any:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest as VllmChatRequest,
        )
        from vllm.exceptions import VLLMClientError

        body = r.model_dump(exclude_unset=True, exclude=set(_OWN_FIELDS))
        try:
            return VllmChatRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            cause = (err.get("ctx") or {}).get("error")  # vLLM's VLLMValidationError
            loc = ".".join(str(x) for x in err.get("loc", ()))
            param = getattr(cause, "parameter", None) or loc or "tools"
            msg = str(cause) if cause is not None else err["msg"]
            raise InvalidRequestError(f"{param}: {msg}", param=param.split(".")[0]) from e
        except VLLMClientError as e:  # raised by vLLM's validators as they are, not wrapped
            param = getattr(e, "parameter", None) or "tools"
            raise InvalidRequestError(f"{param}: {e}", param=param.split(".")[0]) from e

    @staticmethod
    def _choice_kind(vreq: Any) -> str:
        choice = vreq.tool_choice  # vLLM's: "auto" when tools came without it
        if choice is None or not vreq.tools:
            return "none"
        return choice if isinstance(choice, str) else "named"  # none, auto, required

    def _check_choice(self, vreq: Any, kind: str) -> None:
        # vLLM's server: what tool_choice needs of the server's flags (with a parser but not
        # --enable-auto-tool-choice, "auto" answers plain content, as vLLM).
        if self._parser_cls is not None or kind == "none":
            return
        if kind == "auto":
            self._refuse(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        what = f'function "{vreq.tool_choice.function.name}"' if kind == "named" else '"required"'
        self._refuse(f"tool_choice={what} requires --tool-call-parser to be set")

    @staticmethod
    def _refuse(msg: str) -> None:
        raise InvalidRequestError(msg, param="tool_choice", code="unsupported")
