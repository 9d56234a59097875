"""Command lines of the servers the service tests start (see routereplay.bench.servers)."""

from __future__ import annotations

import sys

from routereplay.bench.servers import engine_env, server_process, stop_process
from routereplay.local_redis import free_port

__all__ = [
    "engine_env", "free_port", "process", "serve_argv", "stop", "vllm_serve_argv",
]  # fmt: skip

process = server_process
stop = stop_process


def serve_argv(*flags: str) -> list[str]:
    return [sys.executable, "-m", "routereplay.cli", "serve", *flags]


def vllm_serve_argv(model: str, port: int, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "2048", "--enforce-eager", "--gpu-memory-utilization", "0.5",
        "--seed", "0", "--enable-return-routed-experts", "--enable-prefix-caching", *flags,
    ]  # fmt: skip
