"""Batch reads: one result per id, and the bytes a batch crosses HTTP with.

``POST /v1/routes:batch`` answers with the stored bytes themselves (a :class:`RawBatch`: the
manifests and the distinct chunks the ids need, undecoded), so a shared prefix crosses HTTP once
as it crosses Redis once, the service neither decodes nor re-encodes, and the reader verifies
every chunk against its content address as it assembles (``_layout.finish_read``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack

from ._errors import (
    RouteCorruptError,
    RouteError,
    RouteEvictedError,
    RouteNotFoundError,
    RouteShapeError,
)
from ._record import RouteRecord

__all__ = ["BATCH_MEDIA_TYPE", "RawBatch", "resolve_results"]

BATCH_MEDIA_TYPE = "application/vnd.routereplay.chunks+msgpack"

# Wire codes of per-id errors (documented in docs/CONTRACTS.md).
_ERROR_CODES: dict[type[RouteError], str] = {
    RouteEvictedError: "route_evicted",
    RouteCorruptError: "route_corrupt",
    RouteShapeError: "invalid_start",
}
_ERROR_TYPES = {code: t for t, code in _ERROR_CODES.items()}


def error_code(e: RouteError) -> str:
    for t, code in _ERROR_CODES.items():
        if isinstance(e, t):
            return code
    return "route_error"


@dataclass
class RawBatch:
    """Stored bytes of a batch read: ``manifests`` (id -> bytes), ``chunks`` (digest -> bytes,
    None if gone), ids without a manifest (``missing``), ids whose manifest failed to parse
    (``errors``), and ids left for a next request because the byte cap was reached
    (``deferred``)."""

    manifests: dict[str, bytes] = field(default_factory=dict)
    chunks: dict[bytes, bytes | None] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    errors: dict[str, RouteError] = field(default_factory=dict)
    deferred: list[str] = field(default_factory=list)
    num_bytes: int = 0

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "manifests": self.manifests,
                "chunks": self.chunks,
                "missing": self.missing,
                "errors": {
                    rid: {"code": error_code(e), "message": str(e)}
                    for rid, e in self.errors.items()
                },
                "deferred": self.deferred,
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, body: bytes) -> RawBatch:
        try:
            p = msgpack.unpackb(body, raw=False, strict_map_key=False)
            batch = cls(
                manifests={str(k): bytes(v) for k, v in p["manifests"].items()},
                chunks={
                    bytes(k): (None if v is None else bytes(v)) for k, v in p["chunks"].items()
                },
                missing=[str(x) for x in p["missing"]],
                deferred=[str(x) for x in p.get("deferred", [])],
            )
            for rid, e in (p.get("errors") or {}).items():
                kind = _ERROR_TYPES.get(e.get("code"), RouteCorruptError)
                batch.errors[str(rid)] = kind(str(e.get("message")))
            return batch
        except RouteError:
            raise
        except Exception as exc:
            raise RouteCorruptError(f"batch response is malformed: {exc!r}") from exc


def resolve_results(
    route_ids: Sequence[str],
    results: Sequence[RouteRecord | RouteError | None],
    *,
    missing_ok: bool,
    return_exceptions: bool,
) -> list[RouteRecord | RouteError | None]:
    """Per-id read outcomes as a reader asked for them.

    A missing id (no manifest, or a chunk evicted) is None with ``missing_ok``, else a
    :class:`RouteNotFoundError` / :class:`RouteEvictedError`. Errors are raised (the first one)
    unless ``return_exceptions``, which puts them in the list in place of their records.
    """
    out: list[RouteRecord | RouteError | None] = []
    for rid, r in zip(route_ids, results, strict=True):
        if isinstance(r, RouteRecord):
            out.append(r)
            continue
        if r is None or isinstance(r, RouteEvictedError):
            if missing_ok:
                out.append(None)
                continue
            err: RouteError = RouteNotFoundError(rid) if r is None else r
        else:
            err = r
        if not return_exceptions:
            raise err
        out.append(err)
    return out
