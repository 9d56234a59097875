"""Request ids: the ``X-Request-Id`` policy (validate or generate) and in-flight claims.

Route ids are ``f"{request_id}-{choice}"``, so the request id decides where a generation's routes
land. Two concurrent requests with one client-chosen id (a client that timed out and retried while
the first still runs) would overwrite each other's routes, and a response's handle could name the
other generation's record: the second gets 409. The claim is a lease in Redis (set when free,
by a script), so it holds across every replica that shares the store; a retry after the first
finished reuses the id and overwrites its routes (idempotent retries), and routes of the earlier
generation that the new one does not overwrite (it asked for fewer choices) are deleted.

Leases are short (``--request-id-lease-s``, 30 s) and renewed while their request runs: when a
replica dies mid-request, the ids it held are free again within one lease, so a client's retry
on another replica is accepted instead of refused for the length of the longest request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from dataclasses import dataclass

from routereplay.client import AsyncRouteStore, RouteError

from .clock import Clock, SystemClock
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

    A claim is a Redis lease of ``lease_s``, renewed every ``lease_s / 3`` while its request
    runs, for at most ``max_age_s`` (the longest a request may run): a stream the server never
    finished cannot hold an id forever, and a dead replica's ids lapse within ``lease_s``. If
    Redis cannot be reached the claim is held in this process only (routes cannot be stored then
    anyway) and a warning is logged. Renewal and ages are timed by ``clock`` (see
    :mod:`.clock`); the lease itself expires on Redis's clock.
    """

    def __init__(self, max_age_s: float, lease_s: float = 30.0, clock: Clock | None = None) -> None:
        self.max_age_s = max_age_s
        self.lease_s = min(lease_s, max_age_s)
        self.clock = clock or SystemClock()
        self._local: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], tuple[Claim, float]] = {}
        self._releases: set[asyncio.Task] = set()
        self._renewer: asyncio.Task | None = None

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
        now = self.clock.monotonic()
        local = (store.keys.prefix, rid)
        since = self._local.get(local)
        if since is not None and now - since < self.max_age_s:
            raise self._conflict(rid)
        token = uuid.uuid4().hex
        try:
            if not await store.claim(rid, token, self.lease_s):
                raise self._conflict(rid)
            in_redis = True
        except RouteError as e:
            log.warning("request id %s claimed in this process only: %s", rid, redact(str(e)))
            in_redis = False
        self._local[local] = now
        claim = Claim(rid, token, store, in_redis)
        if in_redis:
            self._held[local] = (claim, now)
            if self._renewer is None or self._renewer.done():
                self._renewer = asyncio.get_running_loop().create_task(self._renew_leases())
        return claim

    async def _renew_leases(self) -> None:
        """Extend every held lease each ``lease_s / 3`` until none is held."""
        while self._held:
            await self.clock.sleep(self.lease_s / 3)
            now = self.clock.monotonic()
            held = []
            for key, (claim, since) in list(self._held.items()):
                if now - since >= self.max_age_s:
                    # Past the longest a request may run: stuck; let its lease lapse.
                    self._held.pop(key, None)
                else:
                    held.append((key, claim))
            results = await asyncio.gather(
                *(c.store.renew(c.request_id, c.token, self.lease_s) for _, c in held),
                return_exceptions=True,
            )
            for (key, claim), ok in zip(held, results, strict=True):
                if isinstance(ok, RouteError):
                    log.warning("lease on %s not renewed: %s", claim.request_id, redact(str(ok)))
                elif isinstance(ok, BaseException):
                    raise ok
                elif not ok and key in self._held:
                    # Lost (a Redis restart without persistence, a lapse during an outage).
                    log.warning("lease on request id %s was lost", claim.request_id)
                    self._held.pop(key, None)

    async def aclose(self) -> None:
        """Stop renewing (at shutdown); the leases lapse by themselves."""
        self._held.clear()
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer

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
        key = (claim.store.keys.prefix, claim.request_id)
        self._local.pop(key, None)
        held = self._held.get(key)
        if held is not None and held[0] is claim:
            self._held.pop(key, None)
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
