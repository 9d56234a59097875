"""What only a real HTTP server shows: client disconnects abort the engine request, and a
connection survives errors (keep-alive)."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from .conftest import MODEL, LiveServer, wait_for


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_engine_request(live_server: LiveServer, stream: bool) -> None:
    rid = f"gone-{int(stream)}"
    body = {"model": MODEL, "prompt": "never mind", "max_tokens": 1000, "stream": stream}
    url = f"{live_server.url}/v1/completions"
    backend = live_server.backend
    # 1000 tokens take 20 s at this pace; the client leaves while they are being generated.
    if stream:
        with httpx.stream("POST", url, json=body, timeout=60, headers={"X-Request-Id": rid}) as r:
            next(r.iter_bytes())  # the first token has arrived: the stream is under way
        # Leaving the block closed the connection mid-stream.
    else:
        data = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\n"
            f"Content-Type: application/json\r\nX-Request-Id: {rid}\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        with socket.create_connection((urlsplit(url).hostname, urlsplit(url).port)) as s:
            s.sendall(head.encode() + data)
            wait_for(lambda: backend.num_unfinished() > 0, "the engine generating the request")
        # Closing the socket is the client going away before the answer.
    # Aborted, not run to its end: it stops, is counted as closed by the client (499, and no
    # longer in flight), and stores no route.
    wait_for(lambda: backend.num_unfinished() == 0, "the abandoned request stopping")
    closed = 'routereplay_requests_total{endpoint="completions",status="499"} 1.0'
    wait_for(lambda: closed in httpx.get(f"{live_server.url}/metrics").text, "a 499 counted")
    assert "routereplay_requests_inflight 0.0" in httpx.get(f"{live_server.url}/metrics").text
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
