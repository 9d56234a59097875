"""Stopping the real service: Ctrl-C (SIGINT to the whole process group, as a terminal sends it)
and SIGTERM to the service alone (``docker stop``, Kubernetes) both end with exit status 0, the
engine core and its worker stopped by their own teardown (no forced kill), no leaked shared
memory and no traceback; so does a Ctrl-C while the engine is still starting. Each test boots
its own engine: the stop is what is tested."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from routereplay.bench.servers import engine_env
from routereplay.local_redis import free_port

pytestmark = pytest.mark.vllm

# What vLLM and Python log when the stop goes wrong: a forced kill of the engine core or its
# worker ("force killing remaining process EngineCore", "workers still running after grace
# period"), the resource tracker's "There appear to be 1 leaked shared_memory objects".
BAD = re.compile(r"Traceback|leaked|force kill|forcefully|still running|KeyboardInterrupt|\bkill")


def start(tiny_model: Path, redis_url: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [
        sys.executable, "-m", "routereplay.cli", "serve", "--port", str(port),
        "--redis-url", redis_url, "--model-dir", str(tiny_model.parent),
        "--max-model-len", "512",
        # Unpinned: on the 2-core host every engine of the run binds its worker to core 0
        # (--cpu-bind auto), and a worker starved there while it exits outlasts vLLM's grace
        # period; the stop itself is the same either way.
        "--cpu-bind", "none",
    ]  # fmt: skip
    with open(log, "wb") as f:
        # Its own process group, as a shell gives a foreground job: the group gets the Ctrl-C.
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=engine_env(), start_new_session=True
        )
    return proc, f"http://127.0.0.1:{port}"


def wait_for(proc: subprocess.Popen, log: Path, condition) -> None:
    deadline = time.monotonic() + 600
    while not condition():
        assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
        time.sleep(0.2)


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stopped(proc: subprocess.Popen, log: Path, *, group: bool, sig: signal.Signals) -> str:
    (os.killpg if group else os.kill)(proc.pid, sig)
    try:
        code = proc.wait(timeout=600)  # a Ctrl-C during the start waits for it
    finally:
        # Whatever the outcome, nothing of this engine outlives the test.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    return text


def group_members(pgid: int) -> list[str]:
    """Command lines of the live processes in process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if int(stat[2]) == pgid and stat[0] != "Z":
                out.append(cmd)
    return out


def left_behind(pgid: int, patience_s: float = 30.0) -> list[str]:
    """The processes of group ``pgid`` still alive ``patience_s`` after its leader exited (none,
    as soon as they are gone): multiprocessing's resource tracker exits when the last of its
    clients closes its pipe, which on a loaded host can come a moment after them."""
    deadline = time.monotonic() + patience_s
    while (members := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return members


def assert_clean(text: str) -> None:
    bad = [line for line in text.splitlines() if BAD.search(line)]
    assert not bad, "\n".join(bad)
    # vLLM's own account of a graceful stop, and the service's.
    assert "all workers exited gracefully" in text, text[-4000:]
    assert "MPClient: complete" in text and "Application shutdown complete" in text
    # The engine core stopped on the service's SIGTERM, never on the Ctrl-C itself.
    assert "EngineCore: trigger received signal=SIGTERM" in text
    assert "received signal=SIGINT" not in text


CASES = {"ctrl-c": (True, signal.SIGINT), "sigterm": (False, signal.SIGTERM)}


@pytest.fixture(scope="module")
def services(
    tiny_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[subprocess.Popen, str, Path]]]:
    """One service per case of ``test_stop_is_clean``, all started at once (their start-ups
    overlap each other's and the start of the test before them); each test stops its own."""
    out = {}
    for name in CASES:
        log = tmp_path_factory.mktemp(f"stop-{name}") / "serve.log"
        out[name] = (*start(tiny_model, redis_url, log), log)
    try:
        yield out
    finally:
        for proc, _, _ in out.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.usefixtures("services")  # the next tests' engines start alongside this one's
def test_ctrl_c_while_the_engine_starts(tiny_model: Path, redis_url: str, tmp_path: Path) -> None:
    """Pressed while vLLM's worker loads (where it used to kill the worker and the engine core's
    start with it), the Ctrl-C stops the service once the engine is up, cleanly."""
    log = tmp_path / "serve.log"
    proc, url = start(tiny_model, redis_url, log)
    wait_for(proc, log, lambda: any("VLLM::Worker" in c for c in group_members(proc.pid)))
    assert not ready(url)
    assert_clean(stopped(proc, log, group=True, sig=signal.SIGINT))
    assert "Application startup complete" in log.read_text()
    assert not left_behind(proc.pid), "a process of the service outlived it"


@pytest.mark.parametrize("case", list(CASES))
def test_stop_is_clean(services: dict[str, tuple[subprocess.Popen, str, Path]], case: str) -> None:
    group, sig = CASES[case]
    proc, url, log = services[case]
    wait_for(proc, log, lambda: ready(url))
    # A request first, so the engine has run a step (its worker has state to tear down).
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny-qwen3-moe-moe", "prompt": "stop", "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert_clean(stopped(proc, log, group=group, sig=sig))
    assert not left_behind(proc.pid), "a process of the service outlived it"
