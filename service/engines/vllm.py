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
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from ..admission import Admission, Ticket, cache_salt
from ..engine import (
    ChoiceDelta,
    ChoiceFinished,
    EngineBackend,
    EngineEvent,
    GenerationRequest,
    Logprob,
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
from ..errors import EngineUnavailableError, InvalidRequestError, ServiceError, StartupRefused
from ..metrics import VllmEngineMetrics
from ..model_info import ModelInfo, moe_layout
from ..protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from .vllm_host import ENGINE_SHUTDOWN_TIMEOUT_S, engine_env, on_cpu_host
from .vllm_release import VllmRelease, check_release, probe
from .vllm_rl import VllmRL
from .vllm_tools import ToolCalling, ToolPlan

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["VllmBackend"]

log = logging.getLogger("routereplay.service")

T = TypeVar("T")

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
    from vllm.exceptions import GenerationError, VLLMClientError
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
    if _is_retryable(e):
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


def _is_retryable(e: BaseException) -> bool:
    """vLLM's RetryableRequestError (0.32+; older releases have no such error)."""
    import vllm.exceptions

    retryable = getattr(vllm.exceptions, "RetryableRequestError", None)
    return retryable is not None and isinstance(e, retryable)


def _check_cpu_layout(args: Any) -> None:
    """Refuse the layouts vLLM's CPU workers start but cannot serve (the first request would
    end the engine): data parallel MoE dispatches tokens across DP ranks with ``all_gatherv``,
    which the CPU communicator lacks, and the CPU fused-MoE kernel faults (SIGSEGV) on a rank
    holding a part of the experts."""
    if getattr(args, "data_parallel_size", 1) > 1:
        raise StartupRefused(
            f"data_parallel_size={args.data_parallel_size} on a CPU host: vLLM's CPU "
            "communicator has no all_gatherv, which a MoE model's data-parallel dispatch "
            "needs; serve data parallel on GPUs (tensor parallel serves on CPU)"
        )
    if getattr(args, "enable_expert_parallel", False):
        raise StartupRefused(
            "enable_expert_parallel on a CPU host: vLLM's CPU fused-MoE kernel faults on a "
            "rank that holds a part of the experts; serve expert parallel on GPUs (tensor "
            "parallel serves on CPU)"
        )


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
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        offload_bytes: int = 1 << 18,
    ) -> None:
        self.model = model
        # Engine arrays past this size are split in a worker thread, off the event loop every
        # stream shares (the capture's --offload-bytes).
        self._offload_bytes = offload_bytes
        self._tool_flags = (tool_call_parser, enable_auto_tool_choice)
        self.tools: ToolCalling | None = None
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
        self._rl = VllmRL(self)
        self.release: VllmRelease | None = None  # the installed vLLM, probed at start
        # (epoch, engine weight version), moved by each RL call that may relabel the weights;
        # read only where the engine's outputs carry no weight-version spans (_whole_span).
        self._label: tuple[int, str | None] = (0, None)

    @property
    def rl(self) -> RLControl:
        return self._rl

    async def start(self) -> None:
        cpu = on_cpu_host()
        for k, v in engine_env(cpu).items():
            # Set before the engine core starts: its processes inherit this environment.
            os.environ.setdefault(k, v)
        if cpu:
            from ..vllm_patches.cpu_setup import is_installed, set_omp_threads_bind

            if not is_installed():
                raise StartupRefused(
                    "vLLM on CPU needs the Triton cpu hook for routed experts: run `python -m "
                    "routereplay.service.vllm_patches.cpu_setup` once in this environment"
                )
        self.tools = ToolCalling(*self._tool_flags)
        self.release = probe()
        check_release(self.release)
        log.info("%s", self.release.features())
        args = self.engine_args(cpu)
        if cpu:
            _check_cpu_layout(args)
            try:
                set_omp_threads_bind(self._cpu_bind, args.tensor_parallel_size)
            except ValueError as e:
                raise StartupRefused(f"--cpu-bind {self._cpu_bind}: {e}") from e
        self._check_plugins(cpu)
        from vllm.v1.engine.async_llm import AsyncLLM

        from ..ctrl_c import sigint_blocked

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
        self.tools.start(self._tokenizer, self.engine.model_config)
        await self.relabel()
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
        from ..vllm_patches.plugins import CAPTURE_PLUGIN, CPU_SAMPLING_PLUGIN, PluginMissing
        from ..vllm_patches.plugins import check_installed as check_plugins_installed
        from ..vllm_patches.route_weights import ENV, RouteWeightsUnsupported, check_supported

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
        from ..vllm_patches.plugins import PluginMissing, ask_workers

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

    @property
    def vllm_version(self) -> str | None:
        return None if self.release is None else self.release.version

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
        self, r: ChatCompletionRequest | CompletionRequest, prompt_len: int, tools: Any = None
    ) -> Any:
        """vLLM's SamplingParams of ``r``; ``tools``: the structured output a tool choice
        implies, which replaces the request's own (as vLLM)."""
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
        logprobs = r.num_logprobs
        if r.logprob_token_ids:
            kw["logprob_token_ids"] = self._logprob_token_ids(r.logprob_token_ids)
            logprobs = None  # as vLLM: the ids replace the top k
        if r.logit_bias is not None:
            # JSON object keys are strings; SamplingParams validates int token ids.
            kw["logit_bias"] = {int(t): b for t, b in r.logit_bias.items()}
        try:
            constraint = r.structured_output()
            if tools is not None:
                kw["structured_outputs"] = tools
            elif constraint is not None:
                from vllm.sampling_params import StructuredOutputsParams

                kw["structured_outputs"] = StructuredOutputsParams(**constraint)
            return SamplingParams(
                n=r.n,
                max_tokens=max_tokens,
                min_tokens=r.min_tokens,
                ignore_eos=r.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=r.num_prompt_logprobs,
                routed_experts_prompt_start=r.routed_experts_prompt_start,
                # DELTA: each message carries only new tokens, so streaming costs O(new) per step.
                output_kind=RequestOutputKind.DELTA,
                **kw,
            )
        except (VLLMClientError, ValueError) as e:
            raise _client_error(e, r) from e

    def _logprob_token_ids(self, ids: list[int]) -> list[int]:
        if self.release is not None and not self.release.logprob_token_ids:
            raise InvalidRequestError(
                f"logprob_token_ids: vLLM {self.release.version} has no logprob_token_ids "
                "(SamplingParams.logprob_token_ids)",
                param="logprob_token_ids",
                code="unsupported",
            )
        vocab = len(self._tokenizer)
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"logprob_token_ids: {bad[:8]} outside the vocabulary of {vocab}",
                param="logprob_token_ids",
            )
        return list(ids)

    @staticmethod
    def _chat_params(
        messages: list[Any],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[dict[str, Any]], Any]:
        from vllm.renderers.params import ChatParams

        # As vLLM: the tools reach the template unless the request's own kwargs name them.
        kwargs = {"tools": tools} if tools else {}
        kwargs.update(template_kwargs or {})
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

        async def render() -> Any:
            conversation, params = self._chat_params(
                r.messages, r.add_generation_prompt, r.continue_final_message,
                r.chat_template_kwargs, plan.tool_dicts if plan else None,
            )  # fmt: skip
            # No context limit here: the length check below names the field and the numbers.
            _, prompts = await self.engine.renderer.render_chat_async(
                [conversation], params, self._tok_params(r.add_special_tokens, None)
            )
            return prompts[0]

        plan: ToolPlan | None = None

        def planned() -> ToolPlan | None:
            nonlocal plan
            self._check_alive()
            plan = self.tools.plan(r) if self.tools is not None else None
            return plan

        return self._generate(req, render, "messages", planned)

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
        self, req: GenerationRequest, render: Any, field: str, tools: Any = None
    ) -> AsyncIterator[EngineEvent]:
        self._check_alive()
        check_engine_fields(req.request, structured=True)
        plan: ToolPlan | None = tools() if tools is not None else None
        prompt = await self._render(render(), field)
        prompt_ids = list(prompt["prompt_token_ids"])
        cut = truncate_prompt(prompt_ids, req.request, self.info.max_model_len)
        if len(cut) != len(prompt_ids):
            # The text no longer matches the ids: the engine gets the ids alone.
            prompt = {k: v for k, v in prompt.items() if k != "prompt"}
            prompt["prompt_token_ids"] = prompt_ids = cut
        if len(prompt_ids) >= self.info.max_model_len:
            raise InvalidRequestError(
                f"{field} has {len(prompt_ids)} tokens; the model's context is "
                f"{self.info.max_model_len} tokens",
                param=field,
            )
        constraint = plan.structured_outputs if plan is not None else None
        params = self._sampling_params(req.request, len(prompt_ids), constraint)
        weights = wants_route_weights(req.request, self.route_weights)
        run = self._run(req, prompt, prompt_ids, params, weights, plan)
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
        plan: ToolPlan | None = None,
    ) -> AsyncIterator[EngineEvent]:
        ticket, outputs, first = await self._submit(req, prompt, params)
        label = self._label
        try:
            rendered = self._rendered(req.request, prompt, prompt_ids, first.prompt_logprobs)
            if plan is not None:
                rendered.choice_parser = partial(plan.choice_parser, prompt_ids)
            yield rendered
            spans = partial(self._whole_span, ticket, label)
            events = self._events(req.request, params, weights, _chain(first, outputs), spans)
            async for ev in events:
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
        if _is_retryable(e) and self.admission.held:
            return None
        mapped = _engine_error(e, request, started=False)
        if mapped is None:
            raise e
        raise mapped from e

    def _whole_span(
        self, ticket: Ticket, label: tuple[int, str | None], n_out: int
    ) -> list[tuple[str, int, int]] | None:
        """For a vLLM whose outputs carry no weight-version spans: the whole output under the
        version the engine had when the request started, if neither the weights (the
        generation) nor the version label changed before it finished; None (unknown) else."""
        epoch, version = label
        if version is None or self._label[0] != epoch:
            return None
        if ticket.generation != self.admission.generation:
            return None
        return [(version, 0, n_out)]

    async def relabel(self) -> None:
        """Read the engine's weight version again after an RL call that may have changed it,
        with generation stopped (only where outputs carry no spans: :meth:`_whole_span`)."""
        if self.release is not None and not self.release.weight_versions:
            self._label = (self._label[0] + 1, str(await self.engine.get_weight_version()))

    def _rendered(self, r: Any, prompt: Any, ids: list[int], plp: Any) -> PromptRendered:
        logprobs = self._prompt_logprobs(plp, r)
        echoed = None
        if logprobs is not None and r.echo and r.num_logprobs is not None:
            echoed = echo_logprobs(ids, logprobs, self._tokenizer.decode([ids[0]]), r)
        return PromptRendered(
            prompt_token_ids=ids,
            prompt_text=self._prompt_text(r, prompt, ids),
            prompt_logprobs=logprobs,
            echo_logprobs=echoed,
        )

    def _prompt_text(self, r: Any, prompt: Any, prompt_ids: list[int]) -> str | None:
        """The prompt's text, for ``echo`` (vLLM's: the text sent, else the ids decoded)."""
        if not (isinstance(r, CompletionRequest) and r.echo):
            return None  # chat echoes the last message (the serving layer)
        text = prompt.get("prompt")
        return text if isinstance(text, str) else self._tokenizer.decode(prompt_ids)

    def _prompt_logprobs(self, plp: Any, r: Any) -> PromptLogprobs | None:
        if plp is None or r.num_prompt_logprobs is None:
            return None
        return [
            None
            if pos is None
            else {
                int(t): Logprob(_finite(lp.logprob), lp.rank, lp.decoded_token)
                for t, lp in pos.items()
            }
            for pos in plp
        ]

    async def _events(
        self,
        request: Any,
        params: Any,
        weights: bool,
        outputs: AsyncIterator[Any],
        whole: Callable[[int], list[tuple[str, int, int]] | None],
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
                        logprobs=self._logprobs(o, request),
                        last=o.finish_reason is not None,
                    )
                if o.finish_reason is None:
                    continue
                if o.routed_experts is None and not out.finished:
                    pending[i] = o
                    continue
                done.add(i)
                pending.pop(i, None)
                fin = self._finished(o, out_ids[i], out.num_cached_tokens, row_start, whole)
                yield await self._split_weights(fin, weights)
            if out.finished:
                for i, o in list(pending.items()):
                    done.add(i)
                    fin = self._finished(o, out_ids[i], out.num_cached_tokens, row_start, whole)
                    yield await self._split_weights(fin, weights)
                pending.clear()

    async def _split_weights(self, fin: ChoiceFinished, wanted: bool) -> ChoiceFinished:
        """With the capture on, the engine's rows carry ids and weights: vLLM's ids for every
        request, the weights only for requests that asked. The start-up check refused workers
        without the capture, so rows in any other layout fail the route, naming the layout."""
        if self.route_weights == "off" or fin.routed_experts is None:
            return fin
        from ..vllm_patches.route_weights import split_routes

        args = (fin.routed_experts, self.info.top_k, self.info.num_experts, wanted)
        try:
            big = fin.routed_experts.nbytes > self._offload_bytes
            ids, w = await asyncio.to_thread(split_routes, *args) if big else split_routes(*args)
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
        o: Any,
        out_ids: list[int],
        num_cached: int | None,
        row_start: int,
        whole: Callable[[int], list[tuple[str, int, int]] | None],
    ) -> ChoiceFinished:
        re = o.routed_experts
        if hasattr(o, "weight_versions"):
            spans = o.weight_versions
            spans = None if spans is None else [(s.version, s.start, s.end) for s in spans]
        else:  # vLLM before 0.32: the service's own knowledge (_whole_span)
            spans = whole(len(out_ids))
        return ChoiceFinished(
            index=o.index,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            output_token_ids=out_ids,
            num_cached_tokens=int(num_cached or 0),
            routed_experts=re,
            routes_row_start=row_start,
            routes_error=None if re is not None else "the engine returned no routed experts",
            weight_versions=spans,
        )

    def _logprobs(self, o: Any, r: Any) -> list[TokenLogprob] | None:
        if r.num_logprobs is None or not o.logprobs:
            return None
        # vLLM's candidates per position: the sampled token, then the top k by rank (one entry
        # when the sampled token is among them) or the logprob_token_ids, in that order; the
        # serving layer shows what vLLM's server shows of them (TokenLogprob).
        res = []
        for tok, pos in zip(o.token_ids, o.logprobs, strict=False):
            chosen = pos.get(tok)
            res.append(
                TokenLogprob(
                    token=self._text(tok, chosen, r),
                    logprob=_finite(chosen.logprob if chosen is not None else None),
                    top=[(self._text(t, lp, r), _finite(lp.logprob)) for t, lp in pos.items()],
                )
            )
        return res

    def _text(self, token_id: int, lp: Any, r: Any = None) -> str:
        if r is not None and r.return_tokens_as_token_ids:
            return token_text(token_id, "", r)
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self._tokenizer is not None:
            return self._tokenizer.decode([token_id])
        return f"token_id:{token_id}"
