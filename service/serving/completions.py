"""Serving chat and text completions: one request -> engine events -> JSON body or SSE stream.

:class:`ServingChat` and :class:`ServingCompletion` share the request policy (request ids, model
check, metrics, client disconnects) and the capture of every finished choice's routes in
:class:`_ServingGeneration`; each fills in what differs between the two APIs (the engine call, the
choice and chunk shapes, the logprobs format), as vLLM keeps one serving class per API.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from routereplay.client import AsyncRouteStore

from ..capture import RouteCapture, npy_base64
from ..engine import (
    ChoiceDelta,
    ChoiceFinished,
    ChoiceParser,
    EngineBackend,
    EngineEvent,
    GenerationRequest,
    PromptLogprobs,
    PromptRendered,
    TokenLogprob,
)
from ..errors import (
    EngineUnavailableError,
    InvalidRequestError,
    NotFoundError,
    ServiceError,
)
from ..metrics import ServiceMetrics
from ..protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    RouteHandle,
    Usage,
)
from ..request_ids import Claim, RequestIds

__all__ = ["ServingChat", "ServingCompletion"]

log = logging.getLogger("routereplay.service")

R = TypeVar("R", ChatCompletionRequest, CompletionRequest)


@dataclass
class _Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    raw_logprobs: dict[str, Any] | None = None
    text_len: int = 0
    started: bool = False  # a chunk of this choice was sent (streaming)
    finish: ChoiceFinished | None = None
    parser: ChoiceParser | None = None  # chat with tools: vLLM's tool parser of this choice
    message: dict[str, Any] = field(default_factory=dict)  # upstream: tool_calls and such

    def add(self, ev: ChoiceDelta) -> None:
        self.text.append(ev.text)
        self.token_ids.extend(ev.token_ids)
        if ev.logprobs:
            self.logprobs.extend(ev.logprobs)
        if ev.raw_logprobs is not None:
            self.raw_logprobs = _merge_raw_logprobs(self.raw_logprobs, ev.raw_logprobs)
        if ev.message:
            self.message.update(ev.message)


class _StreamStores:
    """The route stores of a stream's finished choices, run concurrently: the choices of a
    request that finish in one engine step (a GRPO group with ``ignore_eos``) wait for the
    slowest store, not for all of them one after another, and the other choices' tokens keep
    streaming meanwhile. Each finishing chunk goes out once its route is stored."""

    def __init__(self) -> None:
        self._pending: dict[asyncio.Task, ChoiceFinished] = {}

    def start(self, ev: ChoiceFinished, capture: Awaitable[dict[str, Any]]) -> None:
        self._pending[asyncio.ensure_future(capture)] = ev

    def done(self) -> list[tuple[ChoiceFinished, dict[str, Any]]]:
        """The stores finished so far (the route fields of each choice), in the order they
        were started."""
        if not self._pending:
            return []
        return [(self._pending.pop(t), t.result()) for t in list(self._pending) if t.done()]

    async def rest(self) -> AsyncIterator[tuple[ChoiceFinished, dict[str, Any]]]:
        """The stores still running, each as soon as it finishes."""
        while self._pending:
            await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            for item in self.done():
                yield item

    def cancel(self) -> None:
        """A stream that ends early (an error, the client gone) answers for no route: the
        stores it has not reported are cancelled, as the non-streamed path cancels its own."""
        for t in self._pending:
            t.cancel()
        self._pending.clear()


@dataclass
class _Prompts:
    """The rendered prompts of one request: choice ``i`` is of prompt ``i // n`` (vLLM's
    numbering of a batch's choices)."""

    rendered: list[PromptRendered]
    n: int

    def of(self, i: int) -> PromptRendered:
        return self.rendered[i // self.n]

    def choices(self) -> list[_Choice]:
        """A fresh state per choice, each with its own output parser where there is one."""
        out = [_Choice() for _ in range(self.num_choices)]
        for i, ch in enumerate(out):
            make = self.of(i).choice_parser
            ch.parser = make() if make is not None else None
        return out

    @property
    def num_choices(self) -> int:
        return len(self.rendered) * self.n

    @property
    def num_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.rendered)


