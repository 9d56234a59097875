"""Request ids: the ``X-Request-Id`` policy (validate or generate) and in-flight claims.

Route ids are ``f"{request_id}-{choice}"``, so the request id decides where a generation's routes
land. Two concurrent requests with one client-chosen id (a client that timed out and retried while
the first still runs) would overwrite each other's routes, and a response's handle could name the
other generation's record: the second gets 409. The claim is a lease in Redis (``SET NX PX``), so
it holds across every replica that shares the store; a retry after the first finished reuses the
id and overwrites its routes (idempotent retries), and routes of the earlier generation that the
new one does not overwrite (it asked for fewer choices) are deleted.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass

from routereplay.client import AsyncRouteStore, RouteError

from .errors import ConflictError, InvalidRequestError, redact
from .protocol import MAX_N

__all__ = ["REQUEST_ID_PATTERN", "Claim", "RequestIds"]

log = logging.getLogger("routereplay.service")

# Route ids are at most 128 characters: leave room for the "-<choice>" suffix.
REQUEST_ID_PATTERN = r"[A-Za-z0-9._:-]{1,120}"
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


@dataclass
class Claim:
    request_id: str
    token: str
    store: AsyncRouteStore  # the namespace the id was claimed in
    in_redis: bool


class RequestIds:
    """Validates client ids, generates the others, and claims the client-chosen ones.

    A claim lapses after ``max_age_s`` (the longest a request may run), so a stream the server
    never finished cannot hold an id forever. If Redis cannot be reached the claim is held in
    this process only (routes cannot be stored then anyway) and a warning is logged.
    """

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._local: dict[tuple[str, str], float] = {}
        self._releases: set[asyncio.Task] = set()

    @staticmethod
    def resolve(header: str | None, prefix: str) -> str:
        """The request id: the client's ``X-Request-Id`` if valid, else ``<prefix>-<hex>``."""
        if header is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not _REQUEST_ID.fullmatch(header):
            raise InvalidRequestError(
                f"X-Request-Id {header[:64]!r} is invalid: use 1-120 characters of [A-Za-z0-9._:-]",
                param="X-Request-Id",
                code="invalid_request_id",
            )
        return header

    @staticmethod
    def _conflict(rid: str) -> ConflictError:
        return ConflictError(
            f"X-Request-Id {rid!r} is already in flight; its routes would overwrite each "
            "other: wait for it or use a new id",
            param="X-Request-Id",
            code="request_id_in_flight",
        )

    async def claim(self, store: AsyncRouteStore, rid: str) -> Claim:
        """Claim ``rid`` in ``store``'s namespace (409 if another request holds it there,
        through any replica)."""
        now = time.monotonic()
        local = (store.keys.prefix, rid)
        since = self._local.get(local)
        if since is not None and now - since < self.max_age_s:
            raise self._conflict(rid)
        token = uuid.uuid4().hex
        try:
            if not await store.claim(rid, token, self.max_age_s):
                raise self._conflict(rid)
            in_redis = True
        except RouteError as e:
            log.warning("request id %s claimed in this process only: %s", rid, redact(str(e)))
            in_redis = False
        self._local[local] = now
        return Claim(rid, token, store, in_redis)

    async def retire_stale(self, claim: Claim, n: int) -> None:
        """Delete the routes ``rid-n .. rid-63`` an earlier generation under this id left: the
        new one (accepted by the engine, ``n`` choices) overwrites only ``rid-0 .. rid-(n-1)``."""
        if n >= MAX_N:
            return
        try:
            await claim.store.delete_many([f"{claim.request_id}-{i}" for i in range(n, MAX_N)])
        except RouteError as e:
            log.warning("stale routes of %s not deleted: %s", claim.request_id, redact(str(e)))

    async def release(self, claim: Claim | None) -> None:
        """Release ``claim`` before the response completes, so an immediate retry is accepted.
        The Redis release is shielded: a request being cancelled still gives its lease back."""
        if claim is None:
            return
        self._local.pop((claim.store.keys.prefix, claim.request_id), None)
        if claim.in_redis:
            task = asyncio.get_running_loop().create_task(self._release(claim))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
            await asyncio.shield(task)

    async def _release(self, claim: Claim) -> None:
        try:
            await claim.store.release(claim.request_id, claim.token)
        except RouteError as e:  # the lease lapses by itself
            log.warning("claim on %s not released: %s", claim.request_id, redact(str(e)))
