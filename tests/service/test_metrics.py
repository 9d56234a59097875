"""Metrics that tell the truth, on the real engine.

A client that leaves at any point of its request (queued behind a paused engine, during prefill,
during decode; streamed or not) is counted once as gone (499), leaves nothing in flight and
nothing in the engine, and the service serves on. vLLM's own metrics (``vllm:*``) are on the
service's ``/metrics`` beside ``routereplay_*``, with values that match what the service served.

One service for the module, with API keys (``/metrics`` needs one) and prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``); its engine prefills 32 tokens a step and runs
the scheduler's test hold (``tests/plugins/vllm_test_hold``), which keeps a request in the phase its
client leaves in. The pytest session's service shows the engine metrics without multiprocess mode.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import routereplay_test_hold as _test_hold
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from engines import MODEL_NAME, Service, start_service

pytestmark = pytest.mark.vllm

KEY = "lab:" + "k" * 32
ADMIN = "ops:" + "a" * 32
PATIENCE_S = 120.0  # far beyond any stall of a loaded machine: only what never comes fails

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Metered:
    url: str
    multiproc_dir: Path
    hold_dir: Path  # the engine's test hold: a file named by a held request's id releases it

    def client(self, key: str = KEY) -> httpx.Client:
        auth = {"Authorization": f"Bearer {key.split(':')[1]}"}
        return httpx.Client(base_url=self.url, headers=auth, timeout=PATIENCE_S)


@pytest.fixture(scope="module")
def metered(
    redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Metered]:
    d = tmp_path_factory.mktemp("metered")
    (d / "keys").write_text(KEY + "\n")
    (d / "admin").write_text(ADMIN + "\n")
    multiproc = d / "prometheus"
    multiproc.mkdir()
    flags = (
        "--route-prefix", "metered", "--api-keys-file", str(d / "keys"),
        "--admin-keys-file", str(d / "admin"),
        "--engine-args", json.dumps({"max_num_batched_tokens": 32}),
    )  # fmt: skip
    hold = d / "hold"  # never released: the held requests' clients leave
    hold.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(multiproc), _test_hold.ENV: str(hold)}
    with start_service(redis_url, tiny_model, d, *flags, env=env) as (svc, _):
        yield Metered(svc.url, multiproc, hold)


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {PATIENCE_S:g} s"
        time.sleep(0.01)


def scrape(c: httpx.Client) -> Samples:
    """``/metrics`` parsed (a malformed exposition fails here): (name, labels) -> value."""
    r = c.get("/metrics")
    assert r.status_code == 200, r.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def idle(m: Samples) -> bool:
    return value(m, "vllm:num_requests_running") == value(m, "vllm:num_requests_waiting") == 0


def token_prompt(salt: int, n: int) -> list[int]:
    """``n`` token ids no other prompt of the module shares (no prefix-cache hit)."""
    return [(i * 7919 + salt * 104729) % 1000 + 10 for i in range(n)]


# -- client disconnects ----------------------------------------------------------------------------
def send(url: str, path: str, body: dict, request_id: str | None) -> socket.socket:
    """POST ``body`` on a raw socket, so the test decides when the client goes away."""
    u = urlsplit(url)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY.split(':')[1]}\r\n"
        + (f"X-Request-Id: {request_id}\r\n" if request_id else "")
        + f"Content-Length: {len(data)}\r\n\r\n"
    )
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(head.encode() + data)
    return s


def request_body(endpoint: str, phase: str, stream: bool, salt: int) -> tuple[str, dict]:
    body = {"model": MODEL_NAME, "max_tokens": 1000, "ignore_eos": True, "stream": stream}
    if endpoint == "chat":
        content = f"tell me everything, take {salt}"
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": content}]}
    if phase != "prefill":
        return "/v1/completions", {**body, "prompt": f"never mind, take {salt}"}
    # prefill: a prompt of several 32-token chunks (the hold parks it after the first).
    return "/v1/completions", {**body, "max_tokens": 100, "prompt": token_prompt(salt, 256)}


def reached(phase: str, c: httpx.Client, before: Samples) -> Callable[[], bool]:
    """Whether the request is in ``phase`` now, read off the metrics."""

    def now() -> bool:
        m = scrape(c)
        if phase == "queued":  # held by the service while the engine is paused
            return value(m, "routereplay_requests_held") >= 1
        generated = value(m, "vllm:generation_tokens_total") > value(
            before, "vllm:generation_tokens_total"
        )
        if phase == "decode":
            return generated
        # prefill: scheduled, and its prompt not yet counted (it is counted once prefilled)
        return value(m, "vllm:num_requests_running") >= 1 and not generated

    return now


def settled(c: httpx.Client, endpoint: str, before: Samples) -> Callable[[], bool]:
    gone_before = value(before, "routereplay_requests_total", endpoint=endpoint, status="499")
    served_before = value(before, "routereplay_requests_total", endpoint=endpoint, status="200")

    def now() -> bool:
        m = scrape(c)
        # A request that ran to its end before the socket closed is never gone: say so at once.
        served = value(m, "routereplay_requests_total", endpoint=endpoint, status="200")
        assert served == served_before, "the request finished before the client went away"
        return (
            value(m, "routereplay_requests_total", endpoint=endpoint, status="499") > gone_before
            and value(m, "routereplay_requests_inflight") == 0
            and value(m, "routereplay_engine_queue_depth") == 0
            and value(m, "routereplay_requests_held") == 0
        )

    return now


def serves_alone(metered: Metered, c: httpx.Client, request_id: str) -> None:
    """A request runs to its end, and while it runs it is the only one in the engine."""
    body = {"model": MODEL_NAME, "prompt": "still there?", "max_tokens": 48, "ignore_eos": True}
    headers = {"X-Request-Id": request_id}  # held: it parks after a few tokens until released
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):  # a token: the engine has it (then parks it)
            pass
        wait_for(lambda: value(scrape(c), "vllm:num_requests_running") == 1, "it running")
        assert value(scrape(c), "vllm:num_requests_waiting") == 0
        (metered.hold_dir / request_id).touch()
        rest = [ln for ln in lines if ln]
    assert rest[-1] == "data: [DONE]"
    finish = json.loads(rest[-2][len("data: ") :])["choices"][0]
    assert finish["routed_experts"]["status"] == "stored"


@contextlib.contextmanager
def paused(admin: httpx.Client, pause: bool) -> Iterator[None]:
    """The engine paused (new requests wait in the service) while inside, if ``pause``."""
    if not pause:
        yield
        return
    admin.post("/pause", params={"mode": "wait"}).raise_for_status()
    try:
        yield
    finally:
        admin.post("/resume").raise_for_status()


CASES = [
    # (phase, endpoint, stream, X-Request-Id): each kind of disconnect, both APIs, ids or not.
    # ``held-*`` requests park in the engine (decode: after a few tokens; ``held-prefill-*``: after
    # their first chunk of prompt), so the client leaves in that phase however loaded the host.
    ("decode", "completions", True, _test_hold.PREFIX + "decode-stream"),
    ("decode", "chat", False, _test_hold.PREFIX + "decode-chat"),
    ("prefill", "completions", True, _test_hold.PREFILL_PREFIX + "stream"),
    ("prefill", "completions", False, _test_hold.PREFILL_PREFIX + "whole"),
    ("queued", "chat", True, None),
    ("queued", "completions", False, "gone-queued"),
]


@pytest.mark.parametrize(("phase", "endpoint", "stream", "request_id"), CASES)
def test_client_disconnect(
    metered: Metered, phase: str, endpoint: str, stream: bool, request_id: str | None
) -> None:
    salt = CASES.index((phase, endpoint, stream, request_id))
    path, body = request_body(endpoint, phase, stream, salt)
    with metered.client() as c, metered.client(ADMIN) as admin:
        with paused(admin, phase == "queued"):
            before = scrape(c)
            with send(metered.url, path, body, request_id) as s:
                wait_for(reached(phase, c, before), f"the request in {phase}")
                if phase == "prefill":  # parked by the hold: a second on, it is in prefill still
                    time.sleep(1.0)
                    assert reached(phase, c, before)(), "the held request left its prefill"
                if phase == "decode" and stream:
                    got = b""
                    while b"data: " not in got:  # the stream is under way
                        got += s.recv(65536)
            # The socket closed: the client went away.
            wait_for(settled(c, endpoint, before), "the request counted as gone, none in flight")
            if phase == "queued":
                assert admin.get("/is_paused").json()["is_paused"]  # settled while paused
        after = scrape(c)
        # Counted once, as gone.
        for status in ({"status": "499"}, {}):
            n = value(after, "routereplay_requests_total", endpoint=endpoint, **status)
            assert n == value(before, "routereplay_requests_total", endpoint=endpoint, **status) + 1
        if phase == "prefill":  # aborted mid-prefill: its prompt was never counted as prefilled
            p = "vllm:prompt_tokens_total"
            assert value(after, p) == value(before, p)
        if request_id is not None:
            assert c.get(f"/v1/routes/{request_id}-0").status_code == 404
        serves_alone(metered, c, f"{_test_hold.PREFIX}alone-{salt}")


# -- vLLM's metrics --------------------------------------------------------------------------------
def test_engine_metrics_beside_the_service_metrics(metered: Metered) -> None:
    prompt = token_prompt(100, 300)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
    with metered.client() as c:
        before = scrape(c)
        usages = [c.post("/v1/completions", json=body).json()["usage"] for _ in range(2)]
        cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 128  # the second prompt hits the prefix cache (128-token blocks)

        def delta(m: Samples, name: str, **labels: str) -> float:
            return value(m, name, **labels) - value(before, name, **labels)

        def counted() -> bool:
            return delta(scrape(c), "vllm:generation_tokens_total") == 10

        wait_for(counted, "the engine's counters")
        wait_for(lambda: idle(scrape(c)), "the engine's gauges back at idle")
        m = scrape(c)
        assert delta(m, "vllm:prompt_tokens_total") == 600
        assert delta(m, "vllm:prefix_cache_queries_total") == 600
        assert delta(m, "vllm:prefix_cache_hits_total") == cached
        assert delta(m, "routereplay_prompt_tokens_total") == 600
        assert delta(m, "routereplay_requests_total", endpoint="completions", status="200") == 2
        assert delta(m, "vllm:e2e_request_latency_seconds_count") == 2
        assert 0 <= value(m, "vllm:kv_cache_usage_perc") <= 1
        engine = frozenset({"model_name": MODEL_NAME, "engine": "0"}.items())
        for name in (
            "vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:num_preemptions_total", "vllm:kv_cache_usage_perc",
        ):  # fmt: skip
            assert (name, engine) in m, name


def test_metrics_exposition_and_access(metered: Metered) -> None:
    with metered.client() as c:
        r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    types = [ln.split()[2] for ln in r.text.splitlines() if ln.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a metric family appears twice"
    assert any(t.startswith("vllm:") for t in types)
    assert any(t.startswith("routereplay_") for t in types)
    # Multiprocess mode: vLLM's values come from the files its processes write.
    assert list(metered.multiproc_dir.glob("*.db"))
    # Access is as for every endpoint but /health: a key.
    for headers in ({}, {"Authorization": "Bearer " + "x" * 32}):
        denied = httpx.get(f"{metered.url}/metrics", headers=headers, timeout=PATIENCE_S)
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"


def test_engine_metrics_without_multiprocess_mode(service: Service, http: httpx.Client) -> None:
    body = {"model": service.model, "prompt": "count me", "max_tokens": 3, "ignore_eos": True}
    before = scrape(http)
    assert http.post("/v1/completions", json=body).status_code == 200

    def counted() -> bool:
        m = scrape(http)
        p = "vllm:generation_tokens_total"
        return value(m, p) - value(before, p) == 3

    wait_for(counted, "the engine's counters")
    m = scrape(http)
    assert value(m, "vllm:prompt_tokens_total") > value(before, "vllm:prompt_tokens_total")
    assert value(m, "routereplay_requests_total", endpoint="completions", status="200") >= 1