def _prompt_logprobs_json(plp: PromptLogprobs | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` as JSON: token id keys, ``Logprob`` objects."""
    if plp is None:
        return None
    return [
        None
        if pos is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in pos.items()
        }
        for pos in plp
    ]


async def _merged(streams: list[AsyncIterator[EngineEvent]], n: int) -> AsyncIterator[EngineEvent]:
    """The events of a batch's streams (each past its prompt) as one: prompt ``j``'s choice
    ``i`` becomes choice ``j * n + i``. The first failure of any stream ends them all."""
    queue: asyncio.Queue[EngineEvent | BaseException | None] = asyncio.Queue()

    async def pump(j: int, events: AsyncIterator[EngineEvent]) -> None:
        try:
            async for ev in events:
                if isinstance(ev, ChoiceDelta | ChoiceFinished):
                    ev = dataclasses.replace(ev, index=ev.index + j * n)
                queue.put_nowait(ev)
            queue.put_nowait(None)
        except Exception as e:
            queue.put_nowait(e)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.ensure_future(pump(j, s)) for j, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _finish_reason(ch: _Choice, reason: str) -> str:
    return ch.parser.finish_reason(reason) if ch.parser is not None else reason


def _merge_raw_logprobs(acc: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    if acc is None:
        return new
    return {k: (acc.get(k) or []) + (v or []) for k, v in new.items()}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` unless the client disconnects first (then cancel it and return None).

    A cancelled completion closes its engine stream, which aborts the request in the engine:
    RL clients that time out and retry must not leave orphaned generations behind.
    """

    async def disconnected() -> None:
        # The body has been read, so the next ASGI message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


class _GenerationStream(StreamingResponse):
    """The SSE response of one request, which ends with the response however it ends: the whole
    stream sent, or the client gone before the first chunk or mid-way.

    Starlette stops a stream whose client left by cancelling it, which may leave the body
    suspended at a ``yield`` or never started: ``end`` runs after that, outside the cancellation,
    so the engine request is closed and the request counted without waiting for garbage
    collection to close the body.
    """

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        end: Callable[[], Awaitable[None]],
        headers: dict[str, str],
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._end = end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: a server shutting down cancels this task; the end still runs whole.
            await asyncio.shield(self._end())


class _ServingGeneration(abc.ABC, Generic[R]):
    """The request lifecycle both completion APIs share."""

    endpoint: ClassVar[str]  # metrics label
    id_prefix: ClassVar[str]  # of generated request ids
    chunk_object: ClassVar[str]
    prompt_field: ClassVar[str]  # the field that carries the prompt, for error messages

    def __init__(
        self,
        backend: EngineBackend,
        capture: RouteCapture,
        metrics: ServiceMetrics,
        request_ids: RequestIds,
    ) -> None:
        self.backend = backend
        self.capture = capture
        self.metrics = metrics
        self.request_ids = request_ids

    # -- per-API hooks -----------------------------------------------------------------------------
    @abc.abstractmethod
    def _generate(self, greq: GenerationRequest[R]) -> AsyncIterator[EngineEvent]: ...

    @abc.abstractmethod
    def _response(
        self,
        greq: GenerationRequest[R],
        prompts: _Prompts,
        choices: list[_Choice],
        routes: dict[int, dict[str, Any]],
        usage: Usage,
    ) -> dict[str, Any]: ...

    def _parts(self, greq: GenerationRequest[R]) -> list[GenerationRequest[R]]:
        """The engine requests ``greq`` is served by (completions: one per prompt)."""
        return [greq]

    def _opening_chunks(
        self, greq: GenerationRequest[R], prompts: _Prompts
    ) -> list[dict[str, Any]]:
        """Chunks sent before any token (chat: the assistant role); each ``{"choice", **extra}``."""
        return []

    @abc.abstractmethod
    def _delta_choice(
        self, greq: GenerationRequest[R], ev: ChoiceDelta, ch: _Choice, prompt: PromptRendered
    ) -> dict[str, Any] | None:
        """A streamed output's choice; None: nothing to send for it now."""

    @abc.abstractmethod
    def _finish_choice(self, ev: ChoiceFinished) -> dict[str, Any]: ...

    # -- the request -------------------------------------------------------------------------------
    async def create(
        self,
        request: R,
        raw_request: Request,
        x_request_id: str | None,
        store: AsyncRouteStore,
    ) -> Response:
        """Serve one request: a JSON response, or an SSE stream when ``request.stream``; its
        routes go to ``store`` (the caller's namespace)."""
        t0 = time.perf_counter()
        self.metrics.inflight.inc()
        claimed: Claim | None = None  # released here, or by the stream once it owns it
        try:
            rid = self.request_ids.resolve(x_request_id, self.id_prefix)
            self._check(request)
            if x_request_id is not None:  # generated ids are unique already
                claimed = await self.request_ids.claim(store, rid)
            greq = GenerationRequest(
                request=request,
                request_id=rid,
                # Unique per call: vLLM aborts by id, and a client may reuse its X-Request-Id.
                engine_request_id=f"{rid}.{uuid.uuid4().hex[:8]}",
            )
            headers = {"X-Request-Id": rid}
            if request.stream:
                # Until its first output the engine may hold the request (queued, prefilling,
                # paused): a client that leaves meanwhile is noticed here, not at that output.
                opened = await _unless_disconnected(raw_request, self._open(greq, claimed))
                if opened is not None:
                    response = self._stream_response(greq, *opened, store, t0, claimed, headers)
                    claimed = None  # the stream releases it
                    return response
                result = None
            else:
                result = await _unless_disconnected(
                    raw_request, self._complete(greq, claimed, store)
                )
        except ServiceError as e:
            self._done(t0, e.status_code)
            raise
        except BaseException:
            self._done(t0, 500)
            raise
        finally:
            await self.request_ids.release(claimed)
        if result is None:
            # The client closed the request; its engine request was aborted.
            self._done(t0, 499)
            return Response(status_code=499)
        self._done(t0, 200)
        return JSONResponse(result, headers=headers)

    def _check(self, request: R) -> None:
        info = self.backend.info
        if request.model is not None and request.model != info.name:
            raise NotFoundError(
                f"model {request.model!r} does not exist; this server serves {info.name!r}",
                param="model",
                code="model_not_found",
            )
        rt = request.requested_max_tokens
        if rt is not None and rt > info.max_model_len:
            f = request.max_tokens_field
            raise InvalidRequestError(
                f"{f}={rt} exceeds the model's context of {info.max_model_len} tokens", param=f
            )
        if info.max_token_bytes:
            # Refuse what cannot fit before the chat template and tokenizer spend time on it
            # (a 1 MB message took the event loop ~1 s to render).
            least = request.prompt_chars() // info.max_token_bytes
            if least >= info.max_model_len:
                f = self.prompt_field
                raise InvalidRequestError(
                    f"{f}: {request.prompt_chars()} characters are at least {least} tokens; the "
                    f"model's context is {info.max_model_len} tokens",
                    param=f,
                )

    def _model_name(self, request: R) -> str:
        return request.model or self.backend.info.name

    def _done(self, t0: float, status: int) -> None:
        m = self.metrics
        m.inflight.dec()
        m.requests.labels(endpoint=self.endpoint, status=str(status)).inc()
        m.latency.labels(endpoint=self.endpoint).observe(time.perf_counter() - t0)

    def _stream_response(
        self,
        greq: GenerationRequest[R],
        prompts: _Prompts,
        events: AsyncIterator[EngineEvent],
        store: AsyncRouteStore,
        t0: float,
        claim: Claim | None,
        headers: dict[str, str],
    ) -> StreamingResponse:
        """The SSE response of an opened request; it owns ``events`` and ``claim``."""
        # 499 until the client has taken the whole stream (the body sets the real status then).
        outcome = {"status": 499}
        body = self._stream(greq, prompts, events, outcome, store)
        end = functools.partial(self._end_stream, body, events, t0, claim, outcome)
        return _GenerationStream(body, end, headers)

    async def _end_stream(
        self,
        body: AsyncGenerator[bytes, None],
        events: AsyncIterator[EngineEvent],
        t0: float,
        claim: Claim | None,
        outcome: dict[str, int],
    ) -> None:
        # A stream's request ends with its response, not when the handler returns.
        try:
            await body.aclose()
            # Closing an unfinished engine stream aborts the request in the engine (the body
            # closes it too, unless it never started: the client left before the first chunk).
            await events.aclose()
        finally:
            self._done(t0, outcome["status"])
            await self.request_ids.release(claim)

    async def _open(
        self, greq: GenerationRequest[R], claim: Claim | None
    ) -> tuple[_Prompts, AsyncIterator[EngineEvent]]:
        """Start ``greq``'s engine requests; their prompts and the remaining events.

        Runs each up to its first event, so every request error surfaces here, before a
        response (or stream) is started, and becomes a proper 4xx. Once the engine accepted a
        request under a reused id, the earlier generation's extra routes are retired.
        """
        streams = [aiter(self._generate(p)) for p in self._parts(greq)]
        if len(streams) == 1:
            try:
                rendered = [await self._first(streams[0])]
            except BaseException:
                await streams[0].aclose()
                raise
            events = streams[0]
        else:
            rendered = await self._first_of_each(streams)
            events = _merged(streams, greq.request.n)
        prompts = _Prompts(rendered, greq.request.n)
        if claim is not None:
            await self.request_ids.retire_stale(claim, prompts.num_choices)
        return prompts, events

    @staticmethod
    async def _first(events: AsyncIterator[EngineEvent]) -> PromptRendered:
        try:
            first = await anext(events)
        except StopAsyncIteration as e:
            raise EngineUnavailableError(
                "the engine produced no output", code="engine_error"
            ) from e
        if not isinstance(first, PromptRendered):
            raise EngineUnavailableError(
                f"the engine sent {type(first).__name__} before the prompt", code="engine_error"
            )
        return first

    async def _first_of_each(
        self, streams: list[AsyncIterator[EngineEvent]]
    ) -> list[PromptRendered]:
        """A batch's prompts, submitted together; the first failure ends every stream."""
        tasks = [asyncio.ensure_future(self._first(s)) for s in streams]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]
            raise
        return [t.result() for t in tasks]

    async def _capture(
        self,
        greq: GenerationRequest[R],
        prompts: _Prompts,
        ch: _Choice,
        fin: ChoiceFinished,
        store: AsyncRouteStore,
    ) -> dict[str, Any]:
        """Store one finished choice's routes; the choice's route fields for the response."""
        ch.finish = fin
        route_id = f"{greq.request_id}-{fin.index}"
        prompt_ids = prompts.of(fin.index).prompt_token_ids
        handle = await self.capture.capture(store, route_id, fin, prompt_ids, greq.request_id)
        if greq.request.return_routed_experts == "inline":
            arr = fin.routed_experts
            inline = None
            if arr is not None:
                # Base64 of a long route array is CPU work: keep it off the event loop.
                inline = (
                    await asyncio.to_thread(npy_base64, arr)
                    if arr.nbytes > 1 << 16
                    else (npy_base64(arr))
                )
            return {"routed_experts": inline, "routed_experts_handle": handle}
        return {"routed_experts": handle}

    def _usage(self, prompts: _Prompts, choices: list[_Choice], count: bool = True) -> Usage:
        """Usage so far; ``count`` adds a finished request's tokens to the metrics (once)."""
        completion = sum(len(c.token_ids) for c in choices)
        n = prompts.n
        cached = sum(  # each prompt's hit, as its engine request reports it
            max((c.finish.num_cached_tokens for c in choices[j : j + n] if c.finish), default=0)
            for j in range(0, len(choices), n)
        )
        prompt_tokens = prompts.num_tokens
        if count:
            self.metrics.prompt_tokens.inc(prompt_tokens)
            self.metrics.completion_tokens.inc(completion)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
            prompt_tokens_details={"cached_tokens": cached},
        )

    # -- non-streaming -----------------------------------------------------------------------------
    async def _complete(
        self, greq: GenerationRequest[R], claim: Claim | None, store: AsyncRouteStore
    ) -> dict[str, Any]:
        """Run ``greq`` to the end; the OpenAI response as a JSON-able dict."""
        prompts, events = await self._open(greq, claim)
        choices = prompts.choices()
        stores: dict[int, asyncio.Task] = {}
        try:
            async for ev in events:
                if isinstance(ev, ChoiceDelta):
                    choices[ev.index].add(ev)
                elif isinstance(ev, ChoiceFinished):
                    # Store each choice as it finishes, concurrently with the others' decoding.
                    stores[ev.index] = asyncio.create_task(
                        self._capture(greq, prompts, choices[ev.index], ev, store)
                    )
            routes = {i: await t for i, t in stores.items()}
        except BaseException:
            for t in stores.values():
                t.cancel()
            raise
        finally:
            await events.aclose()
        usage = self._usage(prompts, choices)
        return self._response(greq, prompts, choices, routes, usage)

    @staticmethod
    def _common(greq: GenerationRequest[R], i: int, ch: _Choice, route: dict[str, Any]) -> dict:
        fin = ch.finish
        return dict(
            index=i,
            finish_reason=_finish_reason(ch, fin.finish_reason) if fin else None,
            stop_reason=fin.stop_reason if fin else None,
            token_ids=ch.token_ids if greq.request.return_token_ids else None,
            **route,
        )

    # -- streaming ---------------------------------------------------------------------------------
    def _finishing(
        self, ch: _Choice, ev: ChoiceFinished, last: dict[str, Any] | None, route: dict[str, Any]
    ) -> dict[str, Any]:
        """The chunk that finishes a choice: its last output (or, when the engine finished it
        without one, an empty one), the finish reason and the route handle."""
        handle = {k: (v.model_dump(mode="json") if isinstance(v, RouteHandle) else v)
                  for k, v in route.items()}  # fmt: skip
        base = last or {"index": ev.index, "logprobs": None, **self._finish_choice(ev)}
        return {**base, "finish_reason": _finish_reason(ch, ev.finish_reason),
                "stop_reason": ev.stop_reason, **handle}  # fmt: skip

    async def _stream(
        self,
        greq: GenerationRequest[R],
        prompts: _Prompts,
        events: AsyncIterator[EngineEvent],
        outcome: dict[str, int],
        store: AsyncRouteStore,
    ) -> AsyncGenerator[bytes, None]:
        """SSE body of an opened request: OpenAI chunks, a route handle on each finishing chunk.

        Always ends with ``data: [DONE]``; a failure after the headers went out travels as an
        error event before it (and in the request metrics with its real status).
        """
        r = greq.request
        base = {"id": greq.request_id, "object": self.chunk_object,
                "created": int(time.time()), "model": self._model_name(r)}  # fmt: skip
        choices = prompts.choices()

        def chunk(choice: dict[str, Any], **extra: Any) -> bytes:
            body = {**base, "choices": [choice], **extra}
            if r.continuous_usage:
                body["usage"] = self._usage(prompts, choices, count=False).model_dump()
            return _sse(body)

        def finishing(fin: ChoiceFinished, route: dict[str, Any]) -> bytes:
            last = held.pop(fin.index, None)
            return chunk(self._finishing(choices[fin.index], fin, last, route))

        status = 200
        # Each choice's last output, held until its finish: vLLM sends the last token with the
        # finish reason, and the route handle rides on that chunk once the route is stored.
        held: dict[int, dict[str, Any]] = {}
        stores = _StreamStores()
        try:
            for c in self._opening_chunks(greq, prompts):
                yield chunk(**c)
            async for ev in events:
                if isinstance(ev, ChoiceDelta):
                    ch = choices[ev.index]
                    ch.add(ev)
                    c = self._delta_choice(greq, ev, ch, prompts.of(ev.index))
                    if c is None:  # a parser holds this output back (vLLM sends nothing)
                        continue
                    ch.started = True
                    if ev.last:
                        held[ev.index] = c
                    else:
                        yield chunk(c)
                elif isinstance(ev, ChoiceFinished):
                    ch = choices[ev.index]
                    ch.finish = ev  # counted in a continuous usage while its route is stored
                    stores.start(ev, self._capture(greq, prompts, ch, ev, store))
                for fin, route in stores.done():
                    yield finishing(fin, route)
            async for fin, route in stores.rest():
                yield finishing(fin, route)
            for c in held.values():  # a last output whose finish never came: still sent
                yield chunk(c)
            usage = self._usage(prompts, choices)
            if r.include_usage_in_stream:
                yield _sse({**base, "choices": [], "usage": usage.model_dump(mode="json")})
        except ServiceError as e:
            # Headers are gone: the error travels in the stream, as OpenAI-compatible servers do.
            status = e.status_code
            yield _sse(e.body())
        except Exception as e:
            log.exception("stream %s failed", greq.request_id)
            status = 500
            err = ServiceError(
                f"internal error: {type(e).__name__}; the server log has the traceback"
            )
            yield _sse(err.body())
        finally:
            stores.cancel()
            await events.aclose()
        yield b"data: [DONE]\n\n"
        outcome["status"] = status  # reached once the client took the last chunk


