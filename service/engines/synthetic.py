"""A deterministic engine backend with no model: predictable tokens and routes, instant start.

For the service's fast test tier and for integration work that does not need a real model (an RL
framework's client code, a trainer's fetch and align path, load tests, deployment checks):
``routereplay serve --backend synthetic``. It keeps the in-process vLLM backend's contract, so the
service cannot tell the two apart:

- byte-level tokenizer (token id = UTF-8 byte), a plain-text chat template;
- each choice's tokens are printable ASCII picked by hashing (seed + choice index, history);
  ``temperature=0`` is greedy (every choice equal, so ``n > 1`` is refused as vLLM refuses it);
- routes are vLLM-shaped: ``[T - 1, num_layers, top_k]`` uint8 from ``routed_experts_prompt_start``
  on, dense layers all zero; row ``p`` depends only on tokens ``0..p`` (a shared prefix routes
  identically, as in a real engine) and is given by :func:`synthetic_routes`; with
  ``route_weights`` on, their weights (float32, each row summing to 1) by :func:`synthetic_weights`;
- prompt-prefix reuse is reported in ``num_cached_tokens`` in whole blocks, as by a prefix cache.

Faults for tests: :meth:`SyntheticBackend.kill` (the engine dies: running streams end with
``engine_dead``, later requests get 503) and ``fault`` (an exception raised mid-generation).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..engine import (
    ChoiceDelta,
    ChoiceFinished,
    EngineBackend,
    EngineEvent,
    GenerationRequest,
    Logprob,
    PauseMode,
    PromptLogprobs,
    PromptRendered,
    RLControl,
    RouteWeightsMode,
    TokenLogprob,
    check_engine_fields,
    echo_logprobs,
    token_text,
    truncate_prompt,
    wants_route_weights,
)
from ..errors import EngineUnavailableError, InvalidRequestError
from ..model_info import ModelInfo
from ..protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

__all__ = ["SyntheticBackend", "render_chat", "synthetic_routes", "synthetic_weights"]

_MASK = (1 << 64) - 1
_VOCAB = 256  # byte-level


def _mix(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _prefix_hashes(token_ids: Sequence[int]) -> list[int]:
    """``h[p]`` = hash of tokens ``0..p`` (chained, so equal prefixes hash equal)."""
    out, h = [], 0
    for t in token_ids:
        h = _mix(h ^ (int(t) + 1))
        out.append(h)
    return out


def synthetic_routes(
    token_ids: Sequence[int],
    num_layers: int,
    moe_layers: Sequence[int],
    num_experts: int,
    top_k: int,
    row_start: int = 0,
    salts: Sequence[int] | None = None,
) -> np.ndarray:
    """The routes the synthetic engine reports for a sequence: ``[T - 1 - row_start, L, K]`` uint8.

    Row ``p`` (token position ``row_start + p``) of MoE layer ``l``: experts
    ``(b + j) % num_experts`` for ``j < top_k``, ``b`` a hash of tokens ``0..p``, ``l`` and the
    weights' salt of that row (``salts[p]``, per token position; 0 for the initial weights).
    Dense layers are all-zero rows, as vLLM returns them.
    """
    T = len(token_ids)
    rows = max(T - 1 - row_start, 0)
    out = np.zeros((rows, num_layers, top_k), dtype=np.uint8 if num_experts <= 256 else np.uint16)
    if rows == 0:
        return out
    hashes = np.array(_prefix_hashes(token_ids)[row_start : T - 1], dtype=np.uint64)
    if salts is not None:
        mixed = [_mix(int(x)) if x else 0 for x in salts[row_start : T - 1]]
        hashes ^= np.array(mixed, dtype=np.uint64)
    ks = np.arange(top_k, dtype=np.uint64)
    for layer in moe_layers:
        salt = np.uint64(_mix(layer + 1))
        base = (hashes ^ salt) % np.uint64(num_experts)
        out[:, layer, :] = (base[:, None] + ks[None, :]) % np.uint64(num_experts)
    return out


def synthetic_weights(routes: np.ndarray, moe_layers: Sequence[int]) -> np.ndarray:
    """The weights the synthetic engine reports for ``routes``: same shape, float32; slot ``j``
    of a MoE row is ``1 + (7 * expert + 3 * j) % 5`` over the row's sum, dense layers 0."""
    slots = np.arange(routes.shape[2], dtype=np.int64)
    raw = (1 + (7 * routes.astype(np.int64) + 3 * slots) % 5).astype(np.float32)
    out = np.zeros(routes.shape, dtype=np.float32)
    moe = list(moe_layers)
    out[:, moe] = raw[:, moe] / raw[:, moe].sum(axis=-1, keepdims=True)
    return out


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)  # type: ignore[union-attr]


