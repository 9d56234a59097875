"""The one binary encoding of route records, store chunks and manifests.

Frame (every blob routereplay writes)::

    magic "RRTE" | version u8 | kind u8 | reserved u16 | payload_len u32 | crc32 u32 | payload

The payload is a msgpack map. Record and chunk payloads carry one zstd frame ``body``::

    token ids  uint32 LE [T]
    valid      packbits [ceil(T / 8)]
    experts    transformed rows, layer-major [M, T, K] (uint16 split into low/high byte planes)

Why layer-major: the trainer consumes one ``[tokens, K]`` target per layer, neighbouring tokens of
one layer are what correlate, and zstd sees each layer as one stream.

Row transforms (chosen per blob by an entropy estimate on a sample, recorded in the payload):
- ``plain``: rows as they are. Uniformly random routes cost ~log2(E) bits per id after zstd's
  Huffman stage, within 1% of the log2(E!/(E-K)!) information bound.
- ``delta``: each id minus the same slot of the previous token in the same layer (mod 2^bits).
  Real routers keep many experts from one token to the next; those slots become zeros.
- ``keep`` (format 2): per (layer, slot) stream along the tokens, a bit per token saying whether
  the expert changed from the previous token, then only the changed experts' ids. Kept slots cost
  ~1 bit, new ids keep their layer's popularity skew (``delta`` turns them near-uniform). With
  per-layer Huffman tables this codes the skewed workload of ``bench store`` within ~8% of its
  entropy; decoding is a prefix count and a gather.
- ``tokens`` (format 3): plain rows in token order ``[T, M, K]``. zstd's match finder then sees a
  token's ids of every layer together: a trained model routes a repeated context (or token)
  alike in many layers, which a layer's own stream holds as rows of only ``K`` bytes, too short
  for a match when ``K * itemsize < 8``. Tried only then, and chosen only when a trial
  compression of a sample says it saves >= 3% over the best layer-major transform (it decodes
  to a token-major array, which the layer-major consumers read as a strided view).
- ``gaps`` (only with ``canonical_order=True``): each row sorted, then stored as the gaps between
  consecutive experts (``c[0]``, ``c[j] - c[j-1] - 1``). For uniformly random routes the gaps are
  exchangeable and near-geometric, so one Huffman table codes them within ~5% of the
  order-insensitive bound log2 C(E, K); decoding is a running sum along K.
"""

from __future__ import annotations

import itertools
import math
import struct
import threading
import zlib
from functools import lru_cache
from typing import Any

import msgpack
import numpy as np
import zstandard

from ._errors import (
    RouteCorruptError,
    RouteForeignFormatError,
    RouteTruncatedError,
    RouteVersionError,
)
from ._record import RouteRecord, expert_dtype

try:  # compiled inner loops (client/_ckernel.c); optional, the numpy paths give the same bytes
    from . import _ckernel as _KERNEL
except ImportError:  # built without a C compiler, or a source tree that was never built
    _KERNEL = None

__all__ = [
    "FORMAT_VERSION",
    "MEDIA_TYPE",
    "codec_kernel",
    "decode_record",
    "encode_record",
]

MAGIC = b"RRTE"
# 2: the ``keep`` row transform, per-layer zstd blocks, chunks addressed with blake3.
# 3: the ``tokens`` row order. Only blobs that use it are written as version 3, the rest stay
# version 2, so a version-2 reader still reads them.
# 4: store chunks addressed by blake3 over their rows first (twice as fast to verify), written
# as version 4; records and manifests keep their versions.
# 5: for 256 < E <= 512, the high byte of each id is one bit, packed, and stored only for ids
# whose low byte is below E - 256 (the others' must be 0): field ``hp``. Only blobs that use it
# say 5.
# 6: ``hp`` = 2, the same high bits stored grouped by low byte within each layer (plain and keep
# rows; the tokens order is one group), which zstd then codes: a router's popular experts make
# the high bit of a given low byte in a given layer nearly constant. ``hp`` = 3 (257 to 384
# experts): the low 7 bits as the byte plane and bits 7-8 as base-3 digits, five to a byte
# (near-uniform ids: 8.6 bits where hp 1 takes 8.67). Only blobs that use them say 6.
# Older blobs stay readable; an older reader refuses a newer blob with an upgrade message.
FORMAT_VERSION = 6
MEDIA_TYPE = "application/vnd.routereplay.record"

KIND_RECORD = 1
KIND_CHUNK = 2
KIND_MANIFEST = 3
_KIND_NAMES = {KIND_RECORD: "record", KIND_CHUNK: "chunk", KIND_MANIFEST: "manifest"}

_HEADER = struct.Struct("<4sBBHII")  # magic, version, kind, reserved, payload_len, crc32

XF_PLAIN = 0
XF_DELTA = 1
XF_GAPS = 2
XF_KEEP = 3
XF_TOKENS = 4
_TRANSFORMS = (XF_PLAIN, XF_DELTA, XF_GAPS, XF_KEEP, XF_TOKENS)

# Level 1: zstd's gain from higher levels on route rows is < 1% (they are near-incompressible
# symbols or long repeats, both found at level 1) while encode speed halves.
_ZSTD_LEVEL = 1
# Entropy estimate sample: enough symbols for a stable histogram, cheap next to compression.
_SAMPLE = 1 << 16
# Trial compression sample for the token order: matches need whole runs of tokens, a few KB;
# a 128-token store chunk of a top-2 router (up to 64 layers) is tried whole.
_TRIAL = 1 << 14
# A layer whose symbols fill at least this many bytes gets zstd blocks of its own, hence its own
# Huffman table (~50-100 bytes): real routers' expert popularity differs per layer, and one
# table for all layers codes their mixture, which is nearly uniform. Smaller layers (a 128-token
# store chunk holds ~1 KB per layer) share one table: a table each would cost more than it saves.
_LAYER_BLOCK_MIN = 8192


