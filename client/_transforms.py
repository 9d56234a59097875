"""Row transforms: how a block's expert rows become the byte segments zstd compresses, and back.

Rows are layer-major ``[M, T, K]``: the trainer consumes one ``[tokens, K]`` target per layer,
neighbouring tokens of one layer are what correlate, and zstd sees each layer as one stream.
A writer picks one transform per block by an order-0 entropy estimate on a sample
(:func:`choose_transform`); docs/CONTRACTS.md specifies the bytes of each.

- ``plain``: rows as they are. Uniformly random routes cost ~log2(E) bits per id after zstd's
  Huffman stage, within 1% of the log2(E!/(E-K)!) information bound.
- ``delta``: each id minus the same slot of the previous token in the same layer (mod 2^bits).
  Real routers keep many experts from one token to the next; those slots become zeros.
- ``keep``: per (layer, slot) stream along the tokens, a bit per token saying whether the expert
  changed from the previous token, then only the changed experts' ids. Kept slots cost ~1 bit,
  new ids keep their layer's popularity skew (``delta`` turns them near-uniform).
- ``tokens``: plain rows in token order ``[T, M, K]``. zstd's match finder then sees a token's
  ids of every layer together: a trained model routes a repeated context alike in many layers,
  which a layer's own stream holds as rows of only ``K`` bytes, too short for a match when
  ``K * itemsize < 8``. Chosen only where a trial compression saves >= 3%.
- ``gaps`` (only with ``canonical_order=True``): each row sorted, then stored as the gaps
  between consecutive experts; near-geometric for uniform routes, so one Huffman table codes
  them within ~5% of the order-insensitive bound log2 C(E, K).

Ids of 257 to 512 experts (uint16) keep a low-byte plane and code their high bits compactly
(``hp``): packed bits (1), the same bits grouped by low byte (2), or, for up to 384 experts,
the low 7 bits as the byte plane and bits 7-8 as base-3 digits (3).
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np

from ._errors import RouteCorruptError
from ._record import expert_dtype
from ._zstd import compress, zc

XF_PLAIN = 0
XF_DELTA = 1
XF_GAPS = 2
XF_KEEP = 3
XF_TOKENS = 4
TRANSFORMS = (XF_PLAIN, XF_DELTA, XF_GAPS, XF_KEEP, XF_TOKENS)

# Entropy estimate sample: enough symbols for a stable histogram, cheap next to compression.
_SAMPLE = 1 << 16
# Trial compression sample for the token order: matches need whole runs of tokens, a few KB;
# a 128-token store chunk of a top-2 router (up to 64 layers) is tried whole.
_TRIAL = 1 << 14
# A layer whose symbols fill at least this many bytes gets zstd blocks of its own, hence its own
# Huffman table (~50-100 bytes): real routers' expert popularity differs per layer, and one
# table for all layers codes their mixture, which is nearly uniform. Smaller layers (a 128-token
# store chunk holds ~1 KB per layer) share one table: a table each would cost more than it saves.
LAYER_BLOCK_MIN = 8192


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


# Grouped high bits are written where zstd codes them in at most this share of their packed
# size (tests raise it to force them).
_GROUPED_GAIN = 0.9


def high_bit_limit(num_experts: int, xf: int) -> int | None:
    """Low bytes below this carry a stored high bit (``hp`` 1), for ids of 257 to 512 experts
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
    ``groups`` (the segment bounds), grouped where that pays (``hp`` 2: within each
    segment ordered by low byte, then by position, :func:`_group_order`), else in id order
    (``hp`` 1)."""
    sel = low < limit
    ordered = np.packbits(high[sel]).tobytes()
    if groups is None:
        return ordered, 1
    grouped = np.packbits(high[_group_order(low, sel, groups)]).tobytes()
    # Grouped bits take a second pass over the ids to decode (~10% of a record's decode): worth
    # it where zstd codes them smaller, i.e. where the router is skewed. A uniform router's
    # bits are random in any order; they stay in id order.
    if len(zc().compress(grouped)) <= _GROUPED_GAIN * len(ordered):
        return grouped, 2
    return ordered, 1


def _group_order(low: np.ndarray, sel: np.ndarray, bounds: list[int]) -> np.ndarray:
    """Positions of the selected ids, segment by segment (split at ``bounds``), each segment's
    ordered by low byte and then by position: the order of grouped high bits (``hp`` 2)."""
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
    (``data``: exactly those bytes, checked by :func:`_split_high`). ``groups`` (``hp`` 2):
    ``(mask, seg_len, nseg)``, the segments the bits are grouped in: ``nseg`` of ``seg_len``
    ids, or with ``mask`` (the keep transform's change bits) of as many ids as each one's part
    of the mask has bits set."""
    n = math.prod(shape)
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


