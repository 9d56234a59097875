"""Wire models: OpenAI-compatible requests and responses, plus the route handle.

Requests accept unknown fields (``extra="allow"``) the way OpenAI-compatible servers do, so
clients sending vendor extensions are not refused, and the upstream backend forwards them.
Responses follow the OpenAI schema; each choice gains ``routed_experts``: the small
:class:`RouteHandle` (or, with ``return_routed_experts="inline"``, vLLM's base64 ``.npy`` string,
the handle then moving to ``routed_experts_handle``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "BatchRoutesRequest",
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "RouteHandle",
    "SamplingFields",
    "Usage",
]

# Bounds that make a request absurd rather than merely large; the engine's context limit is
# checked separately against the rendered prompt.
_MAX_N = 64
_MAX_LOGPROBS = 20


class SamplingFields(BaseModel):
    """Sampling fields shared by chat and completions (OpenAI names, plus vLLM's extensions)."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1, le=_MAX_N)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    # routereplay: "handle" (default) puts the small RouteHandle in choices[i].routed_experts;
    # "inline" reproduces vLLM's base64 .npy there (for callers written against vLLM).
    return_routed_experts: Literal["handle", "inline"] = "handle"
    # vLLM extension: echo prompt_token_ids and choices[i].token_ids.
    return_token_ids: bool = False
    # vLLM extension: the engine returns routes from this prompt position on (multi-turn: the
    # earlier turns' rows are already stored). The skipped rows are filled from the store's
    # token-prefix index; what it cannot fill is marked invalid.
    routed_experts_prompt_start: int = Field(0, ge=0)

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=_MAX_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _messages_have_roles(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(v):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] has no 'role'")
        return v

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field that set the completion budget (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        """vLLM's ``SamplingParams.logprobs``: None (off) or how many top alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=_MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        # A list of prompts is a batch; one prompt per request keeps route ids = request-choice.
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("send one prompt per request (batched prompts are not supported)")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("prompt token ids must be >= 0")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class RouteHandle(BaseModel):
    """Where a choice's routes went. ``route_id`` = ``f"{request_id}-{choice_index}"``."""

    route_id: str
    status: Literal["stored", "failed"]
    num_rows: int
    num_valid_rows: int
    moe_layers: list[int]
    top_k: int
    num_experts: int
    error: str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class _Choice(BaseModel):
    """Fields every choice has; ``routed_experts`` is the handle (or inline base64 .npy)."""

    index: int
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: RouteHandle | str | None = None
    routed_experts_handle: RouteHandle | None = None


class ChatChoice(_Choice):
    message: ChatMessage


class CompletionChoice(_Choice):
    text: str


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class BatchRoutesRequest(BaseModel):
    """``POST /v1/routes:batch`` body."""

    ids: list[str] = Field(min_length=1)
    start: int = Field(0, ge=0)
