"""Batch reads: one result per id, and the bytes a batch crosses HTTP with.

``POST /v1/routes:batch`` answers with the stored bytes themselves (a :class:`RawBatch`: the
manifests and the distinct chunks the ids need, undecoded), so a shared prefix crosses HTTP once
as it crosses Redis once, the service neither decodes nor re-encodes, and the reader verifies
every chunk against its content address as it assembles (``_layout.finish_read``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ._errors import (
    RouteCorruptError,
    RouteError,
    RouteEvictedError,
    RouteLimitError,
    RouteNotFoundError,
    RouteShapeError,
)
from ._record import RouteRecord
from ._schema import HASH_BYTES

__all__ = ["BATCH_MEDIA_TYPE", "RawBatch", "resolve_results"]

BATCH_MEDIA_TYPE = "application/vnd.routereplay.chunks+msgpack"

# Wire codes of per-id errors (documented in docs/CONTRACTS.md).
_ERROR_CODES: dict[type[RouteError], str] = {
    RouteEvictedError: "route_evicted",
    RouteCorruptError: "route_corrupt",
    RouteShapeError: "invalid_start",
    RouteLimitError: "route_too_large",
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
        """A batch response, every field checked for its exact type before it is kept (the
        bytes come from a server the reader does not trust with its memory: a count where
        bytes belong would otherwise be allocated as that many bytes)."""
        try:
            p = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise RouteCorruptError(f"batch response is not msgpack: {exc!r}") from exc
        if type(p) is not dict:
            raise RouteCorruptError("batch response is not a map")
        batch = cls(
            manifests=_map(p, "manifests", str, bytes),
            chunks=_map(p, "chunks", bytes, (bytes, type(None))),
            missing=_strings(p, "missing"),
            deferred=_strings(p, "deferred") if "deferred" in p else [],
        )
        if any(len(d) != HASH_BYTES for d in batch.chunks):
            raise RouteCorruptError(f"batch response: a chunk key is not {HASH_BYTES} bytes")
        for rid, e in _map(p, "errors", str, dict).items() if p.get("errors") else ():
            kind = _ERROR_TYPES.get(e.get("code"), RouteCorruptError)
            batch.errors[rid] = kind(str(e.get("message")))
        return batch


def _map(p: dict[Any, Any], key: str, keys: type, values: type | tuple[type, ...]) -> dict:
    m = p.get(key)
    if type(m) is not dict:
        raise RouteCorruptError(f"batch response: {key!r} is not a map")
    if not all(type(k) is keys and isinstance(v, values) for k, v in m.items()):
        raise RouteCorruptError(f"batch response: {key!r} holds an entry of the wrong type")
    return m


def _strings(p: dict[Any, Any], key: str) -> list[str]:
    v = p.get(key)
    if type(v) is not list or not all(type(x) is str for x in v):
        raise RouteCorruptError(f"batch response: {key!r} is not a list of strings")
    return v


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
