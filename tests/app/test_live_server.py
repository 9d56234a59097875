"""What only a real HTTP server shows: client disconnects abort the engine request, and a
connection survives errors (keep-alive)."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import MODEL, LiveServer


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_engine_request(live_server: LiveServer, stream: bool) -> None:
    rid = f"gone-{int(stream)}"
    body = {"model": MODEL, "prompt": "never mind", "max_tokens": 1000, "stream": stream}
    url = f"{live_server.url}/v1/completions"
    # 1000 tokens take 20 s at this pace; the client gives up after 0.5 s.
    if stream:
        with httpx.stream("POST", url, json=body, timeout=30, headers={"X-Request-Id": rid}) as r:
            t0 = time.monotonic()
            for _ in r.iter_bytes():
                if time.monotonic() - t0 > 0.5:
                    break  # leaving the block closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=0.5, headers={"X-Request-Id": rid})
    deadline = time.monotonic() + 5
    while live_server.backend.num_unfinished() > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live_server.backend.num_unfinished() == 0, "the abandoned request is still generating"
    assert httpx.get(f"{live_server.url}/v1/routes/{rid}-0").status_code == 404
    # The id is free again.
    ok = httpx.post(
        url,
        json={**body, "max_tokens": 2, "stream": False},
        headers={"X-Request-Id": rid},
        timeout=30,
    )
    assert ok.status_code == 200


def test_keep_alive_connection_survives_errors(live_server: LiveServer) -> None:
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        statuses = []
        for body in (
            {"model": MODEL, "prompt": "a", "max_tokens": 2},
            {"n": "2"},
            [1],
            {"model": "nope", "prompt": "a"},
            {"model": MODEL, "prompt": "b", "max_tokens": 2},
        ):
            statuses.append(c.post("/v1/completions", json=body).status_code)
        statuses.append(c.get("/nowhere").status_code)
        statuses.append(c.get("/health").status_code)
        live_server.backend.fault = RuntimeError("a bug")  # a 500, then the same connection
        statuses.append(c.post("/v1/completions", json={"model": MODEL, "prompt": "c"}).status_code)
        live_server.backend.fault = None
        ok = {"model": MODEL, "prompt": "d", "max_tokens": 2}
        statuses.append(c.post("/v1/completions", json=ok).status_code)
        huge = b"x" * (17 << 20)
        ctype = {"content-type": "application/json"}
        statuses.append(c.post("/v1/completions", content=huge, headers=ctype).status_code)
        statuses.append(c.get("/health").status_code)
    assert statuses == [200, 400, 400, 404, 200, 404, 200, 500, 200, 413, 200]
