"""The engine seam: one small interface, three implementations.

``VllmBackend`` (vLLM ``AsyncLLM`` in process), ``UpstreamBackend`` (an existing ``vllm serve``)
and ``SyntheticBackend`` (a deterministic engine for tests and integration work, no model).

A backend turns one parsed OpenAI request into a stream of plain events (one method per API, as
vLLM keeps one serving class per API); the serving layer turns events into OpenAI responses and
the capture layer turns finished choices into stored routes. Neither knows which backend produced
the events.

Event order per request: exactly one :class:`PromptRendered` first (after every request check,
so errors before it are client errors answered with a 4xx), then :class:`ChoiceDelta` and
:class:`ChoiceFinished` events; every choice index ``0..n-1`` finishes exactly once.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

import numpy as np

from .errors import InvalidRequestError
from .model_info import ModelInfo
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

__all__ = [
    "ChoiceDelta",
    "ChoiceFinished",
    "ChoiceParser",
    "EngineBackend",
    "EngineEvent",
    "GenerationRequest",
    "Logprob",
    "PauseMode",
    "PromptLogprobs",
    "PromptRendered",
    "RLControl",
    "RouteWeightsMode",
    "TokenLogprob",
    "check_engine_fields",
    "echo_logprobs",
    "token_text",
    "truncate_prompt",
    "wants_route_weights",
]


R = TypeVar("R", ChatCompletionRequest, CompletionRequest)


@dataclass
class GenerationRequest(Generic[R]):
    """One validated request. ``engine_request_id`` is unique per call (the engine aborts by id,
    and a client may reuse its ``X-Request-Id``)."""

    request: R
    request_id: str
    engine_request_id: str


@dataclass
class TokenLogprob:
    """Log-probability of one sampled token and its candidates (token text, logprob) as vLLM
    gives them for ``logprobs: k``: the sampled token first, then the top ``k`` by rank (the
    sampled token once when it is among them), or the ``logprob_token_ids``. A prompt's first
    token (echo) has none: ``logprob`` and ``top`` are None."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None


@dataclass
class Logprob:
    """One candidate of a prompt position, as vLLM's ``Logprob``."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# Per prompt token: None (the first has no context) or {token id: Logprob} for the token
# itself, then its top k.
PromptLogprobs = list[dict[int, Logprob] | None]


class ChoiceParser(Protocol):
    """One chat choice's output as vLLM's tool parsers read it (``--tool-call-parser``)."""

    def message(self, text: str, token_ids: list[int]) -> dict[str, Any]:
        """The whole output's message fields: ``content``, and ``tool_calls`` when parsed."""

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict[str, Any] | None:
        """A streamed output's ``delta``; None while the parser holds it back."""

    def finish_reason(self, reason: str) -> str:
        """The choice's finish reason once parsed (``tool_calls`` after a tool call)."""


@dataclass
class PromptRendered:
    """The prompt as the engine runs it; its text (for ``echo``) and, when asked for, its
    logprobs."""

    prompt_token_ids: list[int]
    prompt_text: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # echo with logprobs (completions): the prompt's tokens as the response's logprobs show them
    echo_logprobs: list[TokenLogprob] | None = None
    # chat with tools: a parser for each choice's output (None: the text is the content)
    choice_parser: Callable[[], ChoiceParser | None] | None = None