_tls = threading.local()


def codec_kernel() -> str:
    """Which inner loops this process decodes with: ``"compiled"`` (the package's C extension)
    or ``"numpy"`` (the fallback where it was not built; same bytes, ``keep`` decodes ~3x
    slower)."""
    return "numpy" if _KERNEL is None else "compiled"


def _zc() -> zstandard.ZstdCompressor:
    # One context per thread: building one allocates and zeroes its tables, which costs about as
    # much as decoding a small chunk; contexts are not thread-safe, hence per thread.
    c = getattr(_tls, "zc", None)
    if c is None:
        c = _tls.zc = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    return c


def _zd() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "zd", None)
    if d is None:
        d = _tls.zd = zstandard.ZstdDecompressor()
    return d


# ---------------------------------------------------------------------------------------------
# framing
# ---------------------------------------------------------------------------------------------
def frame(kind: int, payload: dict[str, Any]) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    # The lowest version that can read it: older readers keep reading what they can.
    if payload.get("hp") in (2, 3):  # grouped high bits or base-3 digits (257+ experts)
        version = 6
    elif payload.get("hp"):  # packed high bits
        version = 5
    elif payload.get("ha") == 3:  # store chunks, rows-first blake3 address
        version = 4
    else:
        version = 3 if payload.get("xf") == XF_TOKENS else 2
    return _HEADER.pack(MAGIC, version, kind, 0, len(body), zlib.crc32(body)) + body


