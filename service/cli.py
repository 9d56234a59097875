"""``routereplay serve`` and ``routereplay build-model``.

Every :class:`~.settings.Settings` field is a flag (``--upstream-url``, ``--redis-url`` ...),
built by pydantic-settings' CLI support; flags override ``ROUTEREPLAY_*`` environment
variables, which override defaults. A bad value is a usage error naming the flag (exit 2), and
the listening port is bound before the engine starts, so a port in use fails at once rather
than after the engine's start-up.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import CliApp, SettingsError

from .settings import Settings

__all__ = [
    "ENGINE_DEAD_EXIT",
    "bind_socket",
    "build_model_main",
    "serve_main",
    "settings_from_argv",
]


# Exit status after the engine died (distinct from usage errors, 2, and crashes, 1).
ENGINE_DEAD_EXIT = 3


class UsageError(Exception):
    """A command-line mistake: printed as ``routereplay serve: error: ...``, exit status 2."""


def settings_from_argv(argv: list[str]) -> Settings:
    """Settings from flags layered over the environment; :class:`UsageError` names a bad flag."""
    try:
        return CliApp.run(Settings, cli_args=argv, cli_exit_on_error=True)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            flag = "--" + "-".join(str(p) for p in err["loc"][:1]).replace("_", "-")
            got = err.get("input")
            problems.append(f"{flag}: {err['msg']} (got {got!r})")
        raise UsageError("; ".join(problems)) from None
    except SettingsError as e:
        raise UsageError(str(e)) from None


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (as uvicorn would bind it); UsageError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"--port: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve_main(argv: list[str]) -> int:
    try:
        settings = settings_from_argv(argv)
        sock = bind_socket(settings.host, settings.port)
    except UsageError as e:
        print(f"routereplay serve: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from .app import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(reason: str) -> None:
        # A dead engine never comes back: stop (gracefully) and exit non-zero, so the
        # supervisor (compose restart policy, Kubernetes) starts a fresh process.
        fatal.append(reason)
        if server is not None:
            server.should_exit = True

    try:
        app = create_app(settings, on_fatal=on_fatal)
    except (ValueError, OSError) as e:  # an unreadable key file, a malformed or short key
        print(f"routereplay serve: error: {e}", file=sys.stderr)
        return 2
    if not app.state.keys.enabled and settings.host not in ("127.0.0.1", "::1", "localhost"):
        logging.getLogger("routereplay.service").warning(
            "listening on %s without API keys: anyone who reaches it can read and delete "
            "routes (set --api-keys-file)",
            settings.host,
        )
    config = uvicorn.Config(
        app, log_level=settings.log_level, timeout_graceful_shutdown=10,
        # One worker: the engine lives in this process; vLLM scales inside it.
        workers=1,
    )  # fmt: skip
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    if fatal:
        logging.getLogger("routereplay.service").critical("exiting with status 3: %s", fatal[0])
        return ENGINE_DEAD_EXIT
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