def render_chat(
    messages: Sequence[ChatMessageParam], add_generation_prompt: bool, continue_final: bool
) -> str:
    """The synthetic chat template: ``<|role|>content`` lines, then ``<|assistant|>``."""
    parts = [f"<|{m.role}|>{_content_text(m.content)}\n" for m in messages]
    if continue_final and parts:
        parts[-1] = parts[-1][:-1]
    if add_generation_prompt:
        parts.append("<|assistant|>")
    return "".join(parts)


def _check_sampling_ids(r: ChatCompletionRequest | CompletionRequest) -> None:
    """The token ids of sampling fields inside the vocabulary, refused as vLLM's engine
    refuses them (``SamplingParams._validate_*``: the field, the ids, the vocabulary size)."""
    fields = (
        ("logit_bias", [int(k) for k in r.logit_bias or {}], "in logit_bias contain"),
        ("stop_token_ids", r.stop_token_ids or [], "in stop_token_ids contain"),
        ("logprob_token_ids", r.logprob_token_ids or [], "in logprob_token_ids contain"),
    )
    for field, ids, where in fields:
        bad = [t for t in ids if not 0 <= t < _VOCAB]
        if bad:
            raise InvalidRequestError(
                f"token_id(s) {bad} {where} out-of-vocab token ids. Vocabulary size: {_VOCAB}",
                param=field,
            )
    if any(not 0 <= t < _VOCAB for t in r.allowed_token_ids or ()):
        raise InvalidRequestError(
            "allowed_token_ids contains out-of-vocab token id!", param="allowed_token_ids"
        )


