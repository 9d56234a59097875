"""Wire models: OpenAI-compatible requests and responses, the route handle, the retrieval bodies.

Requests validate as the OpenAI API does, not as pydantic's lax mode would: ``n: "2"``,
``n: true``, ``stream: "yes"`` and ``temperature: true`` are refused (strict types; an integer is
still a valid float). Bounds follow vLLM's protocol models (``seed`` is an int64, penalties in
[-2, 2], ...). Fields vLLM's server knows and this service honours are declared here; any other
field is kept in ``model_extra`` so the upstream backend can forward it, while the in-process
backend refuses it with a 400 naming it (nothing is silently ignored).

Each choice of a response gains ``routed_experts``: the small :class:`RouteHandle` (or, with
``return_routed_experts="inline"``, vLLM's base64 ``.npy`` string, the handle then moving to
``routed_experts_handle``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "BatchRoutesRequest",
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ModelCard",
    "ModelList",
    "RouteHandle",
    "RouteJSON",
    "RoutedExpertsLayout",
    "SamplingFields",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
    "Usage",
    "WeightSpanOut",
]

# Bounds that make a request absurd rather than merely large; the engine's context limit is
# checked separately against the rendered prompt.
MAX_N = 64
MAX_LOGPROBS = 20
MAX_LOGPROB_IDS = 128
# Prompts of one completions request (each gets its own n choices and route ids).
MAX_PROMPTS = 256
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")

_MAX_TOKEN_ID = 2**31 - 1
# vLLM's StructuredOutputsParams: the constraints (one per request) and their options.
STRUCTURED_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties",
                       "whitespace_pattern")  # fmt: skip
STRUCTURED_KEYS = STRUCTURED_CONSTRAINTS + _STRUCTURED_OPTIONS
TokenId = Annotated[int, Field(ge=0, le=_MAX_TOKEN_ID)]


class _Request(BaseModel):
    # strict: no "2" -> 2 or "yes" -> True coercion; extra: kept for the upstream backend.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False


def _check_content(v: Any, allow_none: bool) -> Any:
    """OpenAI message content: a string, or a list of ``{"type": "text", "text": str}`` parts."""
    if v is None:
        if allow_none:
            return v
        raise ValueError("is required for this role")
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError("must be a string or a list of content parts")
    for j, part in enumerate(v):
        if not isinstance(part, dict):
            raise ValueError(f'part {j} must be an object like {{"type": "text", "text": ...}}')
        kind = part.get("type")
        if kind != "text":
            raise ValueError(
                f"part {j} has type {kind!r}: this server serves a text model, content parts "
                "must have type 'text'"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {j}: text must be a string")
    return v


class ChatMessageParam(BaseModel):
    """One input message. Extra keys (``name``, ``tool_call_id``...) reach the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(None, validate_default=True)

    @field_validator("content", mode="after")
    @classmethod
    def _content_shape(cls, v: Any, info: ValidationInfo) -> Any:
        # An assistant turn may carry only tool calls (content null), as OpenAI allows.
        return _check_content(v, allow_none=info.data.get("role") == "assistant")


