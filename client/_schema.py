"""Strict checks of the msgpack maps that records and manifests carry (docs/CONTRACTS.md).

Every field a reader uses is checked for its exact type and range before anything is sized
from it: integers are ``int`` (never a bool, float or string) within their range, digests are
exactly 16 bytes, strings are ``str``. A field that fails is named in a RouteCorruptError.
"""

from __future__ import annotations

from typing import Any

from ._errors import RouteCorruptError

__all__ = [
    "HASH_BYTES", "U16", "U32", "body_shape", "check_record_fields", "digests", "need_int",
    "need_type", "show",
]  # fmt: skip

# A content address (chunk digest, token chain): BLAKE3 truncated to 16 bytes (``_address``).
HASH_BYTES = 16
U16 = (1 << 16) - 1
U32 = (1 << 32) - 1
_MISSING = object()


def show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _get(p: dict[str, Any], key: str, what: str) -> Any:
    v = p.get(key, _MISSING)
    if v is _MISSING:
        raise RouteCorruptError(f"{what}: field {key!r} missing")
    return v


def need_int(p: dict[str, Any], key: str, what: str, lo: int = 0, hi: int = U32) -> int:
    """Field ``key``: an ``int`` in ``[lo, hi]``."""
    v = _get(p, key, what)
    if type(v) is not int or not lo <= v <= hi:
        raise RouteCorruptError(
            f"{what}: field {key!r} must be an integer in [{lo}, {hi}], got {show(v)}"
        )
    return v


def need_type(p: dict[str, Any], key: str, what: str, kind: type) -> Any:
    """Field ``key``: exactly of type ``kind`` (bool, str, bytes, list, dict)."""
    v = _get(p, key, what)
    if type(v) is not kind:
        raise RouteCorruptError(f"{what}: field {key!r} must be {kind.__name__}, got {show(v)}")
    return v


def body_shape(p: dict[str, Any], what: str) -> tuple[int, int, int, int]:
    """``(T, M, K, E)``: rows (uint32), MoE layers and top-k (uint16), experts (1 to 65536,
    at least K)."""
    T = need_int(p, "T", what)
    M = need_int(p, "M", what, hi=U16)
    K = need_int(p, "K", what, lo=1, hi=U16)
    E = need_int(p, "E", what, lo=K, hi=1 << 16)
    return T, M, K, E


def digests(p: dict[str, Any], what: str) -> list[bytes]:
    """A manifest's ``chunks``: a list of 16-byte digests."""
    out = need_type(p, "chunks", what, list)
    for i, d in enumerate(out):
        if type(d) is not bytes or len(d) != HASH_BYTES:
            raise RouteCorruptError(
                f"{what}: chunks[{i}] must be a {HASH_BYTES}-byte digest, got {show(d)}"
            )
    return out


def _check_moe(p: dict[str, Any], M: int, what: str) -> None:
    L = need_int(p, "L", what)
    moe = need_type(p, "moe", what, list)
    if len(moe) != M or any(type(x) is not int or not 0 <= x < L for x in moe):
        raise RouteCorruptError(
            f"{what}: field 'moe' must list {M} layer indices in [0, L={L}), got {show(moe)}"
        )


def _check_versions(p: dict[str, Any], T: int, what: str) -> None:
    """``wv``, where present: ``[version str, start, stop]`` spans within the rows."""
    if "wv" not in p:
        return
    for span in need_type(p, "wv", what, list):
        ok = type(span) is list and len(span) == 3 and type(span[0]) is str
        if not ok or any(type(x) is not int or not 0 <= x <= T for x in span[1:]):
            raise RouteCorruptError(
                f"{what}: field 'wv' must hold [version, start, stop] spans, got {show(span)}"
            )


def check_record_fields(p: dict[str, Any], T: int, M: int, what: str) -> None:
    """The fields records and manifests share beyond the shape: layers, prompt, cache, model,
    metadata (a map with string keys) and weight versions."""
    _check_moe(p, M, what)
    pl = need_int(p, "pl", what, hi=T)
    need_int(p, "nc", what, hi=pl)
    need_type(p, "model", what, str)
    meta = p.get("meta")
    if meta is not None and (type(meta) is not dict or any(type(k) is not str for k in meta)):
        raise RouteCorruptError(f"{what}: field 'meta' must be a map with string keys")
    _check_versions(p, T, what)
