"""RoutesClient (sync) and AsyncRoutesClient (asyncio): the service's retrieval API over httpx.

Endpoints (see docs/CONTRACTS.md):
    GET    /v1/routes/{route_id}?start=N   -> one binary record
    POST   /v1/routes:batch                -> msgpack {"records": {id: blob}, "missing": [...]}
    DELETE /v1/routes/{route_id}

Requests are built and responses parsed by module functions shared by both clients, so they
differ only in ``await``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import msgpack

from ._codec import BATCH_MEDIA_TYPE, MEDIA_TYPE, decode_record
from ._errors import (
    RouteConnectionError,
    RouteCorruptError,
    RouteNotFoundError,
    RouteServiceError,
)
from ._layout import validate_route_id
from ._record import RouteRecord

__all__ = ["AsyncRoutesClient", "RoutesClient"]

_DEFAULT_TIMEOUT = httpx.Timeout(30.0, connect=5.0)


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


def _get_request(route_id: str, start: int) -> tuple[str, dict[str, Any]]:
    validate_route_id(route_id)
    params = {"start": start} if start else {}
    return f"/v1/routes/{route_id}", {"params": params, "headers": {"Accept": MEDIA_TYPE}}


def _parse_get(resp: httpx.Response, route_id: str) -> RouteRecord:
    _raise_for(resp, route_id)
    return decode_record(resp.content, what=f"route {route_id!r} from the service")


def _batch_request(route_ids: Sequence[str], start: int) -> dict[str, Any]:
    ids = [validate_route_id(r) for r in route_ids]
    return {"json": {"ids": ids, "start": start}, "headers": {"Accept": BATCH_MEDIA_TYPE}}


def _parse_batch(
    resp: httpx.Response, route_ids: Sequence[str], missing_ok: bool
) -> list[RouteRecord | None]:
    _raise_for(resp)
    try:
        body = msgpack.unpackb(resp.content, raw=False)
        blobs: dict[str, bytes] = body["records"]
        missing = set(body.get("missing", []))
    except Exception as exc:
        raise RouteCorruptError(f"batch response from the service is malformed: {exc}") from exc
    if missing and not missing_ok:
        first = next(r for r in route_ids if r in missing)
        raise RouteNotFoundError(first, f"{len(missing)} of {len(route_ids)} ids not found")
    out: list[RouteRecord | None] = []
    for rid in route_ids:
        if rid in missing:
            out.append(None)
        elif rid not in blobs:
            raise RouteCorruptError(f"batch response lacks route {rid!r}")
        else:
            out.append(decode_record(blobs[rid], what=f"route {rid!r} from the service"))
    return out


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
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout, transport=transport, headers=headers
        )

    def _send(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            return self._http.request(method, url, **kw)
        except httpx.TransportError as exc:
            raise RouteConnectionError(f"routereplay service {self._http.base_url}: {exc}") from exc

    def get(self, route_id: str, *, start: int = 0) -> RouteRecord:
        """The record for ``route_id``, rows ``start..T``."""
        url, kw = _get_request(route_id, start)
        return _parse_get(self._send("GET", url, **kw), route_id)

    def get_many(
        self, route_ids: Sequence[str], *, start: int = 0, missing_ok: bool = False
    ) -> list[RouteRecord | None]:
        """Records for ``route_ids`` in order, in one request."""
        if not route_ids:
            return []
        resp = self._send("POST", "/v1/routes:batch", **_batch_request(route_ids, start))
        return _parse_batch(resp, route_ids, missing_ok)

    def delete(self, route_id: str) -> bool:
        """Delete a record; False if it did not exist."""
        validate_route_id(route_id)
        return _parse_delete(self._send("DELETE", f"/v1/routes/{route_id}"), route_id)

    def close(self) -> None:
        self._http.close()

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
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, transport=transport, headers=headers
        )

    async def _send(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            return await self._http.request(method, url, **kw)
        except httpx.TransportError as exc:
            raise RouteConnectionError(f"routereplay service {self._http.base_url}: {exc}") from exc

    async def get(self, route_id: str, *, start: int = 0) -> RouteRecord:
        """See :meth:`RoutesClient.get`."""
        url, kw = _get_request(route_id, start)
        return _parse_get(await self._send("GET", url, **kw), route_id)

    async def get_many(
        self, route_ids: Sequence[str], *, start: int = 0, missing_ok: bool = False
    ) -> list[RouteRecord | None]:
        """See :meth:`RoutesClient.get_many`."""
        if not route_ids:
            return []
        resp = await self._send("POST", "/v1/routes:batch", **_batch_request(route_ids, start))
        return _parse_batch(resp, route_ids, missing_ok)

    async def delete(self, route_id: str) -> bool:
        """See :meth:`RoutesClient.delete`."""
        validate_route_id(route_id)
        return _parse_delete(await self._send("DELETE", f"/v1/routes/{route_id}"), route_id)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRoutesClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