def unframe(
    blob: bytes | bytearray | memoryview, expect_kind: int, what: str, *, check_crc: bool = True
) -> dict[str, Any]:
    """Check magic, version, length and checksum; return the payload map.

    ``check_crc=False`` leaves the checksum to the caller (:func:`check_crc`), for blobs whose
    content is verified another way; it is still checked when the payload does not parse, so
    corrupted bytes are named as such."""
    mv = memoryview(blob)
    if len(mv) < _HEADER.size:
        if bytes(mv[: min(len(mv), 4)]) != MAGIC[: min(len(mv), 4)]:
            raise RouteForeignFormatError(f"{what}: not a routereplay blob (bad magic)")
        raise RouteTruncatedError(
            f"{what}: truncated: {len(mv)} bytes, shorter than the {_HEADER.size}-byte header"
        )
    magic, version, kind, _, plen, crc = _HEADER.unpack_from(mv)
    if magic != MAGIC:
        raise RouteForeignFormatError(f"{what}: not a routereplay blob (magic {magic!r})")
    if version > FORMAT_VERSION:
        raise RouteVersionError(
            f"{what}: written by format version {version}; this library reads up to "
            f"{FORMAT_VERSION} (upgrade routereplay)"
        )
    if version < 1:
        raise RouteCorruptError(f"{what}: invalid format version {version}")
    if kind != expect_kind:
        raise RouteCorruptError(
            f"{what}: holds a {_KIND_NAMES.get(kind, f'kind-{kind}')}, expected a "
            f"{_KIND_NAMES[expect_kind]}"
        )
    end = _HEADER.size + plen
    if len(mv) < end:
        raise RouteTruncatedError(f"{what}: truncated: {len(mv)} of {end} bytes present")
    if len(mv) > end:
        raise RouteCorruptError(f"{what}: {len(mv) - end} unexpected trailing bytes")
    body = mv[_HEADER.size : end]
    if check_crc:
        _check_crc(body, crc, what)
    try:
        payload = msgpack.unpackb(body, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        _check_crc(body, crc, what)
        raise RouteCorruptError(f"{what}: undecodable payload: {exc}") from exc
    if not isinstance(payload, dict):
        _check_crc(body, crc, what)
        raise RouteCorruptError(f"{what}: payload is not a map")
    return payload


def _check_crc(body: memoryview, crc: int, what: str) -> None:
    if zlib.crc32(body) != crc:
        raise RouteCorruptError(f"{what}: checksum mismatch (stored bytes are corrupted)")


def check_crc(blob: bytes | bytearray | memoryview, what: str) -> None:
    """The frame checksum of a blob :func:`unframe` accepted with ``check_crc=False``."""
    mv = memoryview(blob)
    plen, crc = _HEADER.unpack_from(mv)[4:]
    _check_crc(mv[_HEADER.size : _HEADER.size + plen], crc, what)


# ---------------------------------------------------------------------------------------------
# row transforms
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=16)
def _sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort comparators for ``n`` wires (pruned from the next power of
    two: wires past ``n`` hold +inf and never move)."""
    size = 1 << max(0, (n - 1).bit_length())
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p) and i + j + k < n:
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def sort_rows(a: np.ndarray) -> np.ndarray:
    """Sort along the last axis (K, small) with a sorting network: a few vectorised min/max per
    comparator, several times faster than ``np.sort`` on short rows."""
    out = a.copy()
    for i, j in _sorting_network(a.shape[-1]):
        lo = np.minimum(out[..., i], out[..., j])
        np.maximum(out[..., i], out[..., j], out=out[..., j])
        out[..., i] = lo
    return out


def _gaps(sorted_lm: np.ndarray) -> np.ndarray:
    # Wraps mod 2^bits on repeated ids (rows without a route may hold zeros); still exact.
    out = np.empty_like(sorted_lm)
    out[..., :1] = sorted_lm[..., :1]
    np.subtract(sorted_lm[..., 1:], sorted_lm[..., :-1], out=out[..., 1:])
    out[..., 1:] -= 1
    return out


def _ungaps(g: np.ndarray) -> np.ndarray:
    out = g.copy()
    one = out.dtype.type(1)
    for j in range(1, out.shape[-1]):  # column adds: 4x faster than cumsum along a short axis
        np.add(out[..., j], out[..., j - 1], out=out[..., j])
        out[..., j] += one
    return out


def _hist(sample: np.ndarray) -> np.ndarray:
    """Counts of each byte value (256 int64)."""
    # The compiled histogram (the same counts as bincount, so the same choice), unless this is
    # the numpy fallback or an extension built from an older source.
    hist_u8 = getattr(_KERNEL, "hist_u8", None)
    if hist_u8 is not None:
        hist = np.empty(256, np.int64)
        hist_u8(np.ascontiguousarray(sample), hist)
        return hist
    return np.bincount(sample, minlength=256)


def _entropy_bits(sample: np.ndarray) -> float:
    counts = _hist(sample).astype(np.float64)
    p = counts[counts > 0] / sample.size
    return float(-(p * np.log2(p)).sum()) * sample.size


def _sample_tokens(lm: np.ndarray, size: int = _SAMPLE) -> np.ndarray:
    """A slice of every layer's rows, about ``size`` bytes: transforms are chosen on it and
    only the winner is applied to the whole block."""
    M, T, K = lm.shape
    t = max(2, size // max(1, M * K * lm.itemsize))
    if t >= T:
        return lm
    # Several spans along T: a single one could miss a change of regime inside a long record.
    spans = 4
    step = T // spans
    w = max(2, t // spans)
    return np.concatenate([lm[:, i * step : i * step + w] for i in range(spans)], axis=1)


def _cost(a: np.ndarray) -> float:
    return _entropy_bits(a.reshape(-1).view(np.uint8))


def _delta(lm: np.ndarray) -> np.ndarray:
    out = np.empty_like(lm)
    out[:, :1] = lm[:, :1]
    np.subtract(lm[:, 1:], lm[:, :-1], out=out[:, 1:])
    return out


# Writers pack the high bits where they can (format 5), and group them or write base-3 digits
# instead where that pays (format 6); tests turn these off to write format-4 and format-5
# bodies, which every reader must keep reading.
_PACK_HIGH_BITS = True
_FORMAT6_HIGH_BITS = True
# Grouped high bits are written where zstd codes them in at most this share of their packed
# size (tests raise it to force them).
_GROUPED_GAIN = 0.9


def _high_bit_limit(num_experts: int, xf: int) -> int | None:
    """Low bytes below this carry a stored high bit (format 5), for ids of 257 to 512 experts
    under a transform whose values are the ids themselves (below E; ``delta`` and ``gaps``
    values wrap around); None: a byte plane of high bytes.

    Why: the high byte of such an id is 0 or 1, and zstd codes a byte stream of two symbols at
    ~1.5 bits each (384 experts, uniform: 9.5 bits per id against a bound of 8.57). Packed, a
    bit costs a bit; and an id whose low byte is >= E - 256 cannot be >= 256, so its bit is not
    stored at all (uniform 384-expert ids: 2/3 of a bit each)."""
    if 256 < num_experts <= 512 and xf in (XF_PLAIN, XF_KEEP, XF_TOKENS):
        return num_experts - 256
    return None


def _high_bits(
    low: np.ndarray, high: np.ndarray, limit: int, groups: list[int] | None = None
) -> tuple[bytes, int]:
    """(the packed high bits of the ids whose low byte is below ``limit``, ``hp``). With
    ``groups`` (the segment bounds), grouped where that pays (``hp`` 2, format 6: within each
    segment ordered by low byte, then by position, :func:`_group_order`), else in id order
    (``hp`` 1)."""
    if high.size and int(high.max()) > 1:  # ids are < E <= 512: unreachable, kept as a guard
        raise ValueError("an id of 512 or more cannot be coded with packed high bits")
    sel = low < limit
    ordered = np.packbits(high[sel]).tobytes()
    if groups is None or not _FORMAT6_HIGH_BITS:
        return ordered, 1
    grouped = np.packbits(high[_group_order(low, sel, groups)]).tobytes()
    # Grouped bits take a second pass over the ids to decode (~10% of a record's decode): worth
    # it where zstd codes them smaller, i.e. where the router is skewed. A uniform router's
    # bits are random in any order; they stay in id order.
    if len(_zc().compress(grouped)) <= _GROUPED_GAIN * len(ordered):
        return grouped, 2
    return ordered, 1


def _group_order(low: np.ndarray, sel: np.ndarray, bounds: list[int]) -> np.ndarray:
    """Positions of the selected ids, segment by segment (split at ``bounds``), each segment's
    ordered by low byte and then by position: the order of format 6's high bits."""
    out = []
    for x, y in itertools.pairwise([0, *bounds, low.size]):
        idx = np.flatnonzero(sel[x:y])
        # A stable sort of bytes: numpy's radix sort, linear in the ids.
        out.append(idx[np.argsort(low[x:y][idx], kind="stable")] + x)
    return np.concatenate(out) if out else np.zeros(0, np.intp)


