"""Faults: Redis going away (routes reported failed, completions still served) and the in-process
engine dying (EngineDeadError reported, never a hang, nothing half-stored).

Uses its own service and redis-server (both are broken on purpose); the session's are unaffected.
Tests run in file order: Redis first, then the engine.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from routereplay.client._local_redis import redis_server

from ._procs import engine_env, free_port, process, serve_argv
from .conftest import MODEL_NAME

pytestmark = pytest.mark.vllm


def engine_core_pids(parent: int) -> list[int]:
    """PIDs of vLLM engine-core processes under ``parent`` (by parent pid, from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"EngineCore" in cmd:
            out.append(int(d.name))
    return out


@dataclass
class FaultyService:
    url: str
    pid: int
    redis_url: str
    stop_redis: Callable[[], None]


@pytest.fixture(scope="module")
def faulty(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultyService]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    redis_ctx = redis_server()
    redis_url = redis_ctx.__enter__()
    argv = serve_argv(
        "--port", str(port), "--redis-url", redis_url, "--model-dir", str(tiny_model.parent),
        "--log-level", "warning", "--store-timeout-s", "5",
    )  # fmt: skip
    log = tmp_path_factory.mktemp("faulty") / "serve.log"
    try:
        with process(argv, f"{url}/ready", log, engine_env()) as proc:
            yield FaultyService(
                url, proc.pid, redis_url, lambda: redis_ctx.__exit__(None, None, None)
            )
    finally:
        redis_ctx.__exit__(None, None, None)  # idempotent if the test stopped it already


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    vals = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name)]
    return sum(vals)


def test_redis_full_routes_reported_failed_never_half_written(faulty: FaultyService) -> None:
    url = faulty.url
    body = {"model": MODEL_NAME, "prompt": "store me", "max_tokens": 3, "ignore_eos": True}
    ok = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert ok["choices"][0]["routed_experts"]["status"] == "stored"
    r = redis.Redis.from_url(faulty.redis_url)
    # Redis full: every write is refused (reads still work), mid-put if need be.
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    try:
        for stream in (False, True):
            rid = f"full-{int(stream)}"
            resp = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream},
                              headers={"X-Request-Id": rid}, timeout=60)  # fmt: skip
            assert resp.status_code == 200
            if stream:
                chunks = [json.loads(ln[6:]) for ln in resp.text.splitlines()
                          if ln.startswith("data: {")]  # fmt: skip
                (h,) = [c["choices"][0]["routed_experts"] for c in chunks
                        if c["choices"] and c["choices"][0].get("finish_reason")]  # fmt: skip
            else:
                h = resp.json()["choices"][0]["routed_experts"]
            # The completion is served; its routes are reported failed, with the reason...
            assert h["status"] == "failed" and h["num_valid_rows"] == 0 and h["error"], h
            # ...and no partial record is readable under its id.
            assert httpx.get(f"{url}/v1/routes/{rid}-0").status_code == 404
    finally:
        r.config_set("maxmemory", 0)
        r.close()
    assert metric(url, "routereplay_route_store_errors_total") == 2
    again = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert again["choices"][0]["routed_experts"]["status"] == "stored"


def test_engine_death_mid_stream(faulty: FaultyService) -> None:
    url = faulty.url
    if True:
        cores = engine_core_pids(faulty.pid)
        assert cores, "no engine core process found"
        lines: list[str] = []

        def consume() -> None:
            with httpx.stream(
                "POST", f"{url}/v1/completions", timeout=60,
                json={"model": MODEL_NAME, "prompt": "long one", "max_tokens": 1500,
                      "ignore_eos": True, "stream": True},
                headers={"X-Request-Id": "doomed"},
            ) as r:  # fmt: skip
                lines.extend(ln for ln in r.iter_lines() if ln)

        t = threading.Thread(target=consume)
        t.start()
        deadline = time.monotonic() + 60
        while len(lines) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lines) >= 5, "stream did not start"
        for pid in cores:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        t.join(timeout=60)
        assert not t.is_alive(), "stream hung after the engine died"
        assert time.monotonic() - t0 < 60
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][len("data: ") :])
        assert err["error"]["type"] == "engine_unavailable", err
        # Later requests fail fast with 503; probes say so.
        r = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
            timeout=30,
        )  # fmt: skip
        assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
        assert httpx.get(f"{url}/health").status_code == 503
        assert httpx.get(f"{url}/ready").status_code == 503
        # The interrupted choice was never published.
        assert httpx.get(f"{url}/v1/routes/doomed-0").status_code == 404


def test_redis_down_is_reported(faulty: FaultyService) -> None:
    faulty.stop_redis()
    ready = httpx.get(f"{faulty.url}/ready")
    assert ready.status_code == 503 and "redis" in ready.json()
    r = httpx.get(f"{faulty.url}/v1/routes/anything-0")
    assert r.status_code == 503 and r.json()["error"]["type"] == "store_unavailable"