# Base-3 high digits (hp 3) for ids of 257 to 384 experts: the low 7 bits as the byte
# plane, bits 7-8 (0 to 2) five to a byte. Uniform 384-expert ids: 7 + 1.6 = 8.6 bits each,
# against 8.67 for a byte plane plus a bit (hp 1), which zstd stores raw (docs/storage.md).
TRITS_MAX_E = 384
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
    if limit > TRITS_MAX_E - 256 or not low.size:
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


# Ids joined per slice of whole (block, layer) units: the join's temporaries (two bytes of
# change bits and prefix count, an 8-byte rank and the joined id per id) stay about 10 MiB
# whatever a record's size, so a decode allocates little beyond the rows it returns.
_JOIN_SLICE = 1 << 20
# From this many streams of under 256 tokens, the prefix count runs token by token: one vector
# add across every stream per token (numpy's cumsum along a short row is a scalar loop; the
# adds are vectorised over the streams, plus a call per token: tests/client/keep_join_costs.py
# measures both).
_TOKEN_MAJOR_MIN_STREAMS = 1024


def keep_join(
    masks: np.ndarray, values: np.ndarray, shape: tuple[int, ...], lengths: np.ndarray
) -> np.ndarray | None:
    """Inverse of :func:`_keep_split` for ``G`` blocks at once: ``masks`` their change bits one
    after another (``G`` x ``M * K * T`` bits, no padding between blocks), ``values`` their
    changed ids one after another (``lengths[g]`` of block g); returns ``[G, M, T, K]``
    (``shape``), C-contiguous, or None where a block's bits do not count its ids exactly or
    leave a stream without its first id (the caller then checks each block to name it).

    Position i of a stream takes ``values[rank(i) - 1]``, ``rank`` the count of set bits up to
    i: numpy has no "last changed id" scan, so it is an unpack, a prefix count and a gather,
    over whole slices of the batch (one call each per slice instead of one per chunk: a
    training step's read has ~1500 chunks)."""
    G, M, T, K = shape
    out = np.empty(shape, values.dtype)
    if not out.size:
        return out if not lengths.any() else None
    units, per = G * M, K * T  # a unit: one block's layer, its K streams of T tokens
    # Slices start on a byte of the masks: a multiple of 8 / gcd(per, 8) units each.
    align = 8 // math.gcd(per, 8)
    step = -(-max(1, _JOIN_SLICE // per) // align) * align
    counts = np.empty(units * K, np.intp)  # ids per stream
    rows = out.reshape(units, T, K)
    done = 0
    for u0 in range(0, units, step):
        u1 = min(units, u0 + step)
        got = _join_slice(masks[u0 * per >> 3 :], values, done, (u1 - u0) * K, T)
        if got is None:
            return None
        streams, c = got
        rows[u0:u1] = streams.reshape(u1 - u0, K, T).transpose(0, 2, 1)
        counts[u0 * K : u1 * K] = c
        done += int(c.sum())
    if not np.array_equal(counts.reshape(G, -1).sum(axis=1), lengths):
        return None
    return out


def _join_slice(
    masks: np.ndarray, values: np.ndarray, done: int, n_streams: int, T: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """``n_streams`` streams of ``T`` ids from the change bits at the start of ``masks``, whose
    first id is ``values[done]``: (the streams ``[n_streams, T]``, possibly a transposed view;
    ids per stream), or None where a stream has no first id or the bits count more ids than
    ``values`` holds."""
    bits = np.unpackbits(masks, count=n_streams * T).reshape(n_streams, T)
    if not bits[:, 0].all():
        return None
    token_major = n_streams >= _TOKEN_MAJOR_MIN_STREAMS and T < 256
    # The rank within each stream fits a byte for streams of up to 255 tokens (store chunks),
    # two up to 65535 (whole records); the stream's first value's index is added after, into
    # intp: numpy's take converts any other index dtype first, which cost more than the gather.
    if token_major:
        local = _token_prefix_count(bits)  # [T, n_streams]
        counts = local[-1].astype(np.intp)
    else:
        local = np.cumsum(bits, axis=1, dtype=np.uint8 if T < 256 else np.uint16 if T < 65536
                          else np.intp)  # fmt: skip
        counts = local[:, -1].astype(np.intp)
    base = np.cumsum(counts)
    if done + int(base[-1]) > values.size:
        return None
    base -= counts
    base += done - 1
    if token_major:
        return values.take(np.add(local, base, dtype=np.intp)).T, counts
    return values.take(np.add(local, base[:, None], dtype=np.intp)), counts


def _token_prefix_count(bits: np.ndarray) -> np.ndarray:
    """The running count of set bits along each row of ``bits`` ``[S, T]`` (``T`` < 256), as
    ``[T, S]`` uint8: token by token, one add across all ``S`` streams each."""
    bt = np.ascontiguousarray(bits.T)
    for t in range(1, bt.shape[0]):
        np.add(bt[t - 1], bt[t], out=bt[t])
    return bt


def canonicalize(lm: np.ndarray) -> np.ndarray:
    """Sort the K experts within every row (replay is insensitive to their order)."""
    return sort_rows(lm)


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
    (the packed high bits, with ``limit``: :func:`high_bit_limit`; ``hp`` 0 without)."""
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


def row_segments(
    xf: int,
    lm: np.ndarray,
    per_layer: bool,
    split: tuple[np.ndarray, np.ndarray] | None = None,
    limit: int | None = None,
) -> tuple[list[bytes], int]:
    """(the compression segments of layer-major rows ``lm`` under row transform ``xf``, ``hp``)
    (``split``: ``_keep_split(lm)`` when the caller has it already; ``limit``: packed high
    bits, :func:`high_bit_limit`)."""
    if xf == XF_KEEP:
        changed, values = _keep_split(lm) if split is None else split
        segs, hp = _plane_segments(values, per_layer, _value_bounds(changed), limit)
        return [np.packbits(changed.reshape(-1)).tobytes(), *segs], hp
    if xf == XF_TOKENS:  # one table: token order mixes the layers
        return _plane_segments(np.ascontiguousarray(lm.transpose(1, 0, 2)), False, [], limit)
    M, T, K = lm.shape
    bounds = [T * K * m for m in range(1, M)]
    return _plane_segments(np.ascontiguousarray(_ROWS[xf](lm)), per_layer, bounds, limit)


# ---------------------------------------------------------------------------------------------
# the interface of a body (``_body``): choosing a transform, joining stored ids
# ---------------------------------------------------------------------------------------------
def choose_transform(
    experts_lm: np.ndarray, per_layer: bool, canonical: bool, transform: int | None
) -> tuple[int, tuple[np.ndarray, np.ndarray] | None]:
    """(the row transform, the keep split where it was computed on the whole block) for
    layer-major rows; ``transform`` forces one (tests and benchmarks)."""
    T = experts_lm.shape[1]
    candidates = [XF_PLAIN]
    if T > 1:
        candidates += [XF_DELTA, XF_KEEP]  # slots kept in place; kept slots + skewed new ids
    if canonical:
        candidates.append(XF_GAPS)  # sorted rows without locality
    if transform is not None:
        if transform not in (*candidates, XF_TOKENS):
            raise ValueError(f"row transform {transform} does not apply to this block")
        return transform, None
    if not experts_lm.size or len(candidates) == 1:
        return XF_PLAIN, None
    # An order-0 entropy estimate on a sample: a good proxy for zstd's Huffman stage, which is
    # what codes near-random symbols.
    sample = _sample_tokens(experts_lm)
    est: dict[int, float] = {}
    keep_split = None
    for x in candidates:
        if x == XF_KEEP:
            split = _keep_split(sample)
            # A store chunk is its own sample: its split is kept for the encode.
            keep_split = split if sample is experts_lm else None
            est[x] = _keep_cost(sample, per_layer, split)
        else:
            est[x] = _transform_cost(x, sample, per_layer)
    xf = min(est, key=est.__getitem__)
    # Plain decodes fastest (zstd alone); a transform must save >= 1% to be worth its decode
    # pass. On uniform routes every estimate is within sampling noise of plain.
    if est[xf] > 0.99 * est[XF_PLAIN]:
        return XF_PLAIN, None
    return xf, keep_split if xf == XF_KEEP else None


def limit_for(num_experts: int, xf: int, lm: np.ndarray) -> int | None:
    """The high-bit limit of ``xf`` for uint16 rows (:func:`high_bit_limit`); None for uint8."""
    return high_bit_limit(num_experts, xf) if lm.dtype == np.uint16 else None


def tokens_wins(lm: np.ndarray, xf: int, num_experts: int) -> bool | None:
    """Whether the token order beats ``xf`` on a trial sample by >= 3%; None where the block is
    its own sample (the caller compares the whole bodies instead). Only for rows shorter than
    zstd's minimum match (5 to 7 bytes): longer rows match within a layer, and what the token
    order saves is zstd matches, which no order-0 estimate sees."""
    trial = _sample_tokens(lm, _TRIAL)
    if trial is lm:
        return None
    lim_t = limit_for(num_experts, XF_TOKENS, lm)
    tok = compress(row_segments(XF_TOKENS, trial, False, limit=lim_t)[0])
    other = compress(row_segments(xf, trial, False, limit=limit_for(num_experts, xf, lm))[0])
    return len(tok) < 0.97 * len(other)


def join_values(
    data: memoryview,
    n: int,
    shape: tuple[int, ...],
    coding: tuple[int, int, int],
    groups: tuple[np.ndarray | None, int, int] | None,
    what: str,
) -> np.ndarray:
    """``n`` ids (``shape``) of a body's rows, which ``data`` must hold exactly, stored under
    ``coding`` ``(E, xf, hp)``; ``groups``: see :func:`_join_high` (None: by the rows'
    layers)."""
    E, xf, hp = coding
    dtype = expert_dtype(E)
    limit = high_bit_limit(E, xf) if hp else None
    if dtype.itemsize == 1 or limit is None:
        size = n * dtype.itemsize
    elif hp == 3:
        size = n + (n + 4) // 5
    else:
        size, n_hi = _split_high(data, n, limit, what, hp)
    if len(data) != size:
        raise RouteCorruptError(
            f"{what}: a size of {len(data)} bytes for its ids does not match the {size} that "
            f"{n} ids of E={E} take under transform {xf}"
        )
    if limit is None:
        return _join_planes(data, shape, dtype)
    if hp == 3:
        return _join_trits(data, shape, what)
    if hp == 2 and groups is None:  # layer-major rows group by layer; token order is one group
        M, T, K = shape
        groups = (None, n, 1) if xf == XF_TOKENS else (None, T * K, M)
    return _join_high(data, shape, limit, n_hi, groups if hp == 2 else None)


def invert(xf: int, lm: np.ndarray) -> np.ndarray:
    """Layer-major rows ``[M, T, K]`` from the joined values ``lm`` of row transform ``xf``."""
    if xf == XF_TOKENS:  # stored [T, M, K]: a strided layer-major view, no copy
        M, T, K = lm.shape
        return lm.reshape(T, M, K).transpose(1, 0, 2)
    if xf == XF_DELTA:
        return np.cumsum(lm, axis=1, dtype=lm.dtype)
    if xf == XF_GAPS:
        return _ungaps(lm)
    return lm


def count_ones(mask: np.ndarray) -> int:
    """Set bits in a byte array (a ``keep`` body's change bits: the ids it stores)."""
    return int(_POP[mask].sum())
