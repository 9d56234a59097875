"""RoutesClient (sync) and AsyncRoutesClient (asyncio): the service's retrieval API over httpx.

Endpoints (see docs/CONTRACTS.md):
    GET    /v1/routes/{route_id}?start=N   -> one binary record
    POST   /v1/routes:batch                -> the stored bytes (manifests + distinct chunks);
                                              the client assembles and verifies each record
    DELETE /v1/routes/{route_id}

Requests are built and responses parsed by module functions shared by both clients, so they
differ only in ``await``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx

from ._batch import BATCH_MEDIA_TYPE, RawBatch, resolve_results
from ._codec import MEDIA_TYPE, decode_record
from ._errors import (
    RouteConnectionError,
    RouteCorruptError,
    RouteError,
    RouteLimitError,
    RouteNotFoundError,
    RouteServiceError,
)
from ._keys import validate_route_id
from ._layout import check_stop, finish_read, plan_read
from ._limits import DEFAULT_LIMITS, ReadLimits
from ._record import RouteRecord
from ._threads import DecodePool, default_decode_threads

__all__ = ["AsyncRoutesClient", "RoutesClient"]

_DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=5.0)


def response_cap(limits: ReadLimits) -> int:
    """The most bytes a client reads of one response: one record at ``limits.max_bytes``
    decoded, stored as compressed frames (zstd can grow incompressible bytes by under 1/128),
    plus room for the framing. A service's batch responses stay far below (it defers ids past
    its own cap, 64 MiB by default)."""
    return limits.max_bytes + limits.max_bytes // 64 + (1 << 20)


def _capped(resp: httpx.Response, body: bytes) -> httpx.Response:
    return httpx.Response(resp.status_code, headers=resp.headers, content=body,
                          request=resp.request)  # fmt: skip


def _too_large(resp: httpx.Response, cap: int) -> RouteLimitError:
    return RouteLimitError(
        f"the response to {resp.request.method} {resp.request.url.path} is over this client's "
        f"{cap} bytes (ReadLimits(max_bytes=...) raises it); nothing past that was read"
    )


def _declared(resp: httpx.Response, cap: int) -> None:
    length = resp.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise _too_large(resp, cap)


def _with_key(headers: dict[str, str] | None, api_key: str | None) -> dict[str, str]:
    """``headers`` plus the service's bearer key (``api_key``: the same key an OpenAI client of
    the service uses; it selects the tenant whose routes are read)."""
    out = dict(headers or {})
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def _raise_for(resp: httpx.Response, route_id: str | None = None) -> None:
    if resp.is_success:
        return
    message, type_, param = resp.text, "", None
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):  # not JSON, or JSON that is not an object
        err = None
    if isinstance(err, dict):  # the OpenAI error schema; anything else keeps the raw text
        message = str(err.get("message", message))
        type_, param = str(err.get("type", "")), err.get("param")
    if resp.status_code == 404 and route_id is not None:
        raise RouteNotFoundError(route_id, message)
    raise RouteServiceError(resp.status_code, message, type_, param)


def _get_request(route_id: str, start: int, stop: int | None) -> tuple[str, dict[str, Any]]:
    validate_route_id(route_id)
    check_stop(start, stop)
    params = {"start": start} if start else {}
    if stop is not None:
        params["stop"] = stop
    return f"/v1/routes/{route_id}", {"params": params, "headers": {"Accept": MEDIA_TYPE}}


def _parse_get(resp: httpx.Response, route_id: str, limits: ReadLimits) -> RouteRecord:
    _raise_for(resp, route_id)
    what = f"route {route_id!r} from the service"
    return decode_record(resp.content, what=what, limits=limits)


class _BatchRead:
    """One ``get_many`` over HTTP: requests until no id is deferred (the service caps the bytes
    of one response), then every record assembled and verified here from the stored bytes."""

    def __init__(
        self, route_ids: Sequence[str], start: int, stop: int | None, limits: ReadLimits
    ) -> None:
        self.ids = [validate_route_id(r) for r in route_ids]
        check_stop(start, stop)
        self.start, self.stop = start, stop
        self.limits = limits
        self.pending = list(dict.fromkeys(self.ids))
        self.got = RawBatch()

    def next_request(self) -> dict[str, Any] | None:
        if not self.pending:
            return None
        return {
            "json": {"ids": self.pending, "start": self.start},
            "headers": {"Accept": BATCH_MEDIA_TYPE},
        }

    def add(self, resp: httpx.Response) -> None:
        _raise_for(resp)
        part = RawBatch.unpack(resp.content)
        # Only ids still asked for can be deferred: a server naming others cannot grow the
        # loop, and each round must settle at least one id, so there are at most len(ids).
        asked = set(self.pending)
        deferred = [i for i in dict.fromkeys(part.deferred) if i in asked]
        if len(deferred) >= len(asked):
            raise RouteCorruptError("the service made no progress on a batch (every id deferred)")
        self.got.manifests.update(part.manifests)
        self.got.chunks.update(part.chunks)
        self.got.errors.update(part.errors)
        self.pending = deferred

    def results(self, missing_ok: bool, return_exceptions: bool, decoder: DecodePool) -> list[Any]:
        manifests = [self.got.manifests.get(i) for i in self.ids]
        # The batch endpoint sends each record's chunks from start on; only the window's decode.
        plan = plan_read(self.ids, manifests, self.start, self.limits, stop=self.stop)
        pool = decoder.get()
        parts = 2 * decoder.threads if pool is not None else 1
        results: list[RouteRecord | RouteError | None] = finish_read(
            plan, self.got.chunks, pool, parts
        )
        for n, rid in enumerate(self.ids):
            if rid in self.got.errors:
                results[n] = self.got.errors[rid]
        return resolve_results(
            self.ids, results, missing_ok=missing_ok, return_exceptions=return_exceptions
        )


def _parse_delete(resp: httpx.Response, route_id: str) -> bool:
    if resp.status_code == 404:
        return False
    _raise_for(resp, route_id)
    return True


class RoutesClient:
    """Fetch and delete route records through a routereplay service.

    >>> with RoutesClient("http://127.0.0.1:8000") as rc:
    ...     rec = rc.get(resp.choices[0].routed_experts["route_id"])
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | httpx.Timeout = _DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
        headers: dict[str, str] | None = None,
        api_key: str | None = None,
        decode_threads: int | None = None,
        limits: ReadLimits | None = None,
    ) -> None:
        """``decode_threads``: threads that decode a batch's chunks (default
        :func:`default_decode_threads`; 1 decodes on the calling thread). ``limits``: what one
        record may declare before it is allocated (default :class:`ReadLimits`); a larger one
        is that id's :class:`RouteLimitError`, and no response is read past
        :func:`response_cap` of them (4.06 GiB by default)."""
        self._decoder = DecodePool(decode_threads or default_decode_threads())
        self.limits = limits or DEFAULT_LIMITS
        self._http = httpx.Client(
            base_url=base_url,
            timeout=timeout,
            transport=transport,
            headers=_with_key(headers, api_key),
        )

    def _send(self, method: str, url: str, **kw: Any) -> httpx.Response:
        """The response, its body read up to :func:`response_cap` (RouteLimitError past it)."""
        cap = response_cap(self.limits)
        try:
            with self._http.stream(method, url, **kw) as resp:
                _declared(resp, cap)
                body = bytearray()
                for part in resp.iter_bytes():
                    body += part
                    if len(body) > cap:
                        raise _too_large(resp, cap)
        except httpx.TransportError as exc:
            raise RouteConnectionError(f"routereplay service {self._http.base_url}: {exc}") from exc
        return _capped(resp, bytes(body))

    def get(self, route_id: str, *, start: int = 0, stop: int | None = None) -> RouteRecord:
        """The record for ``route_id``, rows ``start..stop`` (as :meth:`RouteStore.get`)."""
        url, kw = _get_request(route_id, start, stop)
        return _parse_get(self._send("GET", url, **kw), route_id, self.limits)

    def get_many(
        self,
        route_ids: Sequence[str],
        *,
        start: int = 0,
        stop: int | None = None,
        missing_ok: bool = False,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Records for ``route_ids`` in order (as :meth:`RouteStore.get_many`): one request
        unless the service defers some ids past its byte cap; shared prefixes cross once."""
        read = _BatchRead(route_ids, start, stop, self.limits)
        while (req := read.next_request()) is not None:
            read.add(self._send("POST", "/v1/routes:batch", **req))
        return read.results(missing_ok, return_exceptions, self._decoder)

    def delete(self, route_id: str) -> bool:
        """Delete a record; False if it did not exist."""
        validate_route_id(route_id)
        return _parse_delete(self._send("DELETE", f"/v1/routes/{route_id}"), route_id)

    def close(self) -> None:
        self._http.close()
        self._decoder.close()

    def __enter__(self) -> RoutesClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRoutesClient:
    """asyncio twin of :class:`RoutesClient`."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | httpx.Timeout = _DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: dict[str, str] | None = None,
        api_key: str | None = None,
        decode_threads: int | None = None,
        limits: ReadLimits | None = None,
    ) -> None:
        self._decoder = DecodePool(decode_threads or default_decode_threads())
        self.limits = limits or DEFAULT_LIMITS
        self._http = httpx.AsyncClient(
            base_url=base_url,
            timeout=timeout,
            transport=transport,
            headers=_with_key(headers, api_key),
        )

    async def _send(self, method: str, url: str, **kw: Any) -> httpx.Response:
        """See :meth:`RoutesClient._send`."""
        cap = response_cap(self.limits)
        try:
            async with self._http.stream(method, url, **kw) as resp:
                _declared(resp, cap)
                body = bytearray()
                async for part in resp.aiter_bytes():
                    body += part
                    if len(body) > cap:
                        raise _too_large(resp, cap)
        except httpx.TransportError as exc:
            raise RouteConnectionError(f"routereplay service {self._http.base_url}: {exc}") from exc
        return _capped(resp, bytes(body))

    async def get(self, route_id: str, *, start: int = 0, stop: int | None = None) -> RouteRecord:
        """See :meth:`RoutesClient.get`."""
        url, kw = _get_request(route_id, start, stop)
        resp = await self._send("GET", url, **kw)
        return await asyncio.to_thread(_parse_get, resp, route_id, self.limits)

    async def get_many(
        self,
        route_ids: Sequence[str],
        *,
        start: int = 0,
        stop: int | None = None,
        missing_ok: bool = False,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """See :meth:`RoutesClient.get_many`."""
        read = _BatchRead(route_ids, start, stop, self.limits)
        while (req := read.next_request()) is not None:
            read.add(await self._send("POST", "/v1/routes:batch", **req))
        # Decoding a training step's records takes a large fraction of a second: never on
        # the event loop, which serves the caller's other tasks meanwhile.
        return await asyncio.to_thread(read.results, missing_ok, return_exceptions, self._decoder)

    async def delete(self, route_id: str) -> bool:
        """See :meth:`RoutesClient.delete`."""
        validate_route_id(route_id)
        return _parse_delete(await self._send("DELETE", f"/v1/routes/{route_id}"), route_id)

    async def aclose(self) -> None:
        await self._http.aclose()
        self._decoder.close()

    async def __aenter__(self) -> AsyncRoutesClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
