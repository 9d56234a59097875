"""``routereplay loadtest`` against the synthetic backend behind a real uvicorn: every route the
service reported stored is fetched back and checked; a damaged store is caught."""

from __future__ import annotations

import json

import redis

from routereplay.bench.loadtest import main

from .conftest import LiveServer


def test_loadtest_verifies_every_route(live_server: LiveServer, capsys) -> None:
    live_server.backend.step_delay_s = 0.0
    rc = main(["--url", live_server.url, "--requests", "80", "--concurrency", "8", "--n", "2",
               "--max-tokens", "6", "--json"])  # fmt: skip
    out = capsys.readouterr().out
    report = json.loads(out)
    assert rc == 0, out
    assert report["ok"] == 80 and report["errors"] == {}
    assert report["routes"] == {"stored": 160, "failed": 0, "verified": 160, "lost": 0, "wrong": 0}
    assert report["latency_s"]["p50"] > 0


def test_loadtest_refuses_remote_targets(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["--url", "http://example.com:8000"])
    assert e.value.code == 2 and "loopback" in capsys.readouterr().err


def test_loadtest_catches_lost_routes(live_server: LiveServer, redis_url: str, capsys) -> None:
    """Routes deleted behind the service's back between the load and the check are lost."""
    import routereplay.bench.loadtest as lt

    real = lt.AsyncRoutesClient

    class Deleting(real):  # a real client, after a real deletion of every chunk in Redis
        async def get_many(self, ids, **kw):
            r = redis.Redis.from_url(redis_url)
            try:
                for key in r.scan_iter(f"{live_server.prefix}:c:*"):
                    r.delete(key)
            finally:
                r.close()
            return await super().get_many(ids, **kw)

    lt.AsyncRoutesClient = Deleting
    try:
        rc = main(["--url", live_server.url, "--requests", "4", "--concurrency", "2", "--json"])
    finally:
        lt.AsyncRoutesClient = real
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and report["routes"]["lost"] == 4 and report["passed"] is False, report