# -- chat ------------------------------------------------------------------------------------------
def _chat_logprobs(entries: list[TokenLogprob], k: int | None) -> dict[str, Any]:
    """vLLM's chat logprobs: each token's first ``k`` candidates (``top_logprobs``; None: all,
    for ``logprob_token_ids``), in the engine's order (the sampled token first)."""

    def one(tok: str, lp: float | None) -> dict[str, Any]:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in (e.top or [])[:k]]}
            for e in entries
        ]
    }


def _chat_k(r: ChatCompletionRequest) -> int | None:
    return None if r.logprob_token_ids else (r.top_logprobs or 0)


def _echoed_message(r: ChatCompletionRequest) -> str:
    """What chat ``echo`` puts before each choice's content (vLLM: the last message's content
    when that message is the assistant's)."""
    last = r.messages[-1]
    if not r.echo or last.role != "assistant" or not last.content:
        return ""
    c = last.content
    return c if isinstance(c, str) else "\n".join(part["text"] for part in c)


class ServingChat(_ServingGeneration[ChatCompletionRequest]):
    """``POST /v1/chat/completions``."""

    endpoint = "chat"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    prompt_field = "messages"

    def _generate(
        self, greq: GenerationRequest[ChatCompletionRequest]
    ) -> AsyncIterator[EngineEvent]:
        return self.backend.generate_chat(greq)

    def _response(self, greq, prompts, choices, routes, usage) -> dict[str, Any]:  # type: ignore[override]
        r = greq.request
        prompt = prompts.rendered[0]
        echoed = _echoed_message(r)
        out = []
        for i, ch in enumerate(choices):
            lp = ch.raw_logprobs or (
                _chat_logprobs(ch.logprobs, _chat_k(r)) if r.logprobs else None
            )
            out.append(
                ChatChoice(
                    message=self._message(ch, echoed),
                    logprobs=lp,
                    **self._common(greq, i, ch, routes.get(i, {})),
                )
            )
        return ChatCompletionResponse(
            id=greq.request_id,
            model=self._model_name(r),
            choices=out,
            usage=usage,
            prompt_logprobs=_prompt_logprobs_json(prompt.prompt_logprobs),
            prompt_token_ids=prompt.prompt_token_ids if r.return_token_ids else None,
        ).model_dump(mode="json")

    @staticmethod
    def _message(ch: _Choice, echoed: str) -> ChatMessage:
        text = "".join(ch.text)
        fields = ch.parser.message(text, ch.token_ids) if ch.parser else {"content": text}
        fields.update(ch.message)
        if echoed:
            fields["content"] = echoed + (fields.get("content") or "")
        return ChatMessage(**fields)

    def _opening_chunks(self, greq, prompts) -> list[dict[str, Any]]:  # type: ignore[override]
        # As vLLM: each choice opens with the assistant role; prompt_token_ids ride on these;
        # with echo, a chunk of the echoed message follows.
        r = greq.request
        extra = (
            {"prompt_token_ids": prompts.rendered[0].prompt_token_ids} if r.return_token_ids else {}
        )
        chunks = [
            {
                "choice": {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                },
                **extra,
            }
            for i in range(r.n)
        ]
        echoed = _echoed_message(r)
        if echoed:
            chunks += [
                {"choice": {"index": i, "delta": {"content": echoed}, "logprobs": None,
                            "finish_reason": None}}
                for i in range(r.n)
            ]  # fmt: skip
        return chunks

    def _delta_choice(self, greq, ev, ch, prompt) -> dict[str, Any] | None:  # type: ignore[override]
        r = greq.request
        lp = ev.raw_logprobs
        if lp is None and r.logprobs and ev.logprobs:
            lp = _chat_logprobs(ev.logprobs, _chat_k(r))
        delta: dict[str, Any] | None = {"content": ev.text}
        if ch.parser is not None:
            delta = ch.parser.delta(ev.text, ev.token_ids, finished=ev.last)
            # As vLLM: an output the parser holds back is sent only to carry what the client
            # asked for per token, or the finish.
            if delta is None and not (ev.last or lp is not None or r.return_token_ids):
                return None
        if ev.message and ev.message.get("tool_calls"):  # upstream: the whole choice at once
            calls = ev.message["tool_calls"]
            delta = {
                **(delta or {}),
                "tool_calls": [{"index": j, **c} for j, c in enumerate(calls)],
            }
        c: dict[str, Any] = {
            "index": ev.index,
            "delta": delta or {},
            "logprobs": lp,
            "finish_reason": None,
        }
        if r.return_token_ids:
            c["token_ids"] = ev.token_ids
        return c

    def _finish_choice(self, ev: ChoiceFinished) -> dict[str, Any]:
        return {"delta": {}}


