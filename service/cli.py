"""``routereplay serve`` and ``routereplay build-model``.

Every :class:`~.settings.Settings` field is a flag (``--upstream-url``, ``--redis-url`` ...),
built by pydantic-settings' CLI support; flags override ``ROUTEREPLAY_*`` environment
variables, which override defaults. A bad value is a usage error naming the flag (exit 2), and
the listening port is bound before the engine starts, so a port in use fails at once rather
than after the engine's start-up.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any, get_args

from pydantic import SecretStr, ValidationError
from pydantic_settings import CliApp, SettingsError

from .env_settings import DICT_FORM, LIST_FORM, container_of
from .settings import Settings, unknown_variables

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
    """Settings from flags layered over the environment; :class:`UsageError` names a bad flag
    or ``ROUTEREPLAY_*`` variable and, for a list or dict, the forms it takes; a
    ``ROUTEREPLAY_*`` variable that is no setting is one too."""
    unknown = unknown_variables(os.environ)
    if unknown:
        raise UsageError(
            "; ".join(unknown) + ": a setting's variable is its flag in capitals "
            "(--redis-url: ROUTEREPLAY_REDIS_URL)"
        )
    try:
        return CliApp.run(Settings, cli_args=argv, cli_exit_on_error=True)
    except ValidationError as e:
        raise UsageError("; ".join(_problem(err, argv) for err in e.errors())) from None
    except SettingsError as e:
        raise UsageError(_settings_error(str(e))) from None


def _settings_error(msg: str) -> str:
    # pydantic-settings' CLI parses list and dict flags itself and names the field, not the flag.
    m = re.fullmatch(r"Parsing error encountered for (\w+): (.*)", msg, re.S)
    if m is None or m.group(1) not in Settings.model_fields:
        return msg
    form = {list: LIST_FORM, dict: DICT_FORM}.get(container_of(Settings.model_fields[m.group(1)]))
    flag = "--" + m.group(1).replace("_", "-")
    return f"{flag}: {m.group(2)}" + (f"; expected {form}" if form else "")


def _source(field: str, argv: list[str]) -> str:
    """The flag, or the variable when the value came from the environment (flags win)."""
    flag = "--" + field.replace("_", "-")
    if any(a == flag or a.startswith(flag + "=") for a in argv):
        return flag
    variable = f"ROUTEREPLAY_{field.upper()}"
    # pydantic-settings reads the environment case-insensitively.
    return variable if any(k.upper() == variable for k in os.environ) else flag


def _problem(err: Any, argv: list[str]) -> str:
    field, *rest = err["loc"]
    where = _source(str(field), argv)
    if rest and isinstance(rest[0], int):
        where += f" item {rest[0] + 1}"
    # A value error's own message, without pydantic's "Value error, " in front.
    msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
    info = Settings.model_fields[str(field)]
    if SecretStr not in (info.annotation, *get_args(info.annotation), *_item_types(info)):
        msg += f" (got {err.get('input')!r})"
    form = {list: LIST_FORM, dict: DICT_FORM}.get(container_of(info))
    if rest and err["type"] == "value_error":
        form = None  # an item of the right form and type whose value is wrong says so itself
    return f"{where}: {msg}" + (f"; expected {form}" if form else "")


def _item_types(info: Any) -> tuple[Any, ...]:
    # list[Annotated[SecretStr, ...]]: the item type under its annotations.
    return tuple(get_args(a)[0] if get_args(a) else a for a in get_args(info.annotation))


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


class _StopSignals:
    """SIGINT and SIGTERM for ``routereplay serve``: stopping on either is a success (status 0).

    While uvicorn serves, it handles both (drain, then the lifespan stops the engine) and, once
    stopped, raises the signal again into the handler it found, to "trigger the expected
    behaviour": with Python's defaults a clean stop would end in a KeyboardInterrupt traceback
    (SIGINT) or a death by signal (SIGTERM, status 143). This handler takes that second delivery
    and does nothing. Before uvicorn serves there is nothing to drain: the process exits at once.
    """

    def __init__(self) -> None:
        self.server: Any = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self)

    def __call__(self, signum: int, frame: object) -> None:
        if self.server is None or not self.server.should_exit:
            raise SystemExit(0)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False


def check_open_mode(settings: Settings, keys_enabled: bool) -> None:
    """Refuse to listen beyond loopback without API keys, unless ``--unsafe-no-auth``."""
    if keys_enabled or settings.unsafe_no_auth or is_loopback(settings.host):
        return
    raise UsageError(
        f"--host {settings.host} without API keys would serve every route and completion to "
        "anyone who reaches it: give --api-keys-file / --admin-keys-file (or --api-keys), or "
        "--unsafe-no-auth to serve it open anyway (the RL control API included)"
    )


def open_mode_warning(settings: Settings) -> str:
    """What a service without API keys leaves open, in one line."""
    where = f"{settings.host}:{settings.port}"
    if settings.unsafe_no_auth:
        return (
            f"--unsafe-no-auth and no API keys: completions, routes (read and delete), /metrics "
            f"and the RL control API (pause, abort, weight loads and transfers) are open to "
            f"anyone who reaches {where}"
        )
    return (
        f"no API keys: completions, routes (read and delete) and /metrics are open to anyone "
        f"who reaches {where}; the RL control API is closed (it needs --admin-keys)"
    )


def serve_main(argv: list[str]) -> int:
    stop = _StopSignals()
    stop.install()
    fatal: list[str] = []
    server: Any = None

    def on_fatal(reason: str) -> None:
        # A dead engine never comes back: stop (gracefully) and exit non-zero, so the
        # supervisor (compose restart policy, Kubernetes) starts a fresh process.
        fatal.append(reason)
        if server is not None:
            server.should_exit = True

    try:
        settings = settings_from_argv(argv)
        from .app import StartupRefusalQuiet, create_app

        app = create_app(settings, on_fatal=on_fatal)  # reads the key files; starts nothing
        check_open_mode(settings, app.state.keys.enabled)
        sock = bind_socket(settings.host, settings.port)
    except (UsageError, ValueError, OSError) as e:  # also: an unreadable or malformed key file
        print(f"routereplay serve: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if not app.state.keys.enabled:
        logging.getLogger("routereplay.service").warning("%s", open_mode_warning(settings))
    config = uvicorn.Config(
        StartupRefusalQuiet(app), log_level=settings.log_level, timeout_graceful_shutdown=10,
        # One worker: the engine lives in this process; vLLM scales inside it.
        workers=1,
    )  # fmt: skip
    server = stop.server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn's exit when the lifespan failed to start
        if app.state.refused is None:
            raise
    if app.state.refused is not None:
        print(f"routereplay serve: error: {app.state.refused}", file=sys.stderr)
        return 2
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
