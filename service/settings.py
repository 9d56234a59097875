"""Service settings: command-line flags and ``ROUTEREPLAY_*`` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]


class Settings(BaseSettings):
    """Everything ``create_app`` needs. Flags override environment, environment overrides defaults.

    ``ROUTEREPLAY_MODEL`` unset means the embedded default: the tiny Qwen3-MoE model built (once)
    under ``model_dir``. ``ROUTEREPLAY_REDIS_URL`` unset means a private redis-server started by
    the service.
    """

    model_config = SettingsConfigDict(env_prefix="ROUTEREPLAY_", extra="ignore")

    # -- HTTP --------------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"

    # -- engine ------------------------------------------------------------------------------------
    backend: Literal["vllm", "upstream"] = "vllm"
    model: str | None = Field(None, description="model path (or hub name on a host that has it)")
    served_model_name: str | None = Field(None, description="name clients send; default: model")
    tiny_variant: Literal["moe", "dense-first"] = "moe"
    model_dir: Path | None = Field(None, description="cache of built tiny models")
    upstream_url: str | None = Field(None, description="vLLM server, e.g. http://host:8000")
    upstream_timeout_s: float = 600.0
    dtype: str = "auto"
    max_model_len: int = 2048
    seed: int = 0
    gpu_memory_utilization: float | None = Field(None, description="default 0.5 on CPU, 0.9 GPU")
    enforce_eager: bool | None = Field(
        None, description="default: on for CPU, off (CUDA graphs) GPU"
    )
    tensor_parallel_size: int = 1
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="extra vLLM AsyncEngineArgs, as JSON"
    )

    # -- routes ------------------------------------------------------------------------------------
    redis_url: str | None = None
    local_redis_maxmemory: str = Field(
        "2gb", description="memory cap of the private redis-server started without --redis-url"
    )
    route_prefix: str = "rr"
    route_ttl_s: int = 86400
    block_size: int = 128
    store_timeout_s: float = 30.0
    # Records larger than this (T*M*K bytes) are built in a worker thread, off the event loop.
    offload_bytes: int = 1 << 18
    max_batch_ids: int = 1024

    def resolved_model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return self.model
        return f"tiny-qwen3-moe-{self.tiny_variant}"
