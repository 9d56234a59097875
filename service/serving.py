"""Serving: one OpenAI request -> engine events -> response body or SSE stream, routes captured.

Engine-agnostic (see :mod:`.engine`); the handlers in :mod:`.app` only parse and dispatch.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .capture import RouteCapture, npy_base64
from .engine import (
    ChoiceDelta,
    ChoiceFinished,
    EngineBackend,
    EngineEvent,
    GenerationRequest,
    PromptRendered,
    TokenLogprob,
)
from .errors import EngineUnavailableError, ServiceError
from .metrics import ServiceMetrics
from .protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionResponse,
    RouteHandle,
    Usage,
)

__all__ = ["CompletionServer"]


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(tok: str, lp: float) -> dict[str, Any]:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
            for e in entries
        ]
    }


def _cmpl_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    offsets, off = [], text_offset
    for e in entries:
        offsets.append(off)
        off += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def _merge_raw_logprobs(acc: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    if acc is None:
        return new
    return {k: (acc.get(k) or []) + (v or []) for k, v in new.items()}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    raw_logprobs: dict[str, Any] | None = None
    text_len: int = 0
    finish: ChoiceFinished | None = None


class CompletionServer:
    """Serves chat and text completions through one backend and captures every choice's routes."""

    def __init__(
        self, backend: EngineBackend, capture: RouteCapture, metrics: ServiceMetrics
    ) -> None:
        self.backend = backend
        self.capture = capture
        self.metrics = metrics

    async def open(self, req: GenerationRequest) -> tuple[list[int], AsyncIterator[EngineEvent]]:
        """Start ``req`` and return its prompt token ids and the remaining events.

        Runs the backend up to its first event, so every request error surfaces here, before a
        response (or stream) is started, and becomes a proper 4xx.
        """
        events = aiter(self.backend.generate(req))
        try:
            first = await anext(events)
        except StopAsyncIteration as e:
            raise EngineUnavailableError(
                "the engine produced no output", code="engine_error"
            ) from e
        except BaseException:
            await events.aclose()
            raise
        assert isinstance(first, PromptRendered)
        return first.prompt_token_ids, events

    # -- route handles -----------------------------------------------------------------------------
    async def _finish(
        self, req: GenerationRequest, prompt_ids: list[int], ch: _Choice, fin: ChoiceFinished
    ) -> dict[str, Any]:
        """Capture one finished choice; returns the choice's route fields for the response."""
        ch.finish = fin
        route_id = f"{req.request_id}-{fin.index}"
        handle = await self.capture.capture(route_id, fin, prompt_ids, req.request_id)
        if req.request.return_routed_experts == "inline":
            inline = npy_base64(fin.routed_experts) if fin.routed_experts is not None else None
            return {"routed_experts": inline, "routed_experts_handle": handle}
        return {"routed_experts": handle}

    def _usage(self, prompt_ids: list[int], choices: list[_Choice]) -> Usage:
        """Usage of a finished request (counted once into the token metrics here)."""
        completion = sum(len(c.token_ids) for c in choices)
        cached = max((c.finish.num_cached_tokens for c in choices if c.finish), default=0)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self.metrics.completion_tokens.inc(completion)
        return Usage(
            prompt_tokens=len(prompt_ids),
            completion_tokens=completion,
            total_tokens=len(prompt_ids) + completion,
            prompt_tokens_details={"cached_tokens": cached},
        )

    # -- non-streaming -----------------------------------------------------------------------------
    async def complete(self, req: GenerationRequest) -> dict[str, Any]:
        """Run ``req`` to the end; returns the OpenAI response as a JSON-able dict."""
        prompt_ids, events = await self.open(req)
        r = req.request
        choices = [_Choice() for _ in range(r.n)]
        routes: dict[int, asyncio.Task] = {}
        try:
            async for ev in events:
                if isinstance(ev, ChoiceDelta):
                    self._accumulate(choices[ev.index], ev)
                elif isinstance(ev, ChoiceFinished):
                    # Store each choice as it finishes, concurrently with the others' decoding.
                    routes[ev.index] = asyncio.create_task(
                        self._finish(req, prompt_ids, choices[ev.index], ev)
                    )
            fields = {i: await t for i, t in routes.items()}
        except BaseException:
            for t in routes.values():
                t.cancel()
            raise
        finally:
            await events.aclose()
        usage = self._usage(prompt_ids, choices)
        return self._response(req, prompt_ids, choices, fields, usage)

    @staticmethod
    def _accumulate(ch: _Choice, ev: ChoiceDelta) -> None:
        ch.text.append(ev.text)
        ch.token_ids.extend(ev.token_ids)
        if ev.logprobs:
            ch.logprobs.extend(ev.logprobs)
        if ev.raw_logprobs is not None:
            ch.raw_logprobs = _merge_raw_logprobs(ch.raw_logprobs, ev.raw_logprobs)

    def _response(
        self,
        req: GenerationRequest,
        prompt_ids: list[int],
        choices: list[_Choice],
        fields: dict[int, dict[str, Any]],
        usage: Usage,
    ) -> dict[str, Any]:
        r = req.request
        want_lp = r.num_logprobs is not None
        want_ids = r.return_token_ids
        out: list[Any] = []
        for i, ch in enumerate(choices):
            fin = ch.finish
            common = dict(
                index=i,
                finish_reason=fin.finish_reason if fin else None,
                stop_reason=fin.stop_reason if fin else None,
                token_ids=ch.token_ids if want_ids else None,
                **fields.get(i, {}),
            )
            if req.kind == "chat":
                lp = ch.raw_logprobs or (_chat_logprobs(ch.logprobs) if want_lp else None)
                out.append(
                    ChatChoice(message=ChatMessage(content="".join(ch.text)), logprobs=lp, **common)
                )
            else:
                lp = ch.raw_logprobs or (_cmpl_logprobs(ch.logprobs, 0) if want_lp else None)
                out.append(CompletionChoice(text="".join(ch.text), logprobs=lp, **common))
        cls = ChatCompletionResponse if req.kind == "chat" else CompletionResponse
        resp = cls(
            id=req.request_id,
            model=r.model,
            choices=out,
            usage=usage,
            prompt_token_ids=prompt_ids if want_ids else None,
        )
        return resp.model_dump(mode="json")

    # -- streaming ---------------------------------------------------------------------------------
    async def stream(
        self, req: GenerationRequest, prompt_ids: list[int], events: AsyncIterator[EngineEvent]
    ) -> AsyncIterator[bytes]:
        """SSE body of an opened request: OpenAI chunks, a route handle on each finishing chunk."""
        r = req.request
        chat = req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        base = {"id": req.request_id, "object": obj, "created": created, "model": r.model}
        choices = [_Choice() for _ in range(r.n)]
        want_lp = r.num_logprobs is not None

        def sse(choice: dict[str, Any], **extra: Any) -> bytes:
            body = {**base, "choices": [choice], **extra}
            return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

        try:
            if chat:
                for i in range(r.n):
                    yield sse({"index": i, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None})  # fmt: skip
            async for ev in events:
                if isinstance(ev, ChoiceDelta):
                    ch = choices[ev.index]
                    self._accumulate(ch, ev)
                    yield sse(self._delta_choice(chat, ev, ch, want_lp, r.return_token_ids))
                    ch.text_len += len(ev.text)
                elif isinstance(ev, ChoiceFinished):
                    ch = choices[ev.index]
                    route = await self._finish(req, prompt_ids, ch, ev)
                    route = {k: (v.model_dump(mode="json") if isinstance(v, RouteHandle) else v)
                             for k, v in route.items()}  # fmt: skip
                    c: dict[str, Any] = {"index": ev.index, "logprobs": None,
                                         "finish_reason": ev.finish_reason,
                                         "stop_reason": ev.stop_reason, **route}  # fmt: skip
                    if chat:
                        c["delta"] = {}
                    else:
                        c["text"] = ""
                    yield sse(c)
            usage = self._usage(prompt_ids, choices)
            if r.include_usage_in_stream:
                body = {**base, "choices": [], "usage": usage.model_dump(mode="json")}
                yield b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
        except ServiceError as e:
            # Headers are gone: the error travels in the stream, as OpenAI-compatible servers do.
            yield b"data: " + json.dumps(e.body()).encode() + b"\n\n"
        finally:
            await events.aclose()
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _delta_choice(
        chat: bool, ev: ChoiceDelta, ch: _Choice, want_lp: bool, want_ids: bool
    ) -> dict[str, Any]:
        lp = ev.raw_logprobs
        if lp is None and want_lp and ev.logprobs:
            lp = _chat_logprobs(ev.logprobs) if chat else _cmpl_logprobs(ev.logprobs, ch.text_len)
        c: dict[str, Any] = {"index": ev.index, "logprobs": lp, "finish_reason": None}
        if chat:
            c["delta"] = {"content": ev.text}
        else:
            c["text"] = ev.text
        if want_ids:
            c["token_ids"] = ev.token_ids
        return c