class SamplingFields(_Request):
    """Sampling fields shared by chat and completions (OpenAI names, plus vLLM's extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None
    # vLLM extension: requests with different salts share no cached prefix (tenant isolation).
    # The engine's own salt for the weights generation is combined with it (docs/service.md).
    cache_salt: str | None = Field(None, min_length=1, max_length=128)
    # Structured output, as vLLM: OpenAI's response_format (text, json_object, json_schema) and
    # vLLM's structured_outputs (one of json, regex, choice, grammar, json_object,
    # structural_tag, with its options); response_format's constraint wins over the same one.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # routereplay: "handle" (default) puts the small RouteHandle in choices[i].routed_experts;
    # "inline" reproduces vLLM's base64 .npy there (for callers written against vLLM).
    return_routed_experts: Literal["handle", "inline"] = "handle"
    # vLLM extension: echo prompt_token_ids and choices[i].token_ids.
    return_token_ids: bool = False
    # vLLM extension: the engine returns routes from this prompt position on (multi-turn: the
    # earlier turns' rows are already stored). The skipped rows are filled from the store's
    # token-prefix index; what it cannot fill is marked invalid.
    routed_experts_prompt_start: int = Field(0, ge=0, le=INT64_MAX)
    # routereplay: store the combine weights the engine applied beside the expert ids (the
    # record's ``weights``). Unset: the service's --route-weights default.
    routed_experts_weights: bool | None = None
    # vLLM extensions: each prompt token's logprob and its top k (0: the token's own);
    # logprobs of these token ids at every sampled position (instead of the top k);
    # the prompt cut to its last (or first) k tokens (-1: as many as the context allows);
    # logprobs' tokens spelled "token_id:<id>".
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logprob_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_LOGPROB_IDS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    return_tokens_as_token_ids: bool | None = None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        kind = v.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError(
                    'type \'json_schema\' needs json_schema: {"name": ..., "schema": {...}}'
                )
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _structured_outputs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        unknown = sorted(set(v) - set(STRUCTURED_CONSTRAINTS) - set(_STRUCTURED_OPTIONS))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; vLLM's are {sorted(STRUCTURED_KEYS)}")
        given = [k for k in STRUCTURED_CONSTRAINTS if v.get(k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"needs exactly one of {list(STRUCTURED_CONSTRAINTS)}, got {given or 'none'}"
            )
        return v

    def structured_output(self) -> dict[str, Any] | None:
        """The keyword arguments of vLLM's ``StructuredOutputsParams`` this request asks for
        (vLLM's merge: ``response_format`` replaces the constraint), or None."""
        so = dict(self.structured_outputs or {})
        rf = self.response_format or {}
        if rf.get("type") in (None, "text"):
            return so or None
        for k in STRUCTURED_CONSTRAINTS:
            so.pop(k, None)
        if rf["type"] == "json_object":
            return {**so, "json_object": True}
        return {**so, "json": rf["json_schema"]["schema"]}

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt_chars(cls, v: str | None) -> str | None:
        # vLLM's rule: KV connectors use the salt in keys and paths.
        if v is not None and any(c in v for c in "@/\\\x00"):
            raise ValueError("cache_salt must not contain '@', '/', '\\' or NUL")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str] | None) -> list[str] | None:
        if v and any(not w.strip() for w in v):
            raise ValueError("bad_words must not contain empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bad = [k for k in v or {} if not k.isdigit()]
        if bad:
            shown = ", ".join(map(repr, bad[:8])) + (
                f" and {len(bad) - 8} more" if len(bad) > 8 else ""
            )
            raise ValueError(
                f"logit_bias keys are token ids; {shown} {'is' if len(bad) == 1 else 'are'} not"
            )
        return v

    @model_validator(mode="after")
    def _best_of(self) -> SamplingFields:
        # vLLM's engine dropped best_of; best_of == n (return all samples) is the only meaning left.
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of={self.best_of} is not supported (only best_of == n, here {self.n}): "
                "sample n choices and rank them client-side"
            )
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        # As vLLM: usage on every chunk only when the final usage chunk is asked for too.
        so = self.stream_options
        return bool(so and so.include_usage and so.continuous_usage_stats)

    @field_validator("stream_options", mode="after")
    @classmethod
    def _stream_options_need_stream(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream"):
            raise ValueError("can only be set when stream is true")
        return v

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _prompt_logprobs(cls, v: Any, info: ValidationInfo) -> Any:
        if v == -1 and type(v) is int:
            # vLLM's -1 is the whole vocabulary, which its default max_logprobs refuses too.
            raise ValueError(f"-1 (the whole vocabulary) is more than the {MAX_LOGPROBS} allowed")
        if type(v) is int and v > 0 and info.data.get("stream"):
            raise ValueError("prompt logprobs are not available when stream is true")
        return v

    @model_validator(mode="after")
    def _logprob_token_ids_need_logprobs(self) -> SamplingFields:
        if self.logprob_token_ids and not self.num_logprobs_set:
            raise ValueError("logprob_token_ids needs logprobs set")
        return self

    @property
    def num_logprobs_set(self) -> bool:
        return self.num_logprobs is not None  # type: ignore[attr-defined]

    @property
    def num_prompt_logprobs(self) -> int | None:
        """vLLM's ``SamplingParams.prompt_logprobs``: asked for, or what ``echo`` with logprobs
        shows of the prompt."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.num_logprobs if self.echo else None  # type: ignore[attr-defined]


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message=true needs add_generation_prompt=false (the model "
                "continues the last message instead of starting a new one)"
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message=true needs a final assistant message")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_chars(self) -> int:
        """Characters of message text (a lower bound on the rendered prompt's length)."""
        n = 0
        for m in self.messages:
            c = m.content
            if isinstance(c, str):
                n += len(c)
            elif isinstance(c, list):
                n += sum(len(part["text"]) for part in c)
        return n

    @property
    def max_tokens_field(self) -> str:
        """The field that set the completion budget (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        """vLLM's ``SamplingParams.logprobs``: None (off) or how many top alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. A list of prompts is a batch: prompt ``p``'s choices have the
    indexes ``p * n .. p * n + n - 1`` and their own route ids, as vLLM numbers them."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    # 0 only with echo: the prompt scored, nothing shown of what follows (as vLLM).
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_in_range(cls, v: Any) -> Any:
        # Before the union: a negative id would otherwise read "Input should be a valid string".
        batch = v if isinstance(v, list) and v and all(isinstance(x, list) for x in v) else [v]
        for j, ids in enumerate(batch):
            if isinstance(ids, list) and ids and all(type(x) is int for x in ids):
                bad = [x for x in ids if not 0 <= x <= _MAX_TOKEN_ID]
                if bad:
                    where = f"prompt {j}: " if len(batch) > 1 else ""
                    raise ValueError(
                        f"{where}token ids must be >= 0 and <= {_MAX_TOKEN_ID}; got {bad[:8]}"
                        + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
                    )
        return v

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        batch = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}")
        for j, p in enumerate(batch):
            if p == "" or p == []:
                raise ValueError("prompt is empty" if len(batch) == 1 else f"prompt {j} is empty")
        return v

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 needs echo=true (the prompt is then all that is shown)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one for a single prompt."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]

    def one(self, prompt: str | list[int]) -> CompletionRequest:
        """This request for one of its prompts."""
        return self.model_copy(update={"prompt": prompt})

    @property
    def requested_max_tokens(self) -> int | None:
        # max_tokens 0 (echo only): the engine still samples one token, which is not shown.
        return 1 if self.max_tokens == 0 else self.max_tokens

    def prompt_chars(self) -> int:
        return max(len(p) if isinstance(p, str) else 0 for p in self.prompts)

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# -- responses -------------------------------------------------------------------------------------
class WeightSpanOut(BaseModel):
    """Rows ``[start, stop)`` of a route were routed by the weights labelled ``version``."""

    version: str
    start: int
    stop: int


class RouteHandle(BaseModel):
    """Where a choice's routes went. ``route_id`` = ``f"{request_id}-{choice_index}"``.

    ``weight_version`` is the one weight version that routed every row; null when the request
    crossed a weight update (then ``weight_versions`` lists the spans) or the engine did not say.
    """

    route_id: str
    status: Literal["stored", "failed"]
    num_rows: int
    num_valid_rows: int
    moe_layers: list[int]
    top_k: int
    num_experts: int
    weight_version: str | None = None
    weight_versions: list[WeightSpanOut] | None = None
    # True when the record holds the engine's routing weights (in ``weights_dtype``).
    weights: bool = False
    weights_dtype: str | None = None
    error: str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # vLLM's tool parser's calls (--tool-call-parser): {"id", "type": "function", "function"};
    # an empty list when none, as vLLM sends it.
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


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


# vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {"logprob", "rank",
# "decoded_token"}} for the token itself and the top k.
PromptLogprobsOut = list[dict[str, dict[str, Any]] | None] | None


class CompletionChoice(_Choice):
    text: str
    # vLLM puts the prompt's token ids and logprobs on each completion choice (chat: on the
    # response).
    prompt_logprobs: PromptLogprobsOut = None
    prompt_token_ids: list[int] | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage
    # OpenAI's, null as vLLM sends them (SDK code reading them works).
    system_fingerprint: str | None = None
    service_tier: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobsOut = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class RoutedExpertsLayout(BaseModel):
    """The served model's route shape (routereplay's extension of the model card)."""

    num_layers: int
    moe_layers: list[int]
    num_experts: int
    top_k: int


class ModelCard(BaseModel):
    """One entry of ``/v1/models``: vLLM's fields, plus ``routed_experts``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "routereplay"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)
    routed_experts: RoutedExpertsLayout


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- tokenization (vLLM's /tokenize and /detokenize) -----------------------------------------------
class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message=true needs add_generation_prompt=false")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


# -- retrieval -------------------------------------------------------------------------------------
class BatchRoutesRequest(BaseModel):
    """``POST /v1/routes:batch`` body."""

    model_config = ConfigDict(extra="forbid", strict=True)

    ids: list[str] = Field(min_length=1)
    start: int = Field(0, ge=0, le=INT64_MAX)


class RouteJSON(BaseModel):
    """``GET /v1/routes/{route_id}?format=json``: one record as JSON lists."""

    route_id: str
    model: str
    token_ids: list[int]
    experts: list[list[list[int]]]
    valid: list[bool]
    moe_layers: list[int]
    num_layers: int
    num_experts: int
    prompt_len: int
    num_cached_tokens: int
    metadata: dict[str, Any]
    weight_versions: list[tuple[str, int, int]]  # [version, first row, end row); [] unknown