def _split_high(
    data: memoryview, n: int, limit: int | None, what: str, hp: int = 1
) -> tuple[int, int]:
    """(bytes of the row planes, ids with a stored high bit) for ``n`` ids at the start of
    ``data``, checking the packed bits fill their bytes exactly; limit None: byte planes; hp 3:
    base-3 digits, five to a byte (their checks: :func:`_join_trits`)."""
    if limit is None:
        return 2 * n, 0
    if hp == 3:
        return n + (n + 4) // 5, 0
    if len(data) < n:
        raise RouteCorruptError(f"{what}: body too short for its ids' low bytes")
    low = np.frombuffer(data[:n], dtype=np.uint8)
    n_hi = int(np.count_nonzero(low < limit))
    size = n + (n_hi + 7) // 8
    if len(data) == size and n_hi % 8 and data[size - 1] & ((1 << (8 - n_hi % 8)) - 1):
        raise RouteCorruptError(f"{what}: high bits set past the last id")
    return size, n_hi


def _join_high(
    data: memoryview,
    shape: tuple[int, ...],
    limit: int,
    n_hi: int,
    groups: tuple[np.ndarray | None, int, int] | None = None,
) -> np.ndarray:
    """Inverse of the packed high bits: the low bytes, plus 256 where a stored bit is set
    (``data``: exactly those bytes, checked by :func:`_split_high`). ``groups`` (format 6):
    ``(mask, seg_len, nseg)``, the segments the bits are grouped in: ``nseg`` of ``seg_len``
    ids, or with ``mask`` (the keep transform's change bits) of as many ids as each one's part
    of the mask has bits set."""
    n = math.prod(shape)
    if _KERNEL is not None:
        out = np.empty(n, np.uint16)
        if groups is None:
            _KERNEL.join_high(data, out, limit)
        else:
            _KERNEL.join_high_grouped(data, out, limit, *groups)
        return out.reshape(shape)
    low = np.frombuffer(data[:n], dtype=np.uint8)
    out = low.astype(np.uint16)
    bits = np.unpackbits(np.frombuffer(data[n:], dtype=np.uint8), count=n_hi).astype(np.uint16)
    sel = low < limit
    if groups is None:
        out[sel] |= bits << 8
    else:
        mask, seg_len, nseg = groups
        if mask is None:
            sizes = np.full(nseg, seg_len, np.int64)
        else:
            changed = np.unpackbits(mask, count=seg_len * nseg).reshape(nseg, seg_len)
            sizes = changed.sum(axis=1, dtype=np.int64)
        out[_group_order(low, sel, np.cumsum(sizes)[:-1].tolist())] |= bits << 8
    return out.reshape(shape)


# Base-3 high digits (format 6, hp 3) for ids of 257 to 384 experts: the low 7 bits as the byte
# plane, bits 7-8 (0 to 2) five to a byte. Uniform 384-expert ids: 7 + 1.6 = 8.6 bits each,
# against 8.67 for a byte plane plus a bit (hp 1), which zstd stores raw (docs/storage.md).
_TRITS_MAX_E = 384
_TRIT_WEIGHTS = np.array([81, 27, 9, 3, 1], np.uint16)
# _TRIT_DIGITS[b]: the five digits of byte b < 243, most significant first.
_TRIT_DIGITS = (np.arange(243)[:, None] // _TRIT_WEIGHTS[None, :].astype(np.int64) % 3).astype(
    np.uint16
)
# Writers use base-3 digits where their estimate is below this share of packed bits' (tests
# move it to force one or the other).
_TRITS_GAIN = 0.995


def _pack_trits(q: np.ndarray) -> bytes:
    """Digits 0..2, five to a byte (the last byte's unused digits 0)."""
    pad = np.zeros(-q.size % 5, np.uint16)
    d = np.concatenate([q.astype(np.uint16), pad]).reshape(-1, 5)
    return (d @ _TRIT_WEIGHTS).astype(np.uint8).tobytes()


def _trits_pay(low: np.ndarray, limit: int, bounds: list[int]) -> bool:
    """Whether base-3 digits (hp 3) should code these ids smaller than a byte plane plus packed
    high bits (hp 1): order-0 estimates of both from a histogram of the low bytes of each
    segment that gets its own Huffman table (split at ``bounds``). zstd stores a segment raw
    unless Huffman saves more than 1/64 of it, hence the 8 bits."""
    if not _FORMAT6_HIGH_BITS or limit > _TRITS_MAX_E - 256 or not low.size:
        return False

    def bits(c: np.ndarray) -> float:  # a byte plane's bits through zstd
        total = c.sum()
        p = c[c > 0] / total
        h = float(-(p * np.log2(p)).sum())
        return total * (8.0 if h > 8.0 * (1 - 1 / 64) else h)

    packed = trits = 0.0
    for x, y in itertools.pairwise([0, *bounds, low.size]):
        if y > x:
            counts = _hist(low[x:y]).astype(np.float64)
            packed += bits(counts) + counts[:limit].sum()
            trits += bits(counts[:128] + counts[128:]) + 1.6 * (y - x)
    return trits < _TRITS_GAIN * packed


