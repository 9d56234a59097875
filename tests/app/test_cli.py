"""``routereplay serve`` as a user types it: usage errors (no tracebacks), choices in --help,
a port in use found before the engine starts, and the synthetic backend serving for real."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from routereplay.bench.servers import server_process
from routereplay.local_redis import free_port


def serve(*flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_flags_choices_and_env() -> None:
    out = serve("--help").stdout
    assert "--backend {vllm,upstream,synthetic}" in out
    assert "--tiny-variant {moe,dense-first,sharp}" in out
    assert "--request-id-lease-s" in out and "--metrics-open" in out
    assert "--enforce-eager | --no-enforce-eager" in out
    assert "ROUTEREPLAY_" in out


def test_bad_values_are_usage_errors() -> None:
    for flags, needle in (
        (["--port", "abc"], "--port"),
        (["--port", "70000"], "--port"),
        (["--backend", "foo"], "--backend"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--bogus", "1"], "unrecognized arguments: --bogus"),
    ):
        r = serve(*flags)
        assert r.returncode == 2, (flags, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_env_values_are_checked_too(monkeypatch) -> None:
    monkeypatch.setenv("ROUTEREPLAY_PORT", "not-a-port")
    r = serve()
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "error: ROUTEREPLAY_PORT: Input should be a valid integer" in r.stderr, r.stderr


def test_port_in_use_fails_before_the_engine_starts(tmp_path: Path) -> None:
    # The default backend is the vLLM engine of the tiny model, which it first builds into
    # --model-dir: a port checked after the engine's start would find that directory made.
    models = tmp_path / "models"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = serve("--port", str(port), "--model-dir", str(models))
    assert r.returncode == 2 and f"127.0.0.1:{port}" in r.stderr, r.stderr
    assert not models.exists(), "the engine started before the port was checked"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "routereplay.example"])
def test_a_public_bind_without_keys_is_refused(host: str, tmp_path: Path) -> None:
    models = tmp_path / "models"
    r = serve("--host", host, "--port", "0", "--model-dir", str(models))
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert f"--host {host} without API keys" in line and "--unsafe-no-auth" in line, line
    assert not models.exists(), "the engine started before the refusal"


def test_unsafe_no_auth_serves_and_names_what_is_open(redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "routereplay.cli", "serve", "--backend", "synthetic",
            "--host", "0.0.0.0", "--port", str(port), "--redis-url", redis_url,
            "--route-prefix", "clitest-open", "--unsafe-no-auth"]  # fmt: skip
    log = tmp_path / "serve.log"
    with server_process(argv, f"http://127.0.0.1:{port}/ready", log, timeout_s=300):
        assert httpx.post(f"http://127.0.0.1:{port}/pause").json() == {"status": "paused"}
        assert httpx.post(f"http://127.0.0.1:{port}/resume").json() == {"status": "resumed"}
    text = log.read_text()
    assert "the RL control API (pause, abort, weight loads and transfers) are open" in text, text


def test_synthetic_backend_serves(redis_url: str, tmp_path) -> None:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "routereplay.cli",
        "serve",
        "--backend",
        "synthetic",
        "--port",
        str(port),
        "--redis-url",
        redis_url,
        "--route-prefix",
        "clitest",
    ]
    with server_process(
        argv, f"http://127.0.0.1:{port}/ready", tmp_path / "serve.log", timeout_s=300
    ):
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "synthetic-moe", "prompt": "hi", "max_tokens": 2},
        )
        assert r.json()["choices"][0]["routed_experts"]["status"] == "stored"


@pytest.mark.parametrize(
    "sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm"]
)
def test_stop_signals_exit_0_without_traceback(
    redis_url: str, tmp_path: Path, sig: signal.Signals, group: bool
) -> None:
    """uvicorn raises the stop signal again once it has stopped; the service takes it: status 0,
    no KeyboardInterrupt traceback (SIGINT), no death by signal (SIGTERM). The real engine's
    side of a stop is tests/service/test_stop.py."""
    port = free_port()
    argv = [sys.executable, "-m", "routereplay.cli", "serve", "--backend", "synthetic",
            "--port", str(port), "--redis-url", redis_url]  # fmt: skip
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(600):
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        (os.killpg if group else os.kill)(proc.pid, sig)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "Application shutdown complete" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