class SyntheticBackend(EngineBackend):
    """See the module docstring. ``step_delay_s`` paces decoding (tests of streams and
    disconnects); ``block_size`` is the granularity of reported prefix-cache hits."""

    def __init__(
        self,
        name: str = "synthetic-moe",
        *,
        num_layers: int = 4,
        moe_layers: Sequence[int] = (1, 2, 3),
        num_experts: int = 8,
        top_k: int = 2,
        max_model_len: int = 2048,
        step_delay_s: float = 0.0,
        block_size: int = 16,
        route_weights: RouteWeightsMode = "request",
    ) -> None:
        self.route_weights = route_weights
        self.info = ModelInfo(
            name=name,
            num_layers=num_layers,
            moe_layers=tuple(moe_layers),
            num_experts=num_experts,
            top_k=top_k,
            max_model_len=max_model_len,
            root=name,
            max_token_bytes=4,  # one UTF-8 byte per token: a character is at most 4
        )
        self.step_delay_s = step_delay_s
        self.block_size = block_size
        self.fault: BaseException | None = None
        self._dead = False
        self._started = False
        self._running = 0
        self._cached_blocks: set[tuple[str | None, int]] = set()
        # "Weights": a salt mixed into every route, and the label vLLM calls a weight version.
        self.salt = 0
        self.version = "default"
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._abort_all = False
        self._aborted: set[str] = set()  # client request ids
        self._rl = _SyntheticRL(self)

    @property
    def rl(self) -> RLControl:
        return self._rl

    def set_weights(self, salt: int, version: str | None) -> None:
        """New weights: routes change from the next step on; cached prefixes are dropped."""
        self.salt = salt
        if version is not None:
            self.version = version
        self._cached_blocks.clear()

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        self._started = False

    @property
    def dead(self) -> bool:
        return self._dead

    def kill(self) -> None:
        """The engine dies for good, as vLLM's does after an ``EngineDeadError``."""
        self._dead = True

    async def check_ready(self) -> None:
        if not self._started:
            raise EngineUnavailableError("engine not started", code="engine_not_started")
        if self._dead:
            raise EngineUnavailableError("engine is dead", code="engine_dead")

    def num_unfinished(self) -> int:
        return self._running

    # -- tokenizer ---------------------------------------------------------------------------------
    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _chat_ids(self, r: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
        if r.chat_template_kwargs:
            raise InvalidRequestError(
                "chat_template_kwargs: the synthetic chat template takes no arguments",
                param="chat_template_kwargs",
            )
        return self.encode(
            render_chat(r.messages, r.add_generation_prompt, r.continue_final_message)
        )

    async def tokenize(
        self, req: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        ids = (
            self._chat_ids(req) if isinstance(req, TokenizeChatRequest) else self.encode(req.prompt)
        )
        strs = None
        if req.return_token_strs:
            strs = [chr(t) if 32 <= t < 127 else f"<0x{t:02X}>" for t in ids]
        return TokenizeResponse(
            count=len(ids), max_model_len=self.info.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, req: DetokenizeRequest) -> str:
        self._check_vocab(req.tokens, "tokens")
        return bytes(req.tokens).decode("utf-8", errors="replace")

    @staticmethod
    def _check_vocab(ids: Sequence[int], field: str) -> None:
        for i, t in enumerate(ids):
            if t >= _VOCAB:
                raise InvalidRequestError(
                    f"{field}[{i}]: token id {t} is outside the vocabulary of {_VOCAB}",
                    param=field,
                )

    # -- generation --------------------------------------------------------------------------------
    def generate_chat(
        self, req: GenerationRequest[ChatCompletionRequest]
    ) -> AsyncIterator[EngineEvent]:
        return self._generate(req, lambda: self._chat_ids(req.request), "messages")

    def generate_completion(
        self, req: GenerationRequest[CompletionRequest]
    ) -> AsyncIterator[EngineEvent]:
        def ids() -> list[int]:
            p = req.request.prompt
            if isinstance(p, str):
                return self.encode(p)
            self._check_vocab(p, "prompt")
            return list(p)

        return self._generate(req, ids, "prompt")

    def _cached_tokens(self, hashes: list[int], salt: str | None) -> int:
        """Whole leading blocks seen before under the same ``cache_salt`` (then remember this
        prompt's blocks)."""
        b = self.block_size
        keys = [(salt, hashes[end - 1]) for end in range(b, len(hashes) + 1, b)]
        cached = 0
        for i, key in enumerate(keys):
            if key not in self._cached_blocks:
                break
            cached = (i + 1) * b
        self._cached_blocks.update(keys)
        return cached

    async def _generate(
        self, req: GenerationRequest, render, field: str
    ) -> AsyncIterator[EngineEvent]:  # type: ignore[no-untyped-def]
        r = req.request
        if self._dead:
            raise EngineUnavailableError("engine is dead", code="engine_dead")
        check_engine_fields(r)
        _check_sampling_ids(r)
        weights = wants_route_weights(r, self.route_weights)
        rendered = render()
        prompt = truncate_prompt(rendered, r, self.info.max_model_len)
        max_tokens = self._max_tokens(r, prompt, field)
        greedy, seed = _sampling_seed(r)
        stop_ids = set(r.stop_token_ids or ())
        yield self._rendered(r, prompt, rendered)
        # Paused: not scheduled until resumed (vLLM's semantics for new requests).
        await self._resumed.wait()
        hashes = _prefix_hashes(prompt)
        cached = self._cached_tokens(hashes, r.cache_salt)

        self._running += 1
        try:
            outs: list[list[int]] = [[] for _ in range(r.n)]
            # Per choice: the salt that routed each row, and the version of each output token.
            salts: list[list[int]] = [[] for _ in range(r.n)]
            versions: list[list[str]] = [[] for _ in range(r.n)]
            h = [hashes[-1]] * r.n
            finished: list[str | None] = [None] * r.n
            for step in range(max_tokens):
                await asyncio.sleep(self.step_delay_s)
                await self._resumed.wait()  # pause(mode="keep") freezes running requests here
                if self._dead:
                    raise EngineUnavailableError(
                        "the engine died while serving this request; routes were not stored",
                        code="engine_dead",
                    )
                if self.fault is not None:
                    raise self.fault
                aborted = self._abort_all or req.request_id in self._aborted
                for i in range(r.n):
                    if finished[i] is not None:
                        continue
                    if aborted:
                        finished[i] = "abort"
                        yield await self._finished(
                            i, prompt, outs[i], "abort", cached, r, salts[i], versions[i], weights
                        )
                        continue
                    # This step's forward routes the prompt (step 0) or the previous token.
                    salts[i].extend([self.salt] * (len(prompt) if step == 0 else 1))
                    versions[i].append(self.version)
                    x = _mix(h[i] ^ _mix(seed + (0 if greedy else i)))
                    tok = 32 + x % 95  # printable ASCII: every token is one character
                    h[i] = _mix(h[i] ^ (tok + 1))
                    outs[i].append(tok)
                    if tok in stop_ids and len(outs[i]) >= r.min_tokens:
                        finished[i] = "stop"
                    elif len(outs[i]) == max_tokens:
                        finished[i] = "length"
                    yield ChoiceDelta(
                        index=i,
                        text=chr(tok),
                        token_ids=[tok],
                        logprobs=self._logprobs(tok, x, r),
                        last=finished[i] is not None,
                    )
                    if finished[i] is not None:
                        yield await self._finished(
                            i, prompt, outs[i], finished[i], cached, r, salts[i], versions[i],
                            weights,
                        )  # fmt: skip
                if all(f is not None for f in finished):
                    break
        finally:
            self._running -= 1
            self._aborted.discard(req.request_id)

    def _max_tokens(
        self, r: ChatCompletionRequest | CompletionRequest, prompt: list[int], field: str
    ) -> int:
        """The tokens ``r`` may generate after ``prompt`` (its own max tokens, else the rest of
        the context); refuses a prompt or a max tokens past the context, and a routed-experts
        start past the prompt. ``field``: the request field the prompt came from."""
        info = self.info
        if len(prompt) >= info.max_model_len:
            raise InvalidRequestError(
                f"{field} has {len(prompt)} tokens; the model's context is "
                f"{info.max_model_len} tokens",
                param=field,
            )
        room = info.max_model_len - len(prompt)
        max_tokens = r.requested_max_tokens or room
        if max_tokens > room:
            f = r.max_tokens_field
            raise InvalidRequestError(
                f"{f}={max_tokens} plus the prompt's {len(prompt)} tokens exceeds the model's "
                f"context of {info.max_model_len} tokens (at most {room} allowed)",
                param=f,
            )
        if r.routed_experts_prompt_start > len(prompt):
            raise InvalidRequestError(
                f"routed_experts_prompt_start={r.routed_experts_prompt_start} is beyond the "
                f"prompt's {len(prompt)} tokens",
                param="routed_experts_prompt_start",
            )
        return max_tokens

    async def _finished(
        self,
        i: int,
        prompt: list[int],
        out: list[int],
        reason: str,
        cached: int,
        r: ChatCompletionRequest | CompletionRequest,
        salts: list[int],
        versions: list[str],
        weights: bool,
    ) -> ChoiceFinished:
        info = self.info
        T = len(prompt) + len(out)
        args = (prompt + out, info.num_layers, info.moe_layers, info.num_experts, info.top_k,
                r.routed_experts_prompt_start, salts + [self.salt] * (T - len(salts)))  # fmt: skip
        # A real engine's arrays are computed in its own process: a long route's are computed
        # off the event loop here, so the service's loop does only what it does with vLLM.
        big = T * info.num_layers * info.top_k > 1 << 18
        routes = (
            await asyncio.to_thread(synthetic_routes, *args) if big else synthetic_routes(*args)
        )
        w = None
        if weights:
            w = await asyncio.to_thread(synthetic_weights, routes, info.moe_layers) if big else (
                synthetic_weights(routes, info.moe_layers))  # fmt: skip
        # vLLM's shape: spans of output tokens sampled by one version.
        spans: list[tuple[str, int, int]] = []
        for j, v in enumerate(versions):
            if spans and spans[-1][0] == v:
                spans[-1] = (v, spans[-1][1], j + 1)
            else:
                spans.append((v, j, j + 1))
        return ChoiceFinished(
            index=i,
            finish_reason=reason,
            stop_reason=out[-1] if reason == "stop" else None,
            output_token_ids=list(out),
            num_cached_tokens=cached,
            routed_experts=routes,
            routes_row_start=r.routed_experts_prompt_start,
            weight_versions=spans,
            routed_weights=w,
            weights_dtype="float32" if weights else None,
        )

    @staticmethod
    def _logprobs(tok: int, x: int, r: ChatCompletionRequest | CompletionRequest
                  ) -> list[TokenLogprob] | None:  # fmt: skip
        """The sampled token first, then the top k (or the ``logprob_token_ids``), as vLLM."""
        k = r.num_logprobs
        if k is None:
            return None
        lp = -((x >> 8) % 1000) / 1000.0 - 0.01
        alt = r.logprob_token_ids or [32 + (tok - 32 + j) % 95 for j in range(1, k)]
        top = [(token_text(tok, chr(tok), r), lp)] + [
            (token_text(t, chr(t), r), lp - 1 - j) for j, t in enumerate(alt) if t != tok
        ]
        return [TokenLogprob(token=token_text(tok, chr(tok), r), logprob=lp, top=top)]

    def _rendered(
        self, r: ChatCompletionRequest | CompletionRequest, prompt: list[int], rendered: list[int]
    ) -> PromptRendered:
        plp = self._prompt_logprobs(prompt, r)
        echoed = None
        if plp is not None and r.echo and r.num_logprobs is not None:
            echoed = echo_logprobs(prompt, plp, chr(prompt[0]), r)
        return PromptRendered(
            prompt_token_ids=list(prompt),
            prompt_text=self._prompt_text(r, prompt, rendered),
            prompt_logprobs=plp,
            echo_logprobs=echoed,
        )

    @staticmethod
    def _prompt_text(
        r: ChatCompletionRequest | CompletionRequest, prompt: list[int], rendered: list[int]
    ) -> str | None:
        if not (isinstance(r, CompletionRequest) and r.echo):
            return None
        if isinstance(r.prompt, str) and prompt == rendered:
            return r.prompt
        return bytes(prompt).decode("utf-8", errors="replace")

    @staticmethod
    def _prompt_logprobs(
        prompt: list[int], r: ChatCompletionRequest | CompletionRequest
    ) -> PromptLogprobs | None:
        """Deterministic per prefix: each token's own logprob, then its top k (rank 1 up)."""
        k = r.num_prompt_logprobs
        if k is None:
            return None
        out: PromptLogprobs = [None]
        hashes = _prefix_hashes(prompt)
        for j in range(1, len(prompt)):
            x = _mix(hashes[j - 1])
            own = -((x >> 8) % 1000) / 1000.0 - 0.01
            pos = {prompt[j]: Logprob(own, 1 + x % 7, chr(prompt[j]))}
            for rank in range(1, k + 1):
                t = (x + rank) % _VOCAB
                pos.setdefault(t, Logprob(-rank / 4.0, rank, chr(t)))
            out.append(pos)
        return out


class _SyntheticRL(RLControl):
    """vLLM's RL API on the synthetic engine. Its "weights" are a salt mixed into every route:
    :meth:`reload_weights` reads it from ``<dir>/synthetic.json`` (``{"salt": int}``)."""

    def __init__(self, engine: SyntheticBackend) -> None:
        self.e = engine

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        e = self.e
        if mode == "wait":
            e._resumed.clear()  # new requests wait; running ones finish
            while e._running:
                await asyncio.sleep(0.005)
        elif mode == "abort":
            e._abort_all = True
            while e._running:
                await asyncio.sleep(0.005)
            e._abort_all = False
            e._resumed.clear()
        else:
            e._resumed.clear()
        if clear_cache and mode != "keep":
            e._cached_blocks.clear()

    async def resume(self) -> None:
        self.e._resumed.set()

    async def is_paused(self) -> bool:
        return not self.e._resumed.is_set()

    async def abort_requests(self, request_ids: list[str] | None) -> int:
        if request_ids:
            self.e._aborted.update(request_ids)
            return len(request_ids)
        n = self.e._running
        self.e._abort_all = True
        while self.e._running:
            await asyncio.sleep(0.005)
        self.e._abort_all = False
        return n

    def _no_transfer(self) -> NotImplementedError:
        return NotImplementedError(
            "the synthetic engine has no tensors to transfer: load new weights with /reload_weights"
        )

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        raise self._no_transfer()

    async def shutdown_weight_transfer_engine(self) -> None:
        raise self._no_transfer()

    async def start_weight_update(self) -> None:
        raise self._no_transfer()

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        raise self._no_transfer()

    async def finish_weight_update(self, weight_version: str | None) -> None:
        self.e.set_weights(self.e.salt, weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        self.e.version = new_version

    async def weight_version(self) -> str:
        return self.e.version

    async def reload_weights(
        self, checkpoint: Path, weight_version: str | None, root: Path
    ) -> None:
        path = checkpoint / "synthetic.json"
        try:
            salt = int(json.loads(path.read_text())["salt"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"weights_path: no readable {path} with an integer salt") from exc
        self.e.set_weights(salt, weight_version)

    async def world_size(self, include_dp: bool) -> int:
        return 1


def _sampling_seed(r: ChatCompletionRequest | CompletionRequest) -> tuple[bool, int]:
    """Whether ``r`` samples greedily, and the seed its choices derive from (vLLM refuses
    ``n > 1`` with greedy sampling: every choice would be the same)."""
    if r.temperature != 0:
        return False, r.seed if r.seed is not None else random.getrandbits(63)
    if r.n > 1:
        raise InvalidRequestError(f"n must be 1 when using greedy sampling, got n={r.n}", param="n")
    return True, 0