# -- text completions ------------------------------------------------------------------------------
def _cmpl_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """vLLM's completion logprobs: for ``logprobs: k`` each token's candidates are the sampled
    token and the top ``k`` (``k`` or ``k + 1`` entries), as the OpenAI API defines them (an
    echoed prompt's first token: none)."""
    offsets, off = [], text_offset
    for e in entries:
        offsets.append(off)
        off += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def _echo_text(r: CompletionRequest, prompt: PromptRendered) -> str:
    # As vLLM: with return_token_ids the prompt travels as ids, not echoed as text.
    return "" if r.return_token_ids else (prompt.prompt_text or "")


class ServingCompletion(_ServingGeneration[CompletionRequest]):
    """``POST /v1/completions``."""

    endpoint = "completions"
    id_prefix = "cmpl"
    chunk_object = "text_completion"
    prompt_field = "prompt"

    def _check(self, request: CompletionRequest) -> None:
        super()._check(request)
        if request.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix", code="unsupported")

    def _parts(self, greq: GenerationRequest[CompletionRequest]) -> list[GenerationRequest]:
        # A batch: one engine request per prompt, each with its own engine id.
        r = greq.request
        prompts = r.prompts
        if len(prompts) == 1:
            return [dataclasses.replace(greq, request=r.one(prompts[0]))]
        return [
            GenerationRequest(r.one(p), greq.request_id, f"{greq.engine_request_id}-{j}")
            for j, p in enumerate(prompts)
        ]

    def _generate(self, greq: GenerationRequest[CompletionRequest]) -> AsyncIterator[EngineEvent]:
        return self.backend.generate_completion(greq)

    @staticmethod
    def _shown(
        r: CompletionRequest, prompt: PromptRendered, text: str, lps: list[TokenLogprob]
    ) -> tuple[str, list[TokenLogprob]]:
        """A choice's first text and logprobs as shown: after the echoed prompt, or (max_tokens
        0) the echoed prompt alone."""
        if not r.echo:
            return text, lps
        echoed, echo_lps = _echo_text(r, prompt), prompt.echo_logprobs or []
        if r.max_tokens == 0:
            return echoed, echo_lps
        return echoed + text, echo_lps + lps

    def _response(self, greq, prompts, choices, routes, usage) -> dict[str, Any]:  # type: ignore[override]
        r = greq.request
        want_lp = r.logprobs is not None
        out = []
        for i, ch in enumerate(choices):
            prompt = prompts.of(i)
            text, lps = self._shown(r, prompt, "".join(ch.text), ch.logprobs)
            lp = ch.raw_logprobs or (_cmpl_logprobs(lps, 0) if want_lp else None)
            out.append(
                CompletionChoice(
                    text=text,
                    logprobs=lp,
                    prompt_logprobs=_prompt_logprobs_json(prompt.prompt_logprobs),
                    prompt_token_ids=prompt.prompt_token_ids if r.return_token_ids else None,
                    **self._common(greq, i, ch, routes.get(i, {})),
                )
            )
        return CompletionResponse(
            id=greq.request_id, model=self._model_name(r), choices=out, usage=usage
        ).model_dump(mode="json")

    def _delta_choice(self, greq, ev, ch, prompt) -> dict[str, Any]:  # type: ignore[override]
        r = greq.request
        text, lps = ev.text, ev.logprobs or []
        if not ch.started:
            text, lps = self._shown(r, prompt, text, lps)
        lp = ev.raw_logprobs
        if lp is None and r.logprobs is not None and lps:
            lp = _cmpl_logprobs(lps, ch.text_len)
            ch.text_len = lp["text_offset"][-1] + len(lp["tokens"][-1])
        c: dict[str, Any] = {
            "index": ev.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": None,
        }
        if r.return_token_ids:
            c["token_ids"] = ev.token_ids
            if not ch.started:  # as vLLM: on each choice's first chunk
                c["prompt_token_ids"] = prompt.prompt_token_ids
        return c

    def _finish_choice(self, ev: ChoiceFinished) -> dict[str, Any]:
        return {"text": ""}