def _join_trits(data: memoryview, shape: tuple[int, ...], what: str) -> np.ndarray:
    """Inverse of the base-3 high digits: the low 7 bits plus 128 x each digit; the sizes, low
    bytes and digit bytes checked (a RouteCorruptError names which is wrong)."""
    n = math.prod(shape)
    if _KERNEL is not None:
        out = np.empty(n, np.uint16)
        try:
            _KERNEL.join_trits(data, out)
            return out.reshape(shape)
        except ValueError:
            pass  # the checks below name what is wrong
    nb = (n + 4) // 5
    if len(data) != n + nb:
        raise RouteCorruptError(f"{what}: base-3 digits: {len(data)} bytes, expected {n + nb}")
    low = np.frombuffer(data[:n], dtype=np.uint8)
    d = np.frombuffer(data[n:], dtype=np.uint8)
    if low.size and int(low.max()) >= 128:
        raise RouteCorruptError(f"{what}: a low byte of 128 or more under base-3 digits")
    if d.size and int(d.max()) >= 243:
        raise RouteCorruptError(f"{what}: a byte of base-3 digits is 243 or more")
    digits = _TRIT_DIGITS[d].reshape(-1)
    if digits[n:].any():
        raise RouteCorruptError(f"{what}: base-3 digits set past the last id")
    if _KERNEL is not None:  # unreachable: the kernel refused what these checks passed
        raise RouteCorruptError(f"{what}: base-3 digits do not match the low bytes")
    return (low.astype(np.uint16) | digits[:n] << 7).reshape(shape)


