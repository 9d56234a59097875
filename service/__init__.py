"""The OpenAI-compatible capture service: ``create_app(Settings(...))``, ``routereplay serve``.

Names are resolved lazily: Triton imports ``routereplay.service.vllm_patches.triton_cpu`` in
every vLLM process on a CPU host, and that must not drag in FastAPI or the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .settings import Settings

__all__ = ["Settings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "Settings":
        from .settings import Settings

        return Settings
    raise AttributeError(f"module 'routereplay.service' has no attribute {name!r}")
