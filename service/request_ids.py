"""Request ids: the ``X-Request-Id`` policy (validate or generate) and in-flight claims.

Route ids are ``f"{request_id}-{choice}"``, so the request id decides where a generation's routes
land. Two concurrent requests with one client-chosen id (a client that timed out and retried while
the first still runs) would overwrite each other's routes, and a response's handle could name the
other generation's record: the second gets 409. A retry after the first finished reuses the id and
overwrites its routes (idempotent retries).
"""

from __future__ import annotations

import re
import time
import uuid

from .errors import ConflictError, InvalidRequestError

__all__ = ["REQUEST_ID_PATTERN", "RequestIds"]

# Route ids are at most 128 characters: leave room for the "-<choice>" suffix.
REQUEST_ID_PATTERN = r"[A-Za-z0-9._:-]{1,120}"
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


class RequestIds:
    """Validates client ids, generates the others, and tracks the client-chosen ids in flight.

    A claim lapses after ``max_age_s`` so a stream the server never started cannot hold an id
    forever.
    """

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._since: dict[str, float] = {}

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

    def claim(self, rid: str) -> None:
        """Mark ``rid`` in flight; 409 if it already is."""
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
