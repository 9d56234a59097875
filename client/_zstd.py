"""zstd contexts and the one compression call of the route format."""

from __future__ import annotations

import threading

import zstandard

from ._errors import RouteCorruptError

# Level 1: zstd's gain from higher levels on route rows is < 1% (they are near-incompressible
# symbols or long repeats, both found at level 1) while encode speed halves.
ZSTD_LEVEL = 1

_tls = threading.local()


def zc() -> zstandard.ZstdCompressor:
    # One context per thread: building one allocates and zeroes its tables, which costs about as
    # much as decoding a small chunk; contexts are not thread-safe, hence per thread.
    c = getattr(_tls, "zc", None)
    if c is None:
        c = _tls.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def zd() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "zd", None)
    if d is None:
        d = _tls.zd = zstandard.ZstdDecompressor()
    return d


def compress(segments: list[bytes]) -> bytes:
    """One zstd frame; each segment starts a new block (its own Huffman table). Token ids and
    rows apart save ~1% on a 128-row store chunk: one table for both codes neither well."""
    co = zc().compressobj(size=sum(len(x) for x in segments))
    out = []
    for seg in segments:
        if seg:
            out.append(co.compress(seg))
            out.append(co.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(co.flush())
    return b"".join(out)


# A zstd block holds at most 128 KiB and takes at least 4 bytes (an RLE block), so no frame
# decompresses to more than 32768x its size.
MAX_RATIO = 32768


def decompress_exact(data: bytes | memoryview, size: int, what: str, part: str = "body") -> bytes:
    """The ``size`` bytes a zstd frame holds, or RouteCorruptError naming what is wrong.

    Why the frame's own declared size is checked first: python-zstandard allocates what a
    frame header declares (or, without a declaration, grows a buffer to whatever the frame
    holds), so a frame is trusted for no more than the ``size`` its reader already bounded.
    Writers always declare it (:func:`compress`)."""
    if size > MAX_RATIO * len(data):
        raise RouteCorruptError(
            f"{what}: a {len(data)}-byte compressed {part} cannot hold the {size} bytes its "
            "header claims"
        )
    try:
        declared = zstandard.get_frame_parameters(data).content_size
        if declared != size:
            raise RouteCorruptError(
                f"{what}: compressed {part} declares "
                f"{'no size' if declared >= zstandard.CONTENTSIZE_ERROR else declared}, "
                f"its header says {size} bytes"
            )
        raw = zd().decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise RouteCorruptError(f"{what}: compressed {part} is corrupted: {exc}") from exc
    if len(raw) != size:
        raise RouteCorruptError(f"{what}: {part} holds {len(raw)} bytes, header says {size}")
    return raw
