"""API keys and tenants: every endpoint but /health needs a key, each key's tenant owns its
routes, admin keys reach all of them; Redis AUTH + TLS through the URL; no secret in any
response or log line."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from routereplay.client import AsyncRoutesClient, RouteNotFoundError, RouteServiceError
from routereplay.local_redis import free_port

from .conftest import BASE, MODEL, App, running_app, wait_for

ALICE = "alice:" + "a" * 32
BOB = "bob:" + "b" * 32
ROOT = "ops:" + "r" * 32


def bearer(entry: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {entry.split(':', 1)[1]}"}


@pytest.fixture()
async def keyed(redis_url: str, tmp_path: Path) -> AsyncIterator[App]:
    keys = tmp_path / "keys"
    keys.write_text(f"# tenants\n{ALICE}\n\n{BOB}\n")
    async with running_app(redis_url, api_keys_file=keys, admin_keys=[ROOT]) as svc:
        yield svc


BODY = {"model": MODEL, "prompt": "tenant data", "max_tokens": 3, "return_token_ids": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
PROTECTED = [
    ("POST", "/v1/completions", BODY),
    ("POST", "/v1/chat/completions", CHAT),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [65]}),
    ("GET", "/v1/routes/x-0", None),
    ("DELETE", "/v1/routes/x-0", None),
    ("POST", "/v1/routes:batch", {"ids": ["x-0"]}),
    ("GET", "/metrics", None),
    ("POST", "/invocations", BODY),
    ("GET", "/version", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
async def test_every_endpoint_needs_a_key(keyed: App, method: str, path: str, body) -> None:
    for headers in ({}, {"Authorization": "Bearer " + "z" * 32}, {"Authorization": "Basic YTpi"},
                    {"Authorization": "Bearer"}):  # fmt: skip
        r = await keyed.http.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, (path, headers, r.text)
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and isinstance(err["code"], str)
        assert r.headers["www-authenticate"] == "Bearer"
    r = await keyed.http.request(method, path, json=body, headers=bearer(ALICE))
    assert r.status_code != 401, r.text


async def test_health_and_ready_stay_open(keyed: App) -> None:
    assert (await keyed.http.get("/health")).status_code == 200
    assert (await keyed.http.get("/ping")).json() == {"status": "ok"}
    assert (await keyed.http.post("/ping")).status_code == 200
    assert (await keyed.http.get("/ready")).json() == {"status": "ready"}


async def test_metrics_open_opens_metrics_only(redis_url: str) -> None:
    """--metrics-open: a scraper without credentials reads /metrics; nothing else opens, and
    the exposition names no tenant."""
    async with running_app(redis_url, api_keys=[ALICE], metrics_open=True) as svc:
        assert (await svc.http.post("/v1/completions", json=BODY, headers=bearer(ALICE))).is_success
        r = await svc.http.get("/metrics")
        assert r.status_code == 200 and "routereplay_requests_total" in r.text
        assert "alice" not in r.text
        for method, path, body in PROTECTED:
            if path != "/metrics":
                r = await svc.http.request(method, path, json=body)
                assert r.status_code == 401, (path, r.text)


async def test_tenants_cannot_reach_each_others_routes(keyed: App) -> None:
    http = keyed.http
    shared = {"X-Request-Id": "same-id"}
    a = await http.post("/v1/completions", json=BODY, headers={**bearer(ALICE), **shared})
    assert a.status_code == 200
    alice_tokens = a.json()["choices"][0]["prompt_token_ids"] + a.json()["choices"][0]["token_ids"]
    # Bob sees nothing of it, cannot delete it, and reusing its id lands in his own namespace.
    assert (await http.get("/v1/routes/same-id-0", headers=bearer(BOB))).status_code == 404
    assert (await http.delete("/v1/routes/same-id-0", headers=bearer(BOB))).status_code == 404
    b = await http.post("/v1/completions", json={**BODY, "prompt": "bob's own"},
                        headers={**bearer(BOB), **shared})  # fmt: skip
    assert b.status_code == 200
    mine = (await http.get("/v1/routes/same-id-0?format=json", headers=bearer(ALICE))).json()
    assert mine["token_ids"] == alice_tokens
    # Naming another tenant needs an admin key.
    r = await http.get("/v1/routes/same-id-0?tenant=bob", headers=bearer(ALICE))
    assert r.status_code == 403 and r.json()["error"]["param"] == "tenant"
    # The admin reaches both, and may delete any.
    r = await http.get("/v1/routes/same-id-0?tenant=alice&format=json", headers=bearer(ROOT))
    assert r.json()["token_ids"] == alice_tokens
    r = await http.delete("/v1/routes/same-id-0?tenant=bob", headers=bearer(ROOT))
    assert r.status_code == 200
    assert (await http.get("/v1/routes/same-id-0", headers=bearer(BOB))).status_code == 404
    assert (await http.get("/v1/routes/same-id-0", headers=bearer(ALICE))).status_code == 200
    # In Redis each tenant's keys live under its own prefix.
    raw = redis.Redis.from_url(keyed.redis_url)
    try:
        assert list(raw.scan_iter(f"{keyed.prefix}:t:alice:{{same-id-0}}:m"))
        assert not list(raw.scan_iter(f"{keyed.prefix}:{{same-id-0}}:m"))
    finally:
        raw.close()


async def test_sdk_and_routes_client_with_keys(keyed: App) -> None:
    client = openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key=ALICE.split(":", 1)[1],
                                http_client=keyed.http, max_retries=0)  # fmt: skip
    r = await client.completions.create(model=MODEL, prompt="sdk", max_tokens=2)
    rid = r.choices[0].routed_experts["route_id"]
    transport = httpx.ASGITransport(app=keyed.app)
    async with AsyncRoutesClient(BASE, transport=transport,
                                 api_key=ALICE.split(":", 1)[1]) as rc:  # fmt: skip
        assert (await rc.get(rid)).token_ids.tolist()[:3] == list(b"sdk")
    async with AsyncRoutesClient(BASE, transport=transport, api_key=BOB.split(":", 1)[1]) as rc:
        with pytest.raises(RouteNotFoundError):
            await rc.get(rid)
    async with AsyncRoutesClient(BASE, transport=transport) as rc:
        with pytest.raises(RouteServiceError, match="401"):
            await rc.get(rid)


def test_bad_key_configuration_is_a_usage_error(tmp_path: Path) -> None:
    import sys

    for flags in (["--api-keys", "alice:short"], ["--api-keys-file", str(tmp_path / "none")],
                  ["--api-keys", "bad tenant!:" + "x" * 20]):  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "routereplay.cli", "serve", "--backend",
                            "synthetic", "--port", str(free_port()), *flags],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


# -- Redis AUTH + TLS ------------------------------------------------------------------------------
PASSWORD = "s3cret-redis-pass-" + "x" * 8


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A redis-server that accepts only TLS connections with a password; (host:port, CA)."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
         "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", str(d),
         "--tls-cert-file", str(d / "cert.pem"), "--tls-key-file", str(d / "key.pem"),
         "--tls-ca-cert-file", str(d / "cert.pem"), "--tls-auth-clients", "no",
         "--requirepass", PASSWORD],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, ssl=True,
                         ssl_ca_certs=str(d / "cert.pem"))  # fmt: skip

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            assert proc.poll() is None, "redis-server exited"
            return False

    wait_for(answers, "the TLS redis-server answering")
    client.close()
    try:
        yield f"127.0.0.1:{port}", d / "cert.pem"
    finally:
        proc.kill()
        proc.wait()


async def test_redis_auth_and_tls_and_no_secret_leaks(tls_redis, caplog) -> None:
    import logging

    caplog.set_level(logging.DEBUG)
    hostport, ca = tls_redis
    url = f"rediss://:{PASSWORD}@{hostport}/0?ssl_ca_certs={ca}"
    async with running_app(url) as svc:
        r = await svc.http.post("/v1/completions", json=BODY)
        h = r.json()["choices"][0]["routed_experts"]
        assert h["status"] == "stored", h
        rec = (await svc.http.get(f"/v1/routes/{h['route_id']}?format=json")).json()
        assert rec["token_ids"][:6] == list(b"tenant")
        assert (await svc.http.get("/ready")).status_code == 200
    # Plain TCP, or the wrong password: refused, and nothing says the password.
    seen: list[str] = []
    for bad in (f"redis://:{PASSWORD}@{hostport}/0",
                f"rediss://:wrong-{PASSWORD}@{hostport}/0?ssl_ca_certs={ca}"):  # fmt: skip
        async with running_app(bad, store_timeout_s=3) as svc:
            r = await svc.http.post("/v1/completions", json=BODY)
            seen.append(r.text)
            assert r.json()["choices"][0]["routed_experts"]["status"] == "failed"
            ready = await svc.http.get("/ready")
            seen.append(ready.text)
            assert ready.status_code == 503
            r = await svc.http.get("/v1/routes/x-0")
            seen.append(r.text)
            assert r.status_code >= 400
    text = "\n".join(seen) + caplog.text + json.dumps([r.getMessage() for r in caplog.records])
    assert PASSWORD not in text
    assert "***" in text  # the URLs were there, redacted


RL_CALLS = [
    ("POST", "/pause", None), ("POST", "/resume", None), ("GET", "/is_paused", None),
    ("POST", "/abort_requests", {}), ("POST", "/update_weight_version", {"new_version": "x"}),
    ("GET", "/weight_info", None), ("GET", "/weight_update", None),
    ("POST", "/reload_weights", {"weights_path": "step-1"}),
    ("POST", "/init_weight_transfer_engine", {"init_info": {"master_address": "10.0.0.1"}}),
    ("POST", "/start_weight_update", None), ("POST", "/finish_weight_update", {}),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body"), RL_CALLS)
async def test_without_keys_the_rl_api_is_closed(
    redis_url: str, method: str, path: str, body
) -> None:
    """Open mode opens completions and routes, never the calls that change the engine."""
    async with running_app(redis_url) as svc:
        r = await svc.http.request(method, path, json=body)
        err = r.json()["error"]
        assert (r.status_code, err["code"]) == (403, "permission_denied"), r.text
        assert "--admin-keys" in err["message"] and "--unsafe-no-auth" in err["message"]
        assert svc.backend.version == "default" and not await svc.backend.rl.is_paused()
        ok = await svc.http.post("/v1/completions", json=BODY)
        assert ok.status_code == 200, ok.text
        rid = ok.json()["id"]
        assert (await svc.http.get(f"/v1/routes/{rid}-0")).status_code == 200


async def test_unsafe_no_auth_opens_the_rl_api(redis_url: str) -> None:
    async with running_app(redis_url, unsafe_no_auth=True) as svc:
        r = await svc.http.post("/pause", params={"mode": "keep"})
        assert r.json() == {"status": "paused"}, r.text
        assert (await svc.http.post("/resume")).json() == {"status": "resumed"}


async def test_keys_make_unsafe_no_auth_moot(redis_url: str) -> None:
    """With keys, the RL API takes an admin key whatever the flag says."""
    async with running_app(redis_url, api_keys=[ALICE], unsafe_no_auth=True) as svc:
        r = await svc.http.post("/pause", headers=bearer(ALICE))
        assert r.status_code == 403, r.text
        assert (await svc.http.post("/pause")).status_code == 401
