"""The app factory: ``create_app(settings)`` composes backend, store, capture and handlers.

Nothing happens at import or in ``create_app`` itself; the engine starts and Redis is connected in
the app's lifespan (a backend or store passed in is used as is and left open).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgpack
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from routereplay.client import (
    BATCH_MEDIA_TYPE,
    MEDIA_TYPE,
    AsyncRouteStore,
    RouteConnectionError,
    RouteNotFoundError,
    RouteShapeError,
    encode_record,
    validate_route_id,
)

from .capture import RouteCapture
from .engine import EngineBackend, GenerationRequest
from .errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    ServiceError,
    StoreUnavailableError,
)
from .metrics import ServiceMetrics
from .protocol import BatchRoutesRequest, ChatCompletionRequest, CompletionRequest
from .serving import CompletionServer
from .settings import Settings

__all__ = ["create_app", "make_backend"]

log = logging.getLogger("routereplay.service")

# Route ids are f"{request_id}-{choice}" and at most 128 characters: leave room for the suffix.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,120}")


def make_backend(settings: Settings) -> EngineBackend:
    """The backend ``settings`` select (not started)."""
    if settings.backend == "upstream":
        from .upstream import UpstreamBackend

        if not settings.upstream_url:
            raise ValueError("backend=upstream needs upstream_url (ROUTEREPLAY_UPSTREAM_URL)")
        return UpstreamBackend(
            settings.upstream_url,
            served_model_name=settings.served_model_name,
            model_config_path=settings.model,
            timeout_s=settings.upstream_timeout_s,
        )
    from .vllm_engine import VllmBackend

    model = settings.model
    dtype = settings.dtype
    if model is None:
        from .tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model(settings.tiny_variant, settings.model_dir))
        # float32 keeps the tiny model's routes exact against any other float32 engine.
        dtype = "float32" if dtype == "auto" else dtype
    return VllmBackend(
        model,
        served_model_name=settings.resolved_model_name(),
        dtype=dtype,
        max_model_len=settings.max_model_len,
        seed=settings.seed,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enforce_eager=settings.enforce_eager,
        tensor_parallel_size=settings.tensor_parallel_size,
        extra_engine_args=settings.engine_args,
    )


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` unless the client disconnects first (then cancel it and return None).

    A cancelled completion closes its engine stream, which aborts the request in the engine:
    RL clients that time out and retry must not leave orphaned generations behind.
    """

    async def disconnected() -> None:
        # The body has been read, so the next ASGI message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


class _InflightIds:
    """Client-chosen request ids now being served.

    Route ids derive from the request id, so two concurrent requests with one X-Request-Id (a
    client that timed out and retried while the first still runs) would overwrite each other's
    routes, and a response's handle could name the other generation's record. A second request
    with an id in flight gets 409; a retry after the first finished overwrites (idempotent). A
    claim also lapses after ``max_age_s``, so a stream the server never started cannot hold an id
    forever.
    """

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._since: dict[str, float] = {}

    def claim(self, rid: str) -> None:
        now = time.monotonic()
        since = self._since.get(rid)
        if since is not None and now - since < self.max_age_s:
            raise ConflictError(
                f"X-Request-Id {rid!r} is already in flight; its routes would overwrite each "
                "other: wait for it or use a new id",
                param="X-Request-Id",
                code="request_id_in_flight",
            )
        self._since[rid] = now

    def release(self, rid: str | None) -> None:
        if rid is not None:
            self._since.pop(rid, None)


class _State:
    """Everything a handler needs, built in the lifespan."""

    backend: EngineBackend
    store: AsyncRouteStore
    server: CompletionServer


