"""zstd contexts and the one compression call of the route format."""

from __future__ import annotations

import threading

import zstandard

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
