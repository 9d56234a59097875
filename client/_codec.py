"""Whole route records as one self-checking blob (``application/vnd.routereplay.record``).

A record blob is a frame (``_frame``) whose payload is a msgpack map: the body's fields, its zstd
frame (``_body``) and the record's fields. docs/CONTRACTS.md specifies every field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._body import BodyHead, decode_body, encode_body
from ._errors import RouteCorruptError, RouteShapeError, RouteVersionError
from ._frame import FORMAT_VERSION, KIND_RECORD, MEDIA_TYPE, frame_map, unframe_map
from ._limits import DEFAULT_LIMITS, ReadLimits
from ._record import RouteRecord
from ._schema import body_shape, check_record_fields, need_int, need_type
from ._weights import WEIGHTS, decode_weights, encode_weights

__all__ = ["FORMAT_VERSION", "MEDIA_TYPE", "decode_record", "encode_record"]

# The per-row planes this library reads. A blob lists the planes it holds; one it marks required
# that is not here is refused (an older reader never replays part of a record).
KNOWN_PLANES = frozenset({"ids", "weights"})
IDS_PLANES = [{"name": "ids", "required": True}]


def planes_of(record: RouteRecord) -> list[dict[str, Any]]:
    """The plane list of a record: ids, and its weights (optional: an older reader reads the ids
    and ignores them) with the dtype they are stored in."""
    if record.weights is None:
        return IDS_PLANES
    return [*IDS_PLANES, {"name": WEIGHTS, "required": False, "dtype": record.weights_dtype}]


def weights_plane(p: dict[str, Any], what: str) -> str | None:
    """The dtype of the weights a record or manifest lists in its planes; None: no weights."""
    for x in p["planes"]:
        if x.get("name") == WEIGHTS:
            dtype = x.get("dtype")
            if not isinstance(dtype, str):
                raise RouteCorruptError(f"{what}: weights plane names no dtype")
            return dtype
    return None


def check_slot_order(record: RouteRecord, canonical_order: bool) -> None:
    """Weights are in the engine's slot order, so the ids must stay in it too."""
    if canonical_order and record.weights is not None:
        raise RouteShapeError(
            "canonical_order sorts each row's experts, which would part them from their weights; "
            "a record with weights is stored in the engine's slot order"
        )


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
    """The body's head from a record's fields, every one checked for type and range."""
    T, M, K, E = body_shape(p, what)
    xf, hp = need_int(p, "xf", what, hi=255), need_int(p, "hp", what, hi=255)
    raw = need_int(p, "raw", what, hi=1 << 62)
    head = BodyHead(T, M, K, E, xf, hp, need_type(p, "canon", what, bool), raw)
    head.check(what)
    return head


def encode_record(record: RouteRecord, *, canonical_order: bool = False) -> bytes:
    """Encode a whole record into one self-checking blob.

    ``canonical_order=True`` sorts the K experts of each row (replay does not depend on their
    order) and lets the codec reach the order-insensitive information bound; the decoded record
    then has sorted rows (not allowed with weights). The default round-trips every byte exactly.
    """
    check_slot_order(record, canonical_order)
    head, body = encode_body(
        record.token_ids,
        record.layer_major(),
        record.valid,
        record.num_experts,
        canonical_order=canonical_order,
    )
    payload = {**body_fields(head), "body": body, **record_fields(record)}
    if record.weights is not None:
        lm = record.weights.transpose(1, 0, 2)
        payload[WEIGHTS] = encode_weights(lm, record.weights_dtype)  # type: ignore[arg-type]
    return frame_map(KIND_RECORD, payload)


def record_fields(record: RouteRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "planes": planes_of(record),
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
    weights: np.ndarray | None = None,
) -> RouteRecord:
    """A ``cls`` record from payload fields ``p`` and its rows (``experts``: what ``cls``
    takes, ``[T, M, K]`` for a :class:`RouteRecord`; ``weights`` ``[T, M, K]`` or None)."""
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
            weights=weights,
            weights_dtype=None if weights is None else weights_plane(p, what),
        )
    except (KeyError, TypeError, ValueError) as exc:  # RouteShapeError is a ValueError
        raise RouteCorruptError(f"{what}: record fields malformed or inconsistent: {exc}") from exc


def decode_record(
    blob: bytes | bytearray | memoryview,
    *,
    what: str = "record",
    limits: ReadLimits = DEFAULT_LIMITS,
) -> RouteRecord:
    """Decode a blob written by :func:`encode_record`.

    Raises :class:`RouteTruncatedError`, :class:`RouteForeignFormatError`,
    :class:`RouteVersionError` or :class:`RouteCorruptError` naming the problem, and
    :class:`RouteLimitError` for a record larger than ``limits`` allow (before its rows are
    allocated).
    """
    p = unframe_map(blob, KIND_RECORD, what)
    check_planes(p, what)
    head = body_head(p, what)
    check_record_fields(p, head.T, head.M, what)
    dtype = weights_plane(p, what)
    limits.check(head.T, head.M, head.K, head.E, dtype is not None, what)
    block = decode_body(head, need_type(p, "body", what, bytes), what)
    lm = block.experts
    if not lm.flags.writeable:
        # The plain uint8 path views the decompressed bytes; a decoded record owns writable
        # arrays on every path, as joined store reads do.
        lm = lm.copy()
    weights = None
    if dtype is not None:
        w_lm, got = decode_weights(need_type(p, WEIGHTS, what, bytes), lm.shape, what)
        if got != dtype:
            raise RouteCorruptError(f"{what}: weights stored as {got}, planes say {dtype}")
        weights = w_lm.transpose(1, 0, 2)
    return record_from_parts(
        p, block.token_ids, lm.transpose(1, 0, 2), block.valid, what, weights=weights
    )
