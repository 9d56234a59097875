"""Reader limits at every reader: a stored record that declares more than a reader's
``ReadLimits`` is refused for that id alone, before any of its chunks is read or decoded
(RouteStore, the service's GET and batch endpoints, and a client over the batch bytes)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from routereplay.client import (
    AsyncRouteStore,
    RawBatch,
    ReadLimits,
    RouteLimitError,
    RouteRecord,
    RouteStore,
)
from routereplay.client._layout import finish_read, plan_read
from routereplay.service.errors import RouteTooLargeResponse
from routereplay.service.protocol import BatchRoutesRequest
from routereplay.service.serving.routes import ServingRoutes

LIMITS = ReadLimits(max_rows=64)


def _record(T: int) -> RouteRecord:
    rng = np.random.default_rng(T)
    return RouteRecord(
        token_ids=rng.integers(0, 1000, T), experts=rng.integers(0, 16, (T, 2, 4)).astype(np.uint8),
        valid=np.ones(T, bool), moe_layers=(0, 1), num_layers=2, num_experts=16,
    )  # fmt: skip


def test_a_store_refuses_only_the_record_over_its_limits(redis_url: str) -> None:
    store = RouteStore.from_url(redis_url, prefix=f"rl{uuid.uuid4().hex[:6]}", limits=LIMITS)
    try:
        store.put("big", _record(65))
        store.put("small", _record(64))
        big, small = store.get_many(["big", "small"], return_exceptions=True)
        assert isinstance(big, RouteLimitError) and "max_rows=64" in str(big)
        assert small == _record(64)
        with pytest.raises(RouteLimitError):
            store.get("big")
        # A tail read is sized by the whole record's manifest, as its chunks are.
        with pytest.raises(RouteLimitError):
            store.get("big", start=60)
    finally:
        store.close()
    plain = RouteStore.from_url(redis_url, prefix=store.keys.prefix)
    try:
        assert plain.get("big") == _record(65)  # the default limits read it
    finally:
        plain.close()


async def test_the_service_refuses_a_route_over_its_limits(redis_url: str) -> None:
    prefix = f"rl{uuid.uuid4().hex[:6]}"
    store = AsyncRouteStore.from_url(redis_url, prefix=prefix, limits=LIMITS)
    try:
        await store.put("big", _record(100))
        await store.put("small", _record(10))
        serving = ServingRoutes(max_batch_ids=16, max_batch_bytes=1 << 20)
        with pytest.raises(RouteTooLargeResponse, match="max_rows=64"):
            await serving.get(store, "big", 0, False)
        resp = await serving.batch(store, BatchRoutesRequest(ids=["big", "small"]))
        raw = RawBatch.unpack(resp.body)
    finally:
        await store.close()
    # The id over the limits crosses as its error alone (code route_too_large), no bytes.
    assert isinstance(raw.errors["big"], RouteLimitError) and "big" not in raw.manifests
    (small,) = finish_read(plan_read(["small"], [raw.manifests["small"]]), raw.chunks)
    assert small == _record(10)


async def test_the_service_reads_only_what_its_engine_could_have_written(redis_url: str) -> None:
    """The service bounds its reads by its own context and layout, not the library's 2M rows /
    4 GiB: a record one row past ``max_model_len``, or wider than its layers, is refused."""
    from routereplay.client import RouteStore
    from routereplay.service.engines.synthetic import SyntheticBackend

    from .conftest import running_app

    backend = SyntheticBackend(max_model_len=256)
    async with running_app(redis_url, backend=backend) as svc:
        info = svc.backend.info
        layers, E = info.moe_layers, info.num_experts

        def record(T: int, top_k: int) -> RouteRecord:
            rng = np.random.default_rng(T)
            return RouteRecord(
                token_ids=rng.integers(0, 100, T), valid=np.ones(T, bool),
                experts=rng.integers(0, E, (T, len(layers), top_k)).astype(np.uint8),
                moe_layers=layers, num_layers=info.num_layers, num_experts=E,
            )  # fmt: skip

        with RouteStore.from_url(redis_url, prefix=svc.prefix) as trusted:
            trusted.put("fits-0", record(256, info.top_k))
            trusted.put("long-0", record(257, info.top_k))
            trusted.put("wide-0", record(200, info.top_k * 2))  # twice the layout's bytes
        assert (await svc.http.get("/v1/routes/fits-0")).status_code == 200
        for rid, words in (("long-0", "max_rows=256"), ("wide-0", "max_bytes=")):
            r = await svc.http.get(f"/v1/routes/{rid}")
            err = r.json()["error"]
            assert (r.status_code, err["code"]) == (422, "route_too_large"), r.text
            assert words in err["message"], err["message"]


def test_a_client_stops_reading_a_response_past_its_cap() -> None:
    """A server that answers with endless bytes: the client reads up to its cap and stops."""
    import http.server
    import threading

    from routereplay.client import RoutesClient, response_cap

    sent: list[int] = []

    class Endless(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            n = 0
            try:
                while n < 1 << 30:
                    self.wfile.write(b"\0" * 65536)
                    n += 65536
            except OSError:  # the client hung up
                pass
            sent.append(n)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    limits = ReadLimits(max_bytes=1 << 20)
    try:
        with RoutesClient(f"http://127.0.0.1:{server.server_port}", limits=limits) as rc:
            with pytest.raises(
                RouteLimitError, match=rf"over this client's {response_cap(limits)}"
            ):
                rc.get("x-0")
    finally:
        server.shutdown()
    assert response_cap(limits) < 4 << 20