@dataclass
class ChoiceDelta:
    """New output of choice ``index``. ``raw_logprobs`` is an already-OpenAI-shaped logprobs
    object (upstream pass-through); otherwise ``logprobs`` has one entry per new token."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    raw_logprobs: dict[str, Any] | None = None
    # The choice's last output: its ChoiceFinished follows (the stream then sends this output
    # with the finish reason and the route handle, in one chunk, as vLLM's last chunk).
    last: bool = False
    # Upstream pass-through: the chat message's fields beside its content (tool_calls).
    message: dict[str, Any] | None = None


@dataclass
class ChoiceFinished:
    """Choice ``index`` is done.

    ``routed_experts`` is the engine's ``[R, num_layers, top_k]`` uint8/uint16 array for token rows
    ``routes_row_start .. routes_row_start + R`` of prompt + completion (vLLM: ``R = T - 1``), or
    None with ``routes_error`` saying why there is none.
    """

    index: int
    finish_reason: str
    stop_reason: int | str | None
    output_token_ids: list[int]
    num_cached_tokens: int
    routed_experts: np.ndarray | None
    routes_row_start: int = 0
    routes_error: str | None = None
    # vLLM's spans over OUTPUT tokens: tokens [start, end) were sampled by weights ``version``.
    # None: the engine did not say (the record's versions are then unknown).
    weight_versions: list[tuple[str, int, int]] | None = None
    # The routing weights applied to ``routed_experts``: same shape and slots, float32 holding
    # values of ``weights_dtype``; None when the request did not ask for them.
    routed_weights: np.ndarray | None = None
    weights_dtype: str | None = None


EngineEvent = PromptRendered | ChoiceDelta | ChoiceFinished

PauseMode = Literal["abort", "wait", "keep"]

# --route-weights: off (no capture: requests may not ask), request (captured; stored for the
# requests that ask), on (stored unless a request says false).
RouteWeightsMode = Literal["off", "request", "on"]


def wants_route_weights(request: ChatCompletionRequest | CompletionRequest, mode: str) -> bool:
    """Whether this request's routes are stored with their weights; 400 if it asks for them
    from an engine started without the capture."""
    asked = request.routed_experts_weights
    wanted = asked if asked is not None else mode == "on"
    if wanted and mode == "off":
        raise InvalidRequestError(
            "routed_experts_weights: this service captures no routing weights (start it with "
            "--route-weights request or on)",
            param="routed_experts_weights",
            code="unsupported",
        )
    return wanted


def truncate_prompt(
    ids: list[int], request: ChatCompletionRequest | CompletionRequest, max_model_len: int
) -> list[int]:
    """``ids`` cut to ``truncate_prompt_tokens`` as vLLM cuts them: from the left unless
    ``truncation_side`` is right; -1 keeps what leaves room for one output token."""
    k = request.truncate_prompt_tokens
    if k is None:
        return ids
    most = max_model_len - 1
    if k > most:
        raise InvalidRequestError(
            f"truncate_prompt_tokens={k} cannot be greater than the model's context of "
            f"{max_model_len} tokens less one for the output ({most})",
            param="truncate_prompt_tokens",
        )
    keep = most if k == -1 else k
    if keep >= len(ids):
        return ids
    return ids[:keep] if request.truncation_side == "right" else ids[len(ids) - keep :]


def token_text(token_id: int, text: str, request: ChatCompletionRequest | CompletionRequest) -> str:
    """A token as logprobs show it: its text, or ``token_id:<id>`` when the request asks."""
    return f"token_id:{token_id}" if request.return_tokens_as_token_ids else text


def echo_logprobs(
    prompt_ids: list[int],
    plp: PromptLogprobs,
    first_text: str,
    request: ChatCompletionRequest | CompletionRequest,
) -> list[TokenLogprob]:
    """The prompt's tokens as ``echo`` with logprobs shows them (vLLM: the first token without
    a logprob, each other its own and at most ``logprobs`` + 1 candidates)."""
    k = request.num_logprobs or 0
    out = [TokenLogprob(token_text(prompt_ids[0], first_text, request), None, None)]
    for tok, pos in zip(prompt_ids[1:], plp[1:], strict=True):
        own = (pos or {}).get(tok)
        cands = list((pos or {}).items())[: k + 1]
        top = [(token_text(t, lp.decoded_token or "", request), lp.logprob) for t, lp in cands]
        text = (own.decoded_token if own else None) or ""
        out.append(TokenLogprob(token_text(tok, text, request), own and own.logprob, top))
    return out


class RLControl(abc.ABC):
    """vLLM's RL control API (``vllm/entrypoints/rl/online/api_router.py``) as engine calls.

    No request may reuse a cached prefix (or its routes) computed by other weights than those
    that serve it, so a record's weight versions are true for every row.
    """

    @abc.abstractmethod
    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Stop scheduling: ``abort`` running requests, ``wait`` for them, or ``keep`` them
        frozen until :meth:`resume` (they then finish under the new weights: mixed spans)."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def is_paused(self) -> bool: ...

    @abc.abstractmethod
    async def abort_requests(self, request_ids: list[str] | None) -> int:
        """Abort the requests with these (client) request ids, or all in flight; how many."""

    @abc.abstractmethod
    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def shutdown_weight_transfer_engine(self) -> None: ...

    @abc.abstractmethod
    async def start_weight_update(self) -> None: ...

    @abc.abstractmethod
    async def update_weights(self, update_info: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def finish_weight_update(self, weight_version: str | None) -> None: ...

    @abc.abstractmethod
    async def update_weight_version(self, new_version: str) -> None: ...

    @abc.abstractmethod
    async def weight_version(self) -> str: ...

    @abc.abstractmethod
    async def reload_weights(
        self, checkpoint: Path, weight_version: str | None, root: Path
    ) -> None:
        """Load new weights from ``checkpoint``, a real directory inside ``root`` (the path that
        works without GPUs). A checkpoint the engine cannot use is refused before the engine's
        weights are touched; a load that fails after that restores the last good weights."""

    @abc.abstractmethod
    async def world_size(self, include_dp: bool) -> int: ...

    def weight_update_status(self) -> dict[str, Any] | None:
        """The RL call running now and the last weight change with its outcome (for a caller
        whose call timed out); None when this engine does not track them."""
        return None


class EngineBackend(abc.ABC):
    """What the service needs from an engine."""

    info: ModelInfo

    @abc.abstractmethod
    async def start(self) -> None:
        """Start (or connect to) the engine and fill :attr:`info`."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def check_ready(self) -> None:
        """Raise :class:`~.errors.EngineUnavailableError` unless requests can be served now."""

    @property
    @abc.abstractmethod
    def dead(self) -> bool:
        """True once the engine cannot recover (the process should be restarted)."""

    def num_unfinished(self) -> int:
        """Requests inside the engine (running or queued); -1 if unknown."""
        return -1

    @property
    def vllm_version(self) -> str | None:
        """The vLLM release serving the requests (``GET /version``); None without one."""
        return None

    def engine_metrics(self) -> Collector | None:
        """The engine's own Prometheus metrics, served on ``/metrics`` beside the service's;
        None if it has none in this process."""
        return None

    @abc.abstractmethod
    def generate_chat(
        self, req: GenerationRequest[ChatCompletionRequest]
    ) -> AsyncIterator[EngineEvent]:
        """Run a chat request; see the module docstring for the event order. Raises
        :class:`~.errors.InvalidRequestError` before the first event for a bad request and
        :class:`~.errors.EngineUnavailableError` if the engine dies."""

    @abc.abstractmethod
    def generate_completion(
        self, req: GenerationRequest[CompletionRequest]
    ) -> AsyncIterator[EngineEvent]:
        """Run a text completion request; as :meth:`generate_chat`."""

    @abc.abstractmethod
    async def tokenize(
        self, req: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        """vLLM's ``/tokenize``: a prompt or chat messages -> token ids (as the engine renders)."""

    @abc.abstractmethod
    async def detokenize(self, req: DetokenizeRequest) -> str:
        """vLLM's ``/detokenize``: token ids -> text."""

    @property
    def rl(self) -> RLControl | None:
        """The RL control of this engine, or None if it has none."""
        return None


def check_engine_fields(
    request: ChatCompletionRequest | CompletionRequest, structured: bool = False
) -> None:
    """400 naming any field an in-process engine would otherwise silently ignore.

    OpenAI features it does not implement (tools and structured output unless ``structured``:
    the engine constrains its sampling and parses tool calls) and fields nobody declared
    (``model_extra``: unknown, misspelled, or another server's extensions). The upstream backend
    forwards both to vLLM.
    """
    unsupported: dict[str, bool] = {}
    if isinstance(request, ChatCompletionRequest) and not structured:
        unsupported = {
            "tools": bool(request.tools),
            "functions": bool(request.functions),
            "tool_choice": request.tool_choice not in (None, "none"),
            "function_call": request.function_call not in (None, "none"),
        }
    for name, present in unsupported.items():
        if present:
            raise InvalidRequestError(
                f"{name}: this engine calls no tools (the synthetic engine); vLLM does "
                "(--backend vllm with --tool-call-parser, or --backend upstream)",
                param=name,
                code="unsupported",
            )
    rf = request.response_format
    wants = {
        "response_format": rf is not None and rf.get("type") not in (None, "text"),
        "structured_outputs": request.structured_outputs is not None,
    }
    for name, present in wants.items():
        if present and not structured:
            raise InvalidRequestError(
                f"{name}: this engine does not constrain its sampling (the synthetic engine); "
                "vLLM does (--backend vllm, or --backend upstream)",
                param=name,
                code="unsupported",
            )
    for name in request.model_extra or {}:
        raise InvalidRequestError(
            f"{name} is not a parameter this server knows; unknown fields are refused, not "
            "ignored (see docs/service.md for the accepted fields)",
            param=name,
            code="unknown_parameter",
        )
