"""The upstream backend against a real ``vllm serve --enable-return-routed-experts`` process.

The upstream serves the dense-first tiny model (``mlp_only_layers=[0]``), so this module also
checks that dense layers are marked as such, never stored as expert 0.
"""

from __future__ import annotations

import base64
import io
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from routereplay.bench.servers import engine_env, server_process, stop_process
from routereplay.client import decode_record
from routereplay.local_redis import free_port

pytestmark = pytest.mark.vllm


# vLLM is started with --api-key; the front sends it (--upstream-api-key).
UPSTREAM_KEY = "upstream-key-" + "u" * 20
UPSTREAM_AUTH = {"Authorization": f"Bearer {UPSTREAM_KEY}"}


def vllm_serve_argv(model: str, port: int, *flags: str) -> list[str]:
    # float32, eager, seeded: one request gives the same routes twice, so the routes the front
    # stored can be compared with those the upstream returns inline for the same request.
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "2048", "--enforce-eager", "--gpu-memory-utilization", "0.5",
        "--seed", "0", "--enable-return-routed-experts", "--enable-prefix-caching", *flags,
    ]  # fmt: skip


class Upstream:
    """A ``vllm serve`` on a fixed port that a test may kill; the next test that needs it alive
    starts it again on the same port (so no test depends on running before the killing one)."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.log_dir = log_dir
        self.starts = 0
        self._cm = None
        self.proc = None

    def ensure_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.close()
        self.starts += 1
        argv = vllm_serve_argv(
            str(self.model), self.port, "--served-model-name", "dense-first",
            "--api-key", UPSTREAM_KEY,
        )  # fmt: skip
        log = self.log_dir / f"vllm-{self.starts}.log"
        # /v1/* needs the key; /health does not.
        self._cm = server_process(argv, f"{self.url}/health", log, engine_env())
        self.proc = self._cm.__enter__()

    def kill(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def close(self) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
            self._cm = None


@pytest.fixture(scope="module")
def upstream_server(dense_first_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    up = Upstream(dense_first_model, tmp_path_factory.mktemp("upstream"))
    up.ensure_alive()
    try:
        yield up
    finally:
        up.close()


@pytest.fixture()
def upstream(upstream_server: Upstream) -> Upstream:
    upstream_server.ensure_alive()
    return upstream_server


@pytest.fixture(scope="module")
def front_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("front") / "serve.log"


@pytest.fixture(scope="module")
def front_server(upstream_server: Upstream, redis_url: str, front_log: Path) -> Iterator[str]:
    port = free_port()
    log = front_log
    argv = [
        sys.executable, "-m", "routereplay.cli", "serve", "--backend", "upstream",
        "--upstream-url", upstream_server.url, "--port", str(port),
        "--redis-url", redis_url, "--route-prefix", "up", "--log-level", "warning",
    ]  # fmt: skip
    env = engine_env(ROUTEREPLAY_UPSTREAM_API_KEY=UPSTREAM_KEY)
    with server_process(argv, f"http://127.0.0.1:{port}/ready", log, env):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture()
def front(front_server: str, upstream: Upstream) -> str:
    """The routereplay front, with its upstream alive."""
    return front_server


def route(front: str, route_id: str):
    r = httpx.get(f"{front}/v1/routes/{route_id}", timeout=30)
    assert r.status_code == 200, r.text
    return decode_record(r.content)


def test_the_front_says_what_its_upstream_lacks(front: str, front_log: Path) -> None:
    """vLLM's server without VLLM_SERVER_DEV_MODE=1 has no RL routes: the front reads that at
    start and says it in one line; the installed release honours routed_experts_prompt_start."""
    log = front_log.read_text()
    assert "serves no RL API (start it with VLLM_SERVER_DEV_MODE=1)" in log, log[-2000:]
    assert "predates routed_experts_prompt_start" not in log


def test_models_report_dense_layout(front: str) -> None:
    m = httpx.get(f"{front}/v1/models").json()["data"][0]
    assert m["id"] == "dense-first"
    assert m["routed_experts"] == {"num_layers": 4, "moe_layers": [1, 2, 3], "num_experts": 8,
                                   "top_k": 2}  # fmt: skip


def test_chat_n2_routes_equal_upstream_inline(closing, front: str, upstream: Upstream) -> None:
    up_url = upstream.url
    body = {"model": "dense-first", "messages": [{"role": "user", "content": "dense first"}],
            "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 17}  # fmt: skip
    client = closing(openai.OpenAI(base_url=front + "/v1", api_key="x", max_retries=0))
    r = client.chat.completions.create(
        **body, extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "up-chat"}
    )
    body["ignore_eos"] = True
    assert r.id == "up-chat" and len(r.choices) == 2
    # The same request straight to vLLM: its inline base64 .npy is the reference.
    ref = httpx.post(
        f"{up_url}/v1/chat/completions",
        json={**body, "return_token_ids": True},
        timeout=120,
        headers=UPSTREAM_AUTH,
    ).json()
    for c, rc in zip(r.choices, ref["choices"], strict=True):
        h = c.routed_experts
        assert h["status"] == "stored" and h["route_id"] == f"up-chat-{c.index}"
        assert h["moe_layers"] == [1, 2, 3]
        rec = route(front, h["route_id"])
        assert rec.moe_layers == (1, 2, 3) and rec.num_layers == 4
        assert rec.token_ids.tolist() == ref["prompt_token_ids"] + rc["token_ids"]
        arr = np.load(io.BytesIO(base64.b64decode(rc["routed_experts"])))
        assert arr.shape == (rec.num_tokens - 1, 4, 2)
        assert not arr[:, 0].any()  # vLLM's dense layer: zeros...
        assert np.array_equal(rec.experts[:-1], arr[:, 1:])  # ...which the record leaves out
        assert rec.experts.shape[1] == 3
        # The response carried a handle, not the array.
        assert isinstance(h, dict) and len(str(h)) < 1024


def test_completion_streaming_through_upstream(closing, front: str) -> None:
    client = closing(openai.OpenAI(base_url=front + "/v1", api_key="x", max_retries=0))
    chunks = list(
        client.completions.create(
            model="dense-first", prompt="stream via upstream", max_tokens=5, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "up-stream"},
        )
    )  # fmt: skip
    fin = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(fin) == 1
    h = fin[0].model_extra["routed_experts"]
    assert h["status"] == "stored", h
    rec = route(front, "up-stream-0")
    assert rec.completion_len == 5 and rec.moe_layers == (1, 2, 3)
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_upstream_errors_are_relayed(front: str) -> None:
    r = httpx.post(
        f"{front}/v1/completions",
        json={"model": "dense-first", "prompt": [5] * 3000, "max_tokens": 1},
        headers={"X-Request-Id": "up-too-long"}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 400
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and isinstance(e["code"], str)
    assert httpx.get(f"{front}/v1/routes/up-too-long-0").status_code == 404
    r = httpx.post(f"{front}/v1/completions", json={"model": "nope", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_tokenize_is_forwarded(front: str, upstream: Upstream) -> None:
    body = {"messages": [{"role": "user", "content": "count me"}]}
    mine = httpx.post(f"{front}/tokenize", json=body, timeout=30).json()
    theirs = httpx.post(f"{upstream.url}/tokenize", json=body, timeout=30).json()
    assert mine["tokens"] == theirs["tokens"] and mine["count"] == theirs["count"]
    text = httpx.post(f"{front}/detokenize", json={"tokens": mine["tokens"]}, timeout=30).json()
    assert "count me" in text["prompt"]


def test_upstream_death_is_reported_not_hung(front: str, upstream: Upstream) -> None:
    upstream.kill()
    r = httpx.post(
        f"{front}/v1/completions",
        json={"model": "dense-first", "prompt": "anyone there", "max_tokens": 2}, timeout=300,
    )  # fmt: skip
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
    # Refused at once, not waited for: the failure is the connection's, not a timeout's.
    err = r.json()["error"]
    assert err["code"] == "upstream_unreachable" and "Timeout" not in err["message"], err
    ready = httpx.get(f"{front}/ready")
    assert ready.status_code == 503 and "engine" in ready.json()
