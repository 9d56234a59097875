"""What only a real HTTP server shows: a client that leaves, at any point of its request, aborts
its engine request and is counted as gone (499), never as in flight; a connection survives errors
(keep-alive)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from routereplay.service.engine import EngineEvent
from routereplay.service.engines.synthetic import SyntheticBackend

from .conftest import MODEL, LiveServer, live, wait_for


class QueueingEngine(SyntheticBackend):
    """The synthetic engine, except that while :attr:`hold` is set a request waits before its
    first event until its client leaves, as the in-process vLLM backend's first event waits for
    the engine's first output (the request queued, prefilling, or the engine paused)."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.hold = True
        self.queued = 0

    def num_unfinished(self) -> int:
        return super().num_unfinished() + self.queued

    def generate_chat(self, req):  # type: ignore[no-untyped-def]
        return self._queued(super().generate_chat(req))

    def generate_completion(self, req):  # type: ignore[no-untyped-def]
        return self._queued(super().generate_completion(req))

    async def _queued(self, events: AsyncIterator[EngineEvent]) -> AsyncIterator[EngineEvent]:
        async with contextlib.aclosing(events):
            if self.hold:
                self.queued += 1
                try:
                    await asyncio.get_running_loop().create_future()  # the queue never moves
                finally:
                    self.queued -= 1
            async for ev in events:
                yield ev


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``/metrics`` parsed (a malformed exposition fails here): (name, labels) -> value."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(url: str, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in scrape(url).items() if n == name and want <= ls)


def send(url: str, path: str, body: dict, request_id: str | None) -> socket.socket:
    """POST ``body`` on a raw socket, so the test decides when the client goes away."""
    u = urlsplit(url)
    data = json.dumps(body).encode()
    rid = f"X-Request-Id: {request_id}\r\n" if request_id else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"{rid}Content-Length: {len(data)}\r\n\r\n"
    )
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(head.encode() + data)
    return s


PROMPTS = {
    "completions": ("/v1/completions", {"prompt": "never mind"}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "never mind"}]}),
}


@pytest.mark.parametrize("phase", ["queued", "decode"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("request_id", [None, "gone"])
def test_client_disconnect_aborts_and_is_counted(
    redis_url: str, phase: str, stream: bool, endpoint: str, request_id: str | None
) -> None:
    # queued: the client leaves before the engine's first output (a streamed response has not
    # started); decode: while tokens are generated (1000 take 20 s at this pace).
    engine = QueueingEngine() if phase == "queued" else SyntheticBackend(MODEL, step_delay_s=0.02)
    path, prompt = PROMPTS[endpoint]
    body = {"model": MODEL, **prompt, "max_tokens": 1000, "stream": stream}
    with live(redis_url, backend=engine) as server:
        url = server.url
        with send(url, path, body, request_id) as s:
            wait_for(lambda: engine.num_unfinished() > 0, "the engine holding the request")
            if phase == "decode" and stream:
                got = b""
                while got.count(b"data: ") < 2:  # chat: the role, then a token
                    got += s.recv(65536)
        # Closing the socket is the client going away.
        wait_for(lambda: engine.num_unfinished() == 0, "the abandoned request closed")
        wait_for(lambda: metric(url, "routereplay_requests_inflight") == 0, "none in flight")
        assert metric(url, "routereplay_requests_total", endpoint=endpoint, status="499") == 1
        assert metric(url, "routereplay_requests_total") == 1  # counted once, as gone
        # Nothing stored for it; the service (and the id) serve the next request.
        if request_id is not None:
            assert httpx.get(f"{url}/v1/routes/{request_id}-0").status_code == 404
        engine.hold = False
        headers = {"X-Request-Id": request_id} if request_id else {}
        ok = httpx.post(
            url + path, json={**body, "max_tokens": 2, "stream": False}, headers=headers, timeout=30
        )
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["routed_experts"]["status"] == "stored"


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