def _join_planes(data: memoryview, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if dtype == np.uint8:
        return np.frombuffer(data, dtype=np.uint8).reshape(shape)
    n = math.prod(shape)
    planes = np.frombuffer(data, dtype=np.uint8).reshape(2, n)
    out = np.empty((n, 2), dtype=np.uint8)
    out[:, 0] = planes[0]
    out[:, 1] = planes[1]
    return out.view("<u2").reshape(shape).astype(dtype, copy=False)


def _keep_split(lm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``keep`` transform: (changed bits [M, K, T], changed ids in that order)."""
    s = np.ascontiguousarray(lm.transpose(0, 2, 1))
    changed = np.ones(s.shape, dtype=bool)  # a stream's first token always carries its id
    np.not_equal(s[:, :, 1:], s[:, :, :-1], out=changed[:, :, 1:])
    # np.compress: several times faster than boolean indexing (s[changed]) for this.
    return changed, np.compress(changed.reshape(-1), s.reshape(-1))


_POP = np.array([bin(b).count("1") for b in range(256)], dtype=np.int32)
# _UPTO[b, j]: set bits among bits 0..j of byte b, in np.packbits' big-endian bit order.
_UPTO = np.array(
    [[bin(b >> (7 - j)).count("1") for j in range(8)] for b in range(256)], dtype=np.int32
)


def _keep_join(
    mask: np.ndarray, pop: np.ndarray, values: np.ndarray, shape: tuple[int, int, int]
) -> np.ndarray:
    """Inverse of :func:`_keep_split`: position i takes the id of the last changed position at
    or before it in its stream, i.e. ``values[rank(i) - 1]`` with ``rank`` the count of set bits
    up to i (a per-byte prefix count plus a table lookup; several times faster than a cumsum
    over bits). ``pop`` is ``_POP[mask]``, which the caller already needed for the size check."""
    M, T, K = shape
    n = M * T * K
    before = np.cumsum(pop, dtype=np.int32)
    before -= pop
    before -= 1
    rank = np.take(_UPTO, mask, axis=0)
    rank += before[:, None]
    idx = rank.reshape(-1)[:n].reshape(M, K, T).transpose(0, 2, 1)
    return values[idx]


def canonicalize(lm: np.ndarray) -> np.ndarray:
    """Sort the K experts within every row (replay is insensitive to their order)."""
    return sort_rows(lm)


# ---------------------------------------------------------------------------------------------
# body: tokens + valid + rows
# ---------------------------------------------------------------------------------------------
class Block:
    """Decoded body: ``token_ids`` [T] int64, ``experts`` layer-major [M, T, K], ``valid`` [T].

    ``prev_chain``: for a store chunk, the token chain before its first row (what its content
    address is computed from); None for whole records and chunks of older writers.
    ``address_hash``: 1 blake2b-128, 2 blake3-128, 3 blake3-128 rows first (_layout).
    ``chain``: the token chain after its rows, once its address was checked. ``max_id``: the
    largest expert id in its rows (store chunks; -1: none or unknown).

    Not to be changed once built (the codec's and the store's readers share them). A plain
    class with slots, not a frozen dataclass: one is built per store chunk, ~1500 per training
    step's read, on the decode threads while they hold the GIL, and a frozen dataclass's
    ``__init__`` (one ``object.__setattr__`` per field) took 2.1 us against 0.4.
    """

    __slots__ = (
        "address_hash",
        "canonical",
        "chain",
        "experts",
        "max_id",
        "prev_chain",
        "token_ids",
        "valid",
    )  # fmt: skip

    def __init__(
        self,
        token_ids: np.ndarray,
        experts: np.ndarray,
        valid: np.ndarray,
        canonical: bool,
        prev_chain: bytes | None = None,
        address_hash: int = 1,
        chain: bytes | None = None,
        max_id: int = -1,
    ) -> None:
        self.token_ids = token_ids
        self.experts = experts
        self.valid = valid
        self.canonical = canonical
        self.prev_chain = prev_chain
        self.address_hash = address_hash
        self.chain = chain
        self.max_id = max_id

    def __repr__(self) -> str:
        return (
            f"Block(T={self.token_ids.shape[0]}, experts={self.experts.shape}, "
            f"address_hash={self.address_hash}, max_id={self.max_id})"
        )


def _layer_cost(a: np.ndarray, per_layer: bool) -> float:
    """Estimated bits for layer-major ``a`` [M, ...]: one order-0 estimate per layer when each
    layer gets its own Huffman table, else one for all."""
    if per_layer:
        return sum(_cost(a[m]) for m in range(a.shape[0]))
    return _cost(a)


def _value_bounds(changed: np.ndarray) -> list[int]:
    """Where each layer's ids start in the ``keep`` values (after layer 0)."""
    return np.cumsum(changed.reshape(changed.shape[0], -1).sum(axis=1))[:-1].tolist()


def _keep_cost(
    lm: np.ndarray, per_layer: bool, split: tuple[np.ndarray, np.ndarray] | None = None
) -> float:
    changed, values = _keep_split(lm) if split is None else split
    p = float(changed.mean())
    bits = 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    if per_layer:
        parts = np.split(values, _value_bounds(changed))
        return bits * changed.size + sum(_cost(v) for v in parts if v.size)
    return bits * changed.size + _cost(values)


# Row transforms that map layer-major rows to rows of the same shape (``keep`` does not).
_ROWS = {XF_PLAIN: lambda a: a, XF_DELTA: _delta, XF_GAPS: _gaps}


def _transform_cost(xf: int, lm: np.ndarray, per_layer: bool) -> float:
    if xf == XF_KEEP:
        return _keep_cost(lm, per_layer)
    return _layer_cost(_ROWS[xf](lm), per_layer)


def _plane_segments(
    a: np.ndarray, per_layer: bool, bounds: list[int], limit: int | None = None
) -> tuple[list[bytes], int]:
    """(the bytes of ``a`` (flat, layer-major) as compression segments, ``hp``): low bytes split
    at the layer ``bounds`` when ``per_layer``, then the near-constant high bytes of uint16 ids
    (the packed high bits, with ``limit``: :func:`_high_bit_limit`; ``hp`` 0 without)."""
    flat = a.reshape(-1)
    if flat.dtype == np.uint8:
        low, high = flat, None
    else:
        b = flat.view(np.uint8).reshape(-1, 2)
        low, high = np.ascontiguousarray(b[:, 0]), np.ascontiguousarray(b[:, 1])
    if (
        high is not None
        and limit is not None
        and _trits_pay(low, limit, bounds if per_layer else [])
    ):
        # Base-3 high digits (hp 3): the byte plane holds the low 7 bits.
        q = (high << 1) | (low >> 7)
        low = low & 127
        tail = _pack_trits(q)
        high = None
    else:
        tail = None
    if per_layer:
        segs = [low[x:y].tobytes() for x, y in itertools.pairwise([0, *bounds, low.size])]
    else:
        segs = [low.tobytes()]
    hp = 0
    if tail is not None:
        segs.append(tail)
        hp = 3
    elif high is not None:
        if limit is None:
            segs.append(high.tobytes())
        else:
            bits, hp = _high_bits(low, high, limit, bounds)
            segs.append(bits)
    return segs, hp


def _row_segments(
    xf: int,
    lm: np.ndarray,
    per_layer: bool,
    split: tuple[np.ndarray, np.ndarray] | None = None,
    limit: int | None = None,
) -> tuple[list[bytes], int]:
    """(the compression segments of layer-major rows ``lm`` under row transform ``xf``, ``hp``)
    (``split``: ``_keep_split(lm)`` when the caller has it already; ``limit``: packed high
    bits, :func:`_high_bit_limit`)."""
    if xf == XF_KEEP:
        changed, values = _keep_split(lm) if split is None else split
        segs, hp = _plane_segments(values, per_layer, _value_bounds(changed), limit)
        return [np.packbits(changed.reshape(-1)).tobytes(), *segs], hp
    if xf == XF_TOKENS:  # one table: token order mixes the layers
        return _plane_segments(np.ascontiguousarray(lm.transpose(1, 0, 2)), False, [], limit)
    M, T, K = lm.shape
    bounds = [T * K * m for m in range(1, M)]
    return _plane_segments(np.ascontiguousarray(_ROWS[xf](lm)), per_layer, bounds, limit)


def _compress(segments: list[bytes]) -> bytes:
    """One zstd frame; each segment starts a new block (its own Huffman table). Token ids and
    rows apart save ~1% on a 128-row store chunk: one table for both codes neither well."""
    co = _zc().compressobj(size=sum(len(x) for x in segments))
    out = []
    for seg in segments:
        if seg:
            out.append(co.compress(seg))
            out.append(co.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(co.flush())
    return b"".join(out)


def encode_body(
    token_ids: np.ndarray,
    experts_lm: np.ndarray,
    valid: np.ndarray,
    num_experts: int,
    *,
    canonical_order: bool = False,
    presorted: bool = False,
    transform: int | None = None,
) -> dict[str, Any]:
    """Payload fields for a block of rows; ``experts_lm`` is layer-major ``[M, T, K]``.

    ``canonical_order`` stores rows in canonical form (see :func:`canonicalize`);
    ``presorted`` says the caller already canonicalised them. ``transform`` forces a row
    transform (tests and benchmarks); by default the smallest estimate wins.
    """
    M, T, K = experts_lm.shape
    if canonical_order and not presorted:
        experts_lm = canonicalize(experts_lm)
    per_layer = M > 1 and T * K >= _LAYER_BLOCK_MIN
    # Candidate row transforms, chosen by an order-0 entropy estimate on a sample (a good proxy
    # for zstd's Huffman stage, which is what codes near-random symbols).
    candidates = [XF_PLAIN]
    if T > 1:
        candidates += [XF_DELTA, XF_KEEP]  # slots kept in place; kept slots + skewed new ids
    if canonical_order:
        candidates.append(XF_GAPS)  # sorted rows without locality
    keep_split = None
    if transform is not None:
        if transform not in (*candidates, XF_TOKENS):
            raise ValueError(f"row transform {transform} does not apply to this block")
        xf = transform
    elif experts_lm.size and len(candidates) > 1:
        sample = _sample_tokens(experts_lm)
        est = {}
        for x in candidates:
            if x == XF_KEEP:
                split = _keep_split(sample)
                # A store chunk is its own sample: its split is kept for the encode (a fifth of
                # a chunk's encode time).
                keep_split = split if sample is experts_lm else None
                est[x] = _keep_cost(sample, per_layer, split)
            else:
                est[x] = _transform_cost(x, sample, per_layer)
        xf = min(est, key=est.__getitem__)
        # Plain decodes fastest (zstd alone); a transform must save >= 1% to be worth its
        # decode pass. On uniform routes every estimate is within sampling noise of plain.
        if est[xf] > 0.99 * est[XF_PLAIN]:
            xf = XF_PLAIN
    else:
        xf = XF_PLAIN
    tok = token_ids.astype("<u4", copy=False).tobytes()
    head = tok + np.packbits(valid).tobytes()
    # Token order: what it saves is zstd matches, which no order-0 estimate sees, so it is
    # tried by compressing. Only for rows shorter than zstd's minimum match (5 to 7 bytes):
    # longer rows match within a layer. A large block is tried on a sample, both ways
    # (~0.05 ms); a small one whole, against the body it gets anyway.
    trial = None
    wide = experts_lm.dtype == np.uint16 and _PACK_HIGH_BITS
    lim_t = _high_bit_limit(num_experts, XF_TOKENS) if wide else None
    if transform is None and T > 1 and experts_lm.size and K * experts_lm.itemsize < 8:
        trial = _sample_tokens(experts_lm, _TRIAL)
        lim = _high_bit_limit(num_experts, xf) if wide else None
        if trial is not experts_lm and len(
            _compress(_row_segments(XF_TOKENS, trial, False, limit=lim_t)[0])
        ) < 0.97 * len(_compress(_row_segments(xf, trial, False, limit=lim)[0])):
            xf = XF_TOKENS
    lim = _high_bit_limit(num_experts, xf) if wide else None
    rows, hp = _row_segments(xf, experts_lm, per_layer, keep_split, lim)
    segments = [head, *rows]
    body = _compress(segments)
    if trial is experts_lm:
        alt_rows, alt_hp = _row_segments(XF_TOKENS, experts_lm, False, limit=lim_t)
        alt = [head, *alt_rows]
        alt_body = _compress(alt)
        if len(alt_body) < 0.97 * len(body):
            xf, segments, body, hp = XF_TOKENS, alt, alt_body, alt_hp
    out = {
        "T": T,
        "M": M,
        "K": K,
        "E": num_experts,
        "xf": xf,
        "canon": canonical_order,
        "raw": sum(len(x) for x in segments),
        "body": body,
    }
    if hp:
        # 2: grouped (format 6); 1: in id order (format 5); absent: older readers' byte plane.
        out["hp"] = hp
    return out


_INT = {int}
_MAX_ZSTD_RATIO = 32768


def decode_body(p: dict[str, Any], what: str) -> Block:
    # Written out field by field: this runs once per chunk, ~1500 times for a training step's
    # batch, on the decode threads while they hold the GIL.
    try:
        T = p["T"]
        M = p["M"]
        K = p["K"]
        E = p["E"]
        xf = p["xf"]
        raw_len = p["raw"]
        body = p["body"]
        canonical = bool(p.get("canon", False))
    except KeyError as exc:
        raise RouteCorruptError(f"{what}: payload field {exc} missing") from exc
    if {type(T), type(M), type(K), type(E), type(xf), type(raw_len)} != _INT or not isinstance(
        body, bytes
    ):
        raise RouteCorruptError(f"{what}: payload size fields or body have the wrong type")
    if min(T, M, K, raw_len) < 0 or not 1 <= E <= 65536:
        raise RouteCorruptError(f"{what}: size field out of range (T={T}, M={M}, K={K}, E={E})")
    dtype = expert_dtype(E)
    # A zstd block holds at most 128 KiB and takes at least 4 bytes (an RLE block), so no frame
    # decompresses to more than 32768x its size: a larger claim is refused before it is
    # allocated (python-zstandard allocates what the frame header claims).
    if raw_len > _MAX_ZSTD_RATIO * len(body):
        raise RouteCorruptError(
            f"{what}: a {len(body)}-byte compressed body cannot hold the {raw_len} bytes its "
            "header claims"
        )
    try:
        raw = _zd().decompress(body, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise RouteCorruptError(f"{what}: compressed body is corrupted: {exc}") from exc
    except MemoryError as exc:  # a claim within that ratio, still too large for this host
        raise RouteCorruptError(
            f"{what}: cannot allocate the {raw_len} bytes its header claims"
        ) from exc
    if len(raw) != raw_len:
        raise RouteCorruptError(f"{what}: body holds {len(raw)} bytes, header says {raw_len}")
    mv = memoryview(raw)
    vb = (T + 7) // 8
    if xf not in _TRANSFORMS:
        raise RouteCorruptError(f"{what}: unknown row transform {xf}")
    n = M * T * K
    hp = p.get("hp", 0)
    if type(hp) is not int or hp not in (0, 1, 2, 3):
        raise RouteCorruptError(f"{what}: high-bits field {hp!r} is not 0, 1, 2 or 3")
    limit = _high_bit_limit(E, xf) if hp else None
    if hp and limit is None:
        raise RouteCorruptError(
            f"{what}: packed high bits need 257 to 512 experts and the ids as values (E={E}, "
            f"transform {xf})"
        )
    if hp == 3 and E > _TRITS_MAX_E:
        raise RouteCorruptError(f"{what}: base-3 high digits need 257 to 384 experts (E={E})")
    mask = None
    n_hi = 0
    if xf == XF_KEEP:
        mb = (n + 7) // 8
        if raw_len < 4 * T + vb + mb:
            raise RouteCorruptError(f"{what}: body size {raw_len} too small for its change bits")
        mask = np.frombuffer(mv[4 * T + vb : 4 * T + vb + mb], dtype=np.uint8)
        pop = _POP[mask]
        n_values = int(pop.sum())
        if dtype.itemsize == 1:
            n_rows = mb + n_values
        else:
            size, n_hi = _split_high(mv[4 * T + vb + mb :], n_values, limit, what, hp)
            n_rows = mb + size
    elif dtype.itemsize == 1:
        n_rows = n
    else:
        n_rows, n_hi = _split_high(mv[4 * T + vb :], n, limit, what, hp)
    if raw_len != 4 * T + vb + n_rows:
        raise RouteCorruptError(
            f"{what}: body size {raw_len} does not match T={T}, M={M}, K={K}, E={E}"
        )
    token_ids = np.frombuffer(mv[: 4 * T], dtype="<u4").astype(np.int64)
    valid = np.unpackbits(np.frombuffer(mv[4 * T : 4 * T + vb], dtype=np.uint8), count=T)
    if mask is not None:
        # Every stream's first token must carry an id: its bit is set (else the gather below
        # would read another stream's id).
        first = np.arange(M * K, dtype=np.int64) * T
        if n and not ((mask[first >> 3] >> (7 - (first & 7)).astype(np.uint8)) & 1).all():
            raise RouteCorruptError(f"{what}: change bits leave a stream without its first id")
        if n % 8 and mask[-1] & ((1 << (8 - n % 8)) - 1):
            raise RouteCorruptError(f"{what}: change bits set past the last row")
        vals = mv[4 * T + vb + mask.size :]
        if limit is None:
            values = _join_planes(vals, (n_values,), dtype)
        elif hp == 3:
            values = _join_trits(vals, (n_values,), what)
        else:
            groups = (mask, K * T, M) if hp == 2 else None
            values = _join_high(vals, (n_values,), limit, n_hi, groups)
        if not n:
            lm = np.empty((M, T, K), dtype)
        elif _KERNEL is not None:
            lm = np.empty((M, T, K), dtype)
            try:
                _KERNEL.keep_join(mask, values, lm, M, T, K, dtype.itemsize)
            except ValueError as exc:  # the checks above make this unreachable; kept as a guard
                raise RouteCorruptError(f"{what}: {exc}") from exc
        else:
            lm = _keep_join(mask, pop, values, (M, T, K))
    elif limit is None:
        lm = _join_planes(mv[4 * T + vb :], (M, T, K), dtype)
    elif hp == 3:
        lm = _join_trits(mv[4 * T + vb :], (M, T, K), what)
    else:
        # Format 6 groups by layer; the tokens order interleaves the layers: one group.
        groups = None
        if hp == 2:
            groups = (None, n, 1) if xf == XF_TOKENS else (None, T * K, M)
        lm = _join_high(mv[4 * T + vb :], (M, T, K), limit, n_hi, groups)
    if xf == XF_TOKENS:  # stored [T, M, K]: a strided layer-major view, no copy
        lm = lm.reshape(T, M, K).transpose(1, 0, 2)
    elif xf == XF_DELTA:
        lm = np.cumsum(lm, axis=1, dtype=dtype)
    elif xf == XF_GAPS:
        lm = _ungaps(lm)
    prev = p.get("pc")
    if prev is not None and not isinstance(prev, bytes):
        raise RouteCorruptError(f"{what}: chain field has the wrong type")
    ha = p.get("ha", 1)
    if ha not in (1, 2, 3):
        raise RouteCorruptError(f"{what}: unknown address hash {ha!r}")
    return Block(
        token_ids=token_ids,
        experts=lm,
        valid=valid.view(bool),  # unpackbits gives 0/1 bytes
        canonical=canonical,
        prev_chain=prev,
        address_hash=ha,
    )


# ---------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------
def encode_record(record: RouteRecord, *, canonical_order: bool = False) -> bytes:
    """Encode a whole record into one self-checking blob.

    ``canonical_order=True`` sorts the K experts of each row (replay does not depend on their
    order) and lets the codec reach the order-insensitive information bound; the decoded record
    then has sorted rows. The default round-trips every byte exactly.
    """
    payload = encode_body(
        record.token_ids,
        record.layer_major(),
        record.valid,
        record.num_experts,
        canonical_order=canonical_order,
    )
    payload.update(record_fields(record))
    return frame(KIND_RECORD, payload)


def record_fields(record: RouteRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "moe": list(record.moe_layers),
        "L": record.num_layers,
        "pl": record.prompt_len,
        "nc": record.num_cached_tokens,
        "model": record.model,
        "meta": record.metadata,
    }
    if record.weight_versions:  # absent when unknown: blobs of older writers read the same
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
    p = unframe(blob, KIND_RECORD, what)
    block = decode_body(p, what)
    lm = block.experts
    if not lm.flags.writeable:
        # The plain uint8 path views the decompressed bytes; a decoded record owns writable
        # arrays on every path, as joined store reads do.
        lm = lm.copy()
    return record_from_parts(p, block.token_ids, lm.transpose(1, 0, 2), block.valid, what)
