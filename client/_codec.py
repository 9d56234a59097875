"""Whole route records as one self-checking blob (``application/vnd.routereplay.record``).

A record blob is a frame (``_frame``) whose payload is a msgpack map: the body's fields, its zstd
frame (``_body``) and the record's fields. docs/CONTRACTS.md specifies every field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._body import BodyHead, decode_body, encode_body
from ._errors import RouteCorruptError, RouteVersionError
from ._frame import FORMAT_VERSION, KIND_RECORD, MEDIA_TYPE, frame_map, unframe_map
from ._record import RouteRecord

__all__ = ["FORMAT_VERSION", "MEDIA_TYPE", "decode_record", "encode_record"]

# The per-row planes this library reads. A blob lists the planes it holds; one it marks required
# that is not here is refused (an older reader never replays part of a record).
KNOWN_PLANES = frozenset({"ids"})
IDS_PLANES = [{"name": "ids", "required": True}]


def check_planes(p: dict[str, Any], what: str) -> None:
    """Refuse a record or manifest that needs a plane this library does not read."""
    planes = p.get("planes")
    if not isinstance(planes, list) or not all(isinstance(x, dict) for x in planes):
        raise RouteCorruptError(f"{what}: plane list missing or malformed")
    names = [x.get("name") for x in planes]
    if "ids" not in names:
        raise RouteCorruptError(f"{what}: holds no 'ids' plane")
    for x in planes:
        if x.get("required") and x.get("name") not in KNOWN_PLANES:
            raise RouteVersionError(
                f"{what}: needs the {x.get('name')!r} plane, which this library does not read "
                "(upgrade routereplay)"
            )


def body_fields(head: BodyHead) -> dict[str, Any]:
    return {
        "T": head.T, "M": head.M, "K": head.K, "E": head.E, "xf": head.xf, "hp": head.hp,
        "canon": head.canonical, "raw": head.raw_len,
    }  # fmt: skip


def body_head(p: dict[str, Any], what: str) -> BodyHead:
    try:
        f = [p[k] for k in ("T", "M", "K", "E", "xf", "hp", "raw")]
        canon = p["canon"]
    except KeyError as exc:
        raise RouteCorruptError(f"{what}: payload field {exc} missing") from exc
    if any(type(v) is not int for v in f) or type(canon) is not bool:
        raise RouteCorruptError(f"{what}: payload size fields have the wrong type")
    T, M, K, E, xf, hp, raw = f
    return BodyHead(T, M, K, E, xf, hp, canon, raw)


def encode_record(record: RouteRecord, *, canonical_order: bool = False) -> bytes:
    """Encode a whole record into one self-checking blob.

    ``canonical_order=True`` sorts the K experts of each row (replay does not depend on their
    order) and lets the codec reach the order-insensitive information bound; the decoded record
    then has sorted rows. The default round-trips every byte exactly.
    """
    head, body = encode_body(
        record.token_ids,
        record.layer_major(),
        record.valid,
        record.num_experts,
        canonical_order=canonical_order,
    )
    payload = {**body_fields(head), "body": body, **record_fields(record)}
    return frame_map(KIND_RECORD, payload)


def record_fields(record: RouteRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "planes": IDS_PLANES,
        "moe": list(record.moe_layers),
        "L": record.num_layers,
        "pl": record.prompt_len,
        "nc": record.num_cached_tokens,
        "model": record.model,
        "meta": record.metadata,
    }
    if record.weight_versions:  # absent when unknown
        fields["wv"] = [list(s) for s in record.weight_versions]
    return fields


def record_from_parts(
    p: dict[str, Any],
    token_ids: np.ndarray,
    experts: Any,
    valid: np.ndarray,
    what: str,
    *,
    cls: type[RouteRecord] = RouteRecord,
) -> RouteRecord:
    """A ``cls`` record from payload fields ``p`` and its rows (``experts``: what ``cls``
    takes, ``[T, M, K]`` for a :class:`RouteRecord`)."""
    try:
        return cls(
            token_ids=token_ids,
            experts=experts,
            valid=valid,
            moe_layers=tuple(p["moe"]),
            num_layers=int(p["L"]),
            num_experts=int(p["E"]),
            prompt_len=int(p["pl"]),
            num_cached_tokens=int(p["nc"]),
            model=str(p["model"]),
            metadata=dict(p.get("meta") or {}),
            weight_versions=tuple(tuple(s) for s in p.get("wv") or ()),
        )
    except (KeyError, TypeError, ValueError) as exc:  # RouteShapeError is a ValueError
        raise RouteCorruptError(f"{what}: record fields malformed or inconsistent: {exc}") from exc


def decode_record(blob: bytes | bytearray | memoryview, *, what: str = "record") -> RouteRecord:
    """Decode a blob written by :func:`encode_record`.

    Raises :class:`RouteTruncatedError`, :class:`RouteForeignFormatError`,
    :class:`RouteVersionError` or :class:`RouteCorruptError` naming the problem.
    """
    p = unframe_map(blob, KIND_RECORD, what)
    check_planes(p, what)
    body = p.get("body")
    if not isinstance(body, bytes):
        raise RouteCorruptError(f"{what}: payload field 'body' missing or not bytes")
    block = decode_body(body_head(p, what), body, what)
    lm = block.experts
    if not lm.flags.writeable:
        # The plain uint8 path views the decompressed bytes; a decoded record owns writable
        # arrays on every path, as joined store reads do.
        lm = lm.copy()
    return record_from_parts(p, block.token_ids, lm.transpose(1, 0, 2), block.valid, what)
