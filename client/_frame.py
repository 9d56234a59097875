"""The frame every routereplay blob is written in (route format 1, docs/CONTRACTS.md)::

    magic "RRTE" | version u8 | kind u8 | reserved u16 = 0 | payload_len u32 | crc32 u32 | payload

Integers are little-endian; ``crc32`` is zlib's CRC-32 of the payload. A reader checks the magic,
then the version, the kind, the length and the checksum, in that order, and names the first
that fails.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgpack

from ._errors import (
    RouteCorruptError,
    RouteForeignFormatError,
    RouteTruncatedError,
    RouteVersionError,
)

__all__ = ["FORMAT_VERSION", "MEDIA_TYPE"]

MAGIC = b"RRTE"
# The one route format. A later format gets a new number; optional per-row planes do not need
# one (manifests list the planes a record holds, docs/CONTRACTS.md).
FORMAT_VERSION = 1
MEDIA_TYPE = "application/vnd.routereplay.record"

KIND_RECORD = 1
KIND_CHUNK = 2
KIND_MANIFEST = 3
_KIND_NAMES = {KIND_RECORD: "record", KIND_CHUNK: "chunk", KIND_MANIFEST: "manifest"}

HEADER = struct.Struct("<4sBBHII")  # magic, version, kind, reserved, payload_len, crc32


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, kind, 0, len(payload), zlib.crc32(payload)) + payload


def frame_map(kind: int, payload: dict[str, Any]) -> bytes:
    """A frame whose payload is a msgpack map (records and manifests)."""
    return frame(kind, msgpack.packb(payload, use_bin_type=True))


def check_header(
    magic: bytes, version: int, kind: int, size: int, plen: int, expect_kind: int, what: str
) -> None:
    """Check a parsed frame header against the blob's ``size`` (raises naming the problem)."""
    if magic != MAGIC:
        raise RouteForeignFormatError(f"{what}: not a routereplay blob (magic {magic!r})")
    if version != FORMAT_VERSION:
        if version > FORMAT_VERSION:
            raise RouteVersionError(
                f"{what}: written in route format version {version}; this library reads "
                f"version {FORMAT_VERSION} (upgrade routereplay)"
            )
        raise RouteCorruptError(f"{what}: invalid format version {version}")
    if kind != expect_kind:
        raise RouteCorruptError(
            f"{what}: holds a {_KIND_NAMES.get(kind, f'kind-{kind}')}, expected a "
            f"{_KIND_NAMES[expect_kind]}"
        )
    end = HEADER.size + plen
    if size < end:
        raise RouteTruncatedError(f"{what}: truncated: {size} of {end} bytes present")
    if size > end:
        raise RouteCorruptError(f"{what}: {size - end} unexpected trailing bytes")


def check_short(mv: memoryview, what: str) -> None:
    """Name a blob shorter than the frame header: foreign bytes, or a truncated blob."""
    n = min(len(mv), 4)
    if bytes(mv[:n]) != MAGIC[:n]:
        raise RouteForeignFormatError(f"{what}: not a routereplay blob (bad magic)")
    raise RouteTruncatedError(
        f"{what}: truncated: {len(mv)} bytes, shorter than the {HEADER.size}-byte header"
    )


def unframe(blob: bytes | bytearray | memoryview, expect_kind: int, what: str) -> memoryview:
    """The payload of a blob of ``expect_kind``, its frame and checksum checked."""
    mv = memoryview(blob)
    if len(mv) < HEADER.size:
        check_short(mv, what)
    magic, version, kind, _, plen, crc = HEADER.unpack_from(mv)
    check_header(magic, version, kind, len(mv), plen, expect_kind, what)
    payload = mv[HEADER.size :]
    check_crc(payload, crc, what)
    return payload


def unframe_map(blob: bytes | bytearray | memoryview, expect_kind: int, what: str) -> dict:
    """The msgpack map a record or manifest blob carries, its frame checked."""
    payload = unframe(blob, expect_kind, what)
    try:
        p = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise RouteCorruptError(f"{what}: undecodable payload: {exc}") from exc
    if not isinstance(p, dict):
        raise RouteCorruptError(f"{what}: payload is not a map")
    return p


def check_crc(payload: memoryview, crc: int, what: str) -> None:
    if zlib.crc32(payload) != crc:
        raise RouteCorruptError(f"{what}: checksum mismatch (stored bytes are corrupted)")