def create_app(
    settings: Settings | None = None,
    *,
    backend: EngineBackend | None = None,
    store: AsyncRouteStore | None = None,
) -> FastAPI:
    """Build the ASGI app; a ``backend``/``store`` passed in is used as is and not closed."""
    settings = settings or Settings()
    metrics = ServiceMetrics()
    st = _State()
    # A leaked claim (a stream never started) lapses after the longest a request may run.
    inflight_ids = _InflightIds(settings.upstream_timeout_s + settings.store_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if store is None:
                url = settings.redis_url
                if url is None:
                    from routereplay.client._local_redis import redis_server

                    url = stack.enter_context(redis_server(settings.local_redis_maxmemory))
                    log.info("no Redis configured; started a local redis-server at %s", url)
                st.store = AsyncRouteStore.from_url(
                    url, prefix=settings.route_prefix, ttl_s=settings.route_ttl_s,
                    block_size=settings.block_size,
                )  # fmt: skip
                stack.push_async_callback(st.store.close)
            else:
                st.store = store
            if backend is None:
                st.backend = make_backend(settings)
                await st.backend.start()
                stack.push_async_callback(st.backend.close)
            else:
                st.backend = backend
            metrics.bind_queue_depth(st.backend.num_unfinished)
            capture = RouteCapture(
                st.store, st.backend.info, metrics, ttl_s=settings.route_ttl_s,
                timeout_s=settings.store_timeout_s, offload_bytes=settings.offload_bytes,
            )  # fmt: skip
            st.server = CompletionServer(st.backend, capture, metrics)
            yield

    app = FastAPI(title="routereplay", lifespan=lifespan)
    app.state.rr = st
    app.state.metrics = metrics
    app.state.settings = settings

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RouteConnectionError)
    async def _store_down(request: Request, exc: RouteConnectionError) -> JSONResponse:
        err = StoreUnavailableError(f"route store unavailable: {exc}")
        return JSONResponse(err.body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        err = ServiceError(f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.body(), status_code=500)

    # -- completions ------------------------------------------------------------------------------
    async def _parse(request: Request, model_cls: type) -> tuple[Any, dict[str, Any]]:
        """Body -> (validated model, raw dict); 400 naming the field on any problem."""
        try:
            raw = json.loads(await request.body())
        except ValueError as e:
            raise InvalidRequestError(f"request body is not valid JSON: {e}", param="body") from e
        if not isinstance(raw, dict):
            raise InvalidRequestError("request body must be a JSON object", param="body")
        try:
            return model_cls.model_validate(raw), raw
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise InvalidRequestError(f"{param}: {err['msg']}", param=param) from e

    async def _parse_completion(request: Request, model_cls: type) -> tuple[Any, dict[str, Any]]:
        parsed, raw = await _parse(request, model_cls)
        info = st.backend.info
        if parsed.model != info.name:
            raise NotFoundError(
                f"model {parsed.model!r} does not exist; this server serves {info.name!r}",
                param="model",
                code="model_not_found",
            )
        rt = parsed.requested_max_tokens
        if rt is not None and rt > info.max_model_len:
            field = parsed.max_tokens_field
            raise InvalidRequestError(
                f"{field}={rt} exceeds the model's context of {info.max_model_len} tokens",
                param=field,
            )
        return parsed, raw

    def _request_id(request: Request, prefix: str) -> str:
        rid = request.headers.get("x-request-id")
        if rid is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not _REQUEST_ID.fullmatch(rid):
            raise InvalidRequestError(
                f"X-Request-Id {rid[:64]!r} is invalid: use 1-120 characters of [A-Za-z0-9._:-]",
                param="X-Request-Id",
                code="invalid_request_id",
            )
        return rid

    def _done(endpoint: str, t0: float, status: int) -> None:
        metrics.inflight.dec()
        metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - t0)

    async def _measured(
        body: AsyncIterator[bytes], endpoint: str, t0: float, claimed: str | None
    ) -> AsyncIterator[bytes]:
        # A stream's request ends with its last chunk, not when the handler returns.
        try:
            async for chunk in body:
                yield chunk
        finally:
            inflight_ids.release(claimed)
            _done(endpoint, t0, 200)

    async def _serve(request: Request, kind: str, model_cls: type, endpoint: str) -> Response:
        t0 = time.perf_counter()
        metrics.inflight.inc()
        claimed: str | None = None  # released here, or by the stream once it owns it
        try:
            rid = _request_id(request, "chatcmpl" if kind == "chat" else "cmpl")
            if "x-request-id" in request.headers:  # generated ids are unique already
                inflight_ids.claim(rid)
                claimed = rid
            parsed, raw = await _parse_completion(request, model_cls)
            greq = GenerationRequest(
                kind=kind, request=parsed, request_id=rid,
                # Unique per call: vLLM aborts by id, and a client may reuse its X-Request-Id.
                engine_request_id=f"{rid}.{uuid.uuid4().hex[:8]}", raw=raw,
            )  # fmt: skip
            headers = {"X-Request-Id": rid}
            if parsed.stream:
                prompt_ids, events = await st.server.open(greq)
                body = st.server.stream(greq, prompt_ids, events)
                stream, claimed = _measured(body, endpoint, t0, claimed), None
                return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
            result = await _unless_disconnected(request, st.server.complete(greq))
        except ServiceError as e:
            _done(endpoint, t0, e.status_code)
            raise
        except BaseException:
            _done(endpoint, t0, 500)
            raise
        finally:
            inflight_ids.release(claimed)
        if result is None:
            # The client closed the request; its engine request was aborted.
            _done(endpoint, t0, 499)
            return Response(status_code=499)
        _done(endpoint, t0, 200)
        return JSONResponse(result, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, "chat", ChatCompletionRequest, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, "completion", CompletionRequest, "completions")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = st.backend.info
        return {
            "object": "list",
            "data": [{
                "id": info.name, "object": "model", "created": 0, "owned_by": "routereplay",
                "max_model_len": info.max_model_len,
                "routed_experts": {"num_layers": info.num_layers,
                                   "moe_layers": list(info.moe_layers),
                                   "num_experts": info.num_experts, "top_k": info.top_k},
            }],
        }  # fmt: skip

    # -- probes -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        # Liveness: a dead engine never comes back, so the process should be restarted.
        if st.backend.dead:
            return JSONResponse({"status": "engine_dead"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        problems: dict[str, str] = {}
        try:
            await st.backend.check_ready()
        except ServiceError as e:
            problems["engine"] = e.message
        try:
            await st.store.ping()
        except Exception as e:
            problems["redis"] = f"{type(e).__name__}: {e}"
        if problems:
            return JSONResponse({"status": "not_ready", **problems}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- retrieval --------------------------------------------------------------------------------
    def _route_id(route_id: str) -> str:
        try:
            return validate_route_id(route_id)
        except RouteShapeError as e:
            raise InvalidRequestError(
                f"route_id: {e}", param="route_id", code="invalid_route_id"
            ) from e

    def _start(request: Request) -> int:
        raw = request.query_params.get("start", "0")
        try:
            start = int(raw)
        except ValueError:
            start = -1
        if start < 0:
            raise InvalidRequestError(f"start={raw!r} must be an integer >= 0", param="start")
        return start

    async def _get(route_id: str, start: int) -> Any:
        try:
            return await st.store.get(route_id, start=start)
        except RouteNotFoundError as e:
            raise NotFoundError(
                f"route_id {route_id!r} not found (never stored, deleted or expired)",
                param="route_id",
                code="route_not_found",
            ) from e
        except RouteShapeError as e:
            raise InvalidRequestError(str(e), param="start") from e

    @app.post("/v1/routes:batch")
    async def routes_batch(request: Request) -> Response:
        parsed, _ = await _parse(request, BatchRoutesRequest)
        if len(parsed.ids) > settings.max_batch_ids:
            raise InvalidRequestError(
                f"ids: {len(parsed.ids)} ids, at most {settings.max_batch_ids} per batch",
                param="ids",
            )
        ids = [_route_id(i) for i in parsed.ids]
        try:
            recs = await st.store.get_many(ids, start=parsed.start, missing_ok=True)
        except RouteShapeError as e:
            raise InvalidRequestError(str(e), param="start") from e

        def pack() -> bytes:
            records = {i: encode_record(r) for i, r in zip(ids, recs, strict=True) if r}
            missing = [i for i, r in zip(ids, recs, strict=True) if r is None]
            return msgpack.packb({"records": records, "missing": missing}, use_bin_type=True)

        # Encoding up to max_batch_ids records is CPU work: keep it off the event loop, which
        # is streaming completions meanwhile.
        body = await asyncio.to_thread(pack)
        return Response(body, media_type=BATCH_MEDIA_TYPE)

    @app.get("/v1/routes/{route_id}")
    async def get_route(route_id: str, request: Request) -> Response:
        route_id = _route_id(route_id)
        rec = await _get(route_id, _start(request))
        as_json = request.query_params.get("format") == "json" or (
            "application/json" in request.headers.get("accept", "")
        )
        if not as_json:
            return Response(await asyncio.to_thread(encode_record, rec), media_type=MEDIA_TYPE)

        def as_dict() -> dict[str, Any]:
            return {
                "route_id": route_id, "model": rec.model, "token_ids": rec.token_ids.tolist(),
                "experts": rec.experts.tolist(), "valid": rec.valid.tolist(),
                "moe_layers": list(rec.moe_layers), "num_layers": rec.num_layers,
                "num_experts": rec.num_experts, "prompt_len": rec.prompt_len,
                "num_cached_tokens": rec.num_cached_tokens, "metadata": rec.metadata,
            }  # fmt: skip

        return JSONResponse(await asyncio.to_thread(as_dict))

    @app.delete("/v1/routes/{route_id}")
    async def delete_route(route_id: str) -> dict[str, Any]:
        route_id = _route_id(route_id)
        if not await st.store.delete(route_id):
            raise NotFoundError(
                f"route_id {route_id!r} not found", param="route_id", code="route_not_found"
            )
        return {"id": route_id, "deleted": True}

    return app
