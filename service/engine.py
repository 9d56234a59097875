"""The engine seam: one small interface, two implementations (in-process vLLM, upstream server).

A backend turns one parsed OpenAI request into a stream of plain events; the serving layer turns
events into OpenAI responses and the capture layer turns finished choices into stored routes.
Neither knows which backend produced the events.

Event order per request: exactly one :class:`PromptRendered` first (after every request check,
so errors before it are client errors answered with a 4xx), then :class:`ChoiceDelta` and
:class:`ChoiceFinished` events; every choice index ``0..n-1`` finishes exactly once.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .model_info import ModelInfo
from .protocol import ChatCompletionRequest, CompletionRequest

__all__ = [
    "ChoiceDelta",
    "ChoiceFinished",
    "EngineBackend",
    "EngineEvent",
    "GenerationRequest",
    "PromptRendered",
    "TokenLogprob",
]


@dataclass
class GenerationRequest:
    """One validated request. ``engine_request_id`` is unique per call (the engine aborts by id)."""

    kind: Literal["chat", "completion"]
    request: ChatCompletionRequest | CompletionRequest
    request_id: str
    engine_request_id: str
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenLogprob:
    """Log-probability of one sampled token and its top alternatives (token text, logprob)."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class PromptRendered:
    prompt_token_ids: list[int]


@dataclass
class ChoiceDelta:
    """New output of choice ``index``. ``raw_logprobs`` is an already-OpenAI-shaped logprobs
    object (upstream pass-through); otherwise ``logprobs`` has one entry per new token."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    raw_logprobs: dict[str, Any] | None = None


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


EngineEvent = PromptRendered | ChoiceDelta | ChoiceFinished


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

    @abc.abstractmethod
    def generate(self, req: GenerationRequest) -> AsyncIterator[EngineEvent]:
        """Run ``req``; see the module docstring for the event order. Raises
        :class:`~.errors.InvalidRequestError` before the first event for a bad request and
        :class:`~.errors.EngineUnavailableError` if the engine dies."""
