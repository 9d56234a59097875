"""The upstream backend reads its upstream's release at start and never stores a shifted row.

The upstream here is a small HTTP server that answers as a vLLM server of a given release does
on the routes the backend uses: an old one (0.27) ignores ``routed_experts_prompt_start`` and
returns every row, and a server without ``VLLM_SERVER_DEV_MODE=1`` has no RL routes (404). The
real ``vllm serve`` of the installed release is tests/service/test_upstream.py's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from routereplay.client import decode_record
from routereplay.local_redis import free_port
from routereplay.service import Settings, create_app
from routereplay.service.engines.upstream import UpstreamBackend

from .conftest import wait_for

L, E, K = 3, 8, 2
ADMIN = "ops:" + "a" * 24
PROMPT, OUTPUT = [5, 6, 7, 8, 9], [10, 11, 12]


@dataclass
class FakeVllm:
    """A vLLM server of ``version`` on the routes the backend calls; ``bodies`` records what
    it was sent."""

    version: str
    honours_prompt_start: bool
    dev_mode: bool
    extra_rows: int = 0  # rows beyond what vLLM returns (a layout no release has)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def rows(self, start: int) -> np.ndarray:
        """Routes of every row but the last token's, each row's ids distinct per row."""
        T = len(PROMPT) + len(OUTPUT)
        first = start if self.honours_prompt_start else 0
        n = T - 1 - first + self.extra_rows
        base = (np.arange(first, first + n) % (E - 1))[:, None, None]
        return ((base + np.arange(K)[None, None, :]) % E * np.ones((1, L, 1))).astype(np.uint8)

    def app(self, model_root: Path) -> FastAPI:
        app = FastAPI()

        @app.get("/version")
        def version() -> dict[str, str]:
            return {"version": self.version}

        @app.get("/health")
        def health() -> dict[str, str]:
            return {}

        @app.get("/is_paused")
        def is_paused() -> Any:
            if not self.dev_mode:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return {"is_paused": False}

        @app.post("/pause")
        def pause() -> Any:
            if not self.dev_mode:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return {}

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return {"data": [{"id": "m", "root": str(model_root), "max_model_len": 64}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.bodies.append(body)
            buf = io.BytesIO()
            np.save(buf, self.rows(int(body.get("routed_experts_prompt_start", 0))))
            choice = {"index": 0, "text": "abc", "token_ids": OUTPUT, "finish_reason": "length",
                      "prompt_token_ids": PROMPT,
                      "routed_experts": base64.b64encode(buf.getvalue()).decode()}  # fmt: skip
            return {"id": "x", "choices": [choice], "usage": {"prompt_tokens": len(PROMPT)}}

        return app


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    wait_for(lambda: server.started or not t.is_alive(), "the fake upstream starting")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(timeout=10)


@pytest.fixture()
def model_root(tmp_path: Path) -> Path:
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": L, "num_experts": E,
           "num_experts_per_tok": K}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


async def complete(fake: FakeVllm, model_root: Path, redis_url: str, **body: Any) -> dict:
    """One completion through the service over ``fake``: the response, and the stored record
    (None when the route was not stored)."""
    with serving(fake.app(model_root)) as url:
        backend = UpstreamBackend(url)
        settings = Settings(redis_url=redis_url, route_prefix="upr", admin_keys=[ADMIN])
        app = create_app(settings, backend=backend)
        await backend.start()
        async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30
        ) as http:  # fmt: skip
            auth = {"Authorization": "Bearer " + "a" * 24}
            r = await http.post("/v1/completions", headers=auth,
                                json={"model": "m", "prompt": PROMPT, **body})  # fmt: skip
            pause = await http.post("/pause", headers=auth)
            assert r.status_code == 200, r.text
            handle = r.json()["choices"][0]["routed_experts"]
            record = None
            if handle["status"] == "stored":
                got = await http.get(f"/v1/routes/{handle['route_id']}", headers=auth)
                record = decode_record(got.content)
        await backend.close()
    return {"handle": handle, "record": record, "pause": pause}


async def test_an_old_upstream_is_never_stored_shifted(
    model_root: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.27 ignores routed_experts_prompt_start and returns every row: the field is not
    sent, the rows are stored from row 0 (each token's own), and the start-up log says so."""
    fake = FakeVllm("0.27.1", honours_prompt_start=False, dev_mode=False)
    with caplog.at_level(logging.WARNING, "routereplay.service"):
        # From row 1 its T - 1 rows would fit from row 1: stored so, each a row late.
        got = await complete(fake, model_root, redis_url, max_tokens=3,
                             routed_experts_prompt_start=1)  # fmt: skip
    assert "routed_experts_prompt_start" not in fake.bodies[0]
    rec = got["record"]
    np.testing.assert_array_equal(rec.experts[:-1], fake.rows(0))
    assert rec.valid[:-1].all() and not rec.valid[-1]
    log = caplog.text
    assert "upstream vLLM 0.27.1 predates routed_experts_prompt_start (0.28)" in log
    assert "serves no RL API (start it with VLLM_SERVER_DEV_MODE=1)" in log
    # Its RL routes: refused by name, not relayed as the upstream's bare 404.
    assert got["pause"].status_code == 400, got["pause"].text
    assert "VLLM_SERVER_DEV_MODE=1" in got["pause"].json()["error"]["message"]


async def test_a_current_upstream_gets_the_field(model_root: Path, redis_url: str) -> None:
    fake = FakeVllm("0.32.0", honours_prompt_start=True, dev_mode=True)
    got = await complete(fake, model_root, redis_url, max_tokens=3, routed_experts_prompt_start=2)
    assert fake.bodies[0]["routed_experts_prompt_start"] == 2
    rec = got["record"]
    np.testing.assert_array_equal(rec.experts[2:-1], fake.rows(2))
    assert not rec.valid[:2].any() and rec.valid[2:-1].all()
    assert got["pause"].status_code == 200, got["pause"].text


@pytest.mark.parametrize("version", ["0.32.0", "0.27.1", "unknown-build"])
async def test_rows_in_no_known_layout_fail_the_route(
    model_root: Path, redis_url: str, version: str
) -> None:
    fake = FakeVllm(version, honours_prompt_start=version == "0.32.0", dev_mode=True, extra_rows=2)
    got = await complete(fake, model_root, redis_url, max_tokens=3, routed_experts_prompt_start=1)
    assert got["handle"]["status"] == "failed" and got["record"] is None
    assert "rows of routes for 8 tokens" in got["handle"]["error"]


def test_release_numbers_are_read_from_the_version(model_root: Path) -> None:
    async def probe(version: str) -> Any:
        fake = FakeVllm(version, honours_prompt_start=True, dev_mode=False)
        with serving(fake.app(model_root)) as url:
            b = UpstreamBackend(url)
            await b.start()
            await b.close()
            return b.release

    got = {v: asyncio.run(probe(v)).prompt_start for v in
           ("0.28.0", "0.33.0rc1", "0.27.9", "1.0.0", "0.9.2", "dev")}  # fmt: skip
    assert got == {"0.28.0": True, "0.33.0rc1": True, "0.27.9": False, "1.0.0": True,
                   "0.9.2": False, "dev": False}  # fmt: skip
