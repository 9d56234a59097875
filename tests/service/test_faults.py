"""The real in-process engine dying: EngineDeadError reported, never a hang, nothing half-stored,
then the process exits with status 3 so its supervisor restarts it.

Uses its own service (its engine is killed on purpose); the pytest session's is unaffected. Redis
faults (full, gone) need no engine and are covered in tests/app/test_probes_and_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import routereplay_test_hold as _test_hold

from routereplay.service.cli import ENGINE_DEAD_EXIT

from engines import MODEL_NAME, engine_core_pids, start_service

pytestmark = pytest.mark.vllm

GRACE_S = 10
DOOMED = _test_hold.PREFIX + "doomed"  # parked in its engine after a few tokens


@dataclass
class FaultyService:
    url: str
    proc: subprocess.Popen


@pytest.fixture(scope="module")
def faulty(
    tiny_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FaultyService]:
    log_dir = tmp_path_factory.mktemp("faulty")
    # The grace outlasts the test's probes of the dying service, however stalled the host.
    flags = ("--route-prefix", "faulty", "--engine-death-grace-s", str(GRACE_S))
    env = {_test_hold.ENV: str(log_dir)}  # never released: the engine dies under its request
    with start_service(redis_url, tiny_model, log_dir, *flags, env=env) as (svc, proc):
        yield FaultyService(svc.url, proc)


def test_engine_death_mid_stream(faulty: FaultyService) -> None:
    url = faulty.url
    cores = engine_core_pids(faulty.proc.pid)
    assert cores, "no engine core process found"
    lines: list[str] = []

    def consume() -> None:
        with httpx.stream(
            "POST", f"{url}/v1/completions", timeout=60,
            json={"model": MODEL_NAME, "prompt": "long one", "max_tokens": 1500,
                  "ignore_eos": True, "stream": True},
            headers={"X-Request-Id": DOOMED},
        ) as r:  # fmt: skip
            lines.extend(ln for ln in r.iter_lines() if ln)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 300
    while not lines and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lines, "stream did not start"
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    # Far longer than the answer takes: only a stream that never ends stays past it.
    t.join(timeout=300)
    assert not t.is_alive(), "stream hung after the engine died"
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: ") :])
    assert err["error"]["type"] == "engine_unavailable", err
    # Later requests fail fast with 503; probes say so.
    r = httpx.post(
        f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
        timeout=30,
    )  # fmt: skip
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
    assert httpx.get(f"{url}/health", timeout=30).status_code == 503
    assert httpx.get(f"{url}/ready", timeout=30).status_code == 503
    # The interrupted choice was never published.
    assert httpx.get(f"{url}/v1/routes/{DOOMED}-0", timeout=30).status_code == 404
    # After its grace period the service exits with status 3, for its supervisor to restart it.
    assert faulty.proc.wait(timeout=GRACE_S + 60) == ENGINE_DEAD_EXIT
