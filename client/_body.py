"""A block's body: token ids, validity and expert rows, as one zstd frame (docs/CONTRACTS.md)::

    token ids  uint32 LE [T] | valid  packbits [ceil(T / 8)] | rows (the row transform's bytes)

Records hold one body, store chunks one each. Decoding checks every size against the header's
fields before it trusts them; a body that fails names what is wrong (RouteCorruptError).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _transforms as X
from ._errors import RouteCorruptError
from ._zstd import compress, decompress_exact


@dataclass(frozen=True)
class BodyHead:
    """The fields that say how to read a body: rows ``[M, T, K]`` of ids below ``E``, row
    transform ``xf``, high-bit coding ``hp``, ``canonical`` rows, ``raw_len`` decompressed bytes."""

    T: int
    M: int
    K: int
    E: int
    xf: int
    hp: int
    canonical: bool
    raw_len: int

    def check(self, what: str) -> None:
        if min(self.T, self.M, self.K, self.raw_len) < 0 or not 1 <= self.E <= 65536:
            raise RouteCorruptError(
                f"{what}: size field out of range (T={self.T}, M={self.M}, K={self.K}, E={self.E})"
            )
        if self.xf not in X.TRANSFORMS:
            raise RouteCorruptError(f"{what}: unknown row transform {self.xf}")
        if self.hp not in (0, 1, 2, 3):
            raise RouteCorruptError(f"{what}: high-bits field {self.hp!r} is not 0, 1, 2 or 3")
        if self.hp and X.high_bit_limit(self.E, self.xf) is None:
            raise RouteCorruptError(
                f"{what}: packed high bits need 257 to 512 experts and the ids as values "
                f"(E={self.E}, transform {self.xf})"
            )
        if self.hp == 3 and self.E > X.TRITS_MAX_E:
            raise RouteCorruptError(
                f"{what}: base-3 high digits need 257 to 384 experts (E={self.E})"
            )
        lo, hi = self.raw_bounds()
        if not lo <= self.raw_len <= hi:
            raise RouteCorruptError(
                f"{what}: body size {self.raw_len} cannot hold T={self.T}, M={self.M}, "
                f"K={self.K}, E={self.E} under transform {self.xf} (between {lo} and {hi})"
            )

    def raw_bounds(self) -> tuple[int, int]:
        """The least and most bytes a decompressed body of this head can hold: exact but for
        packed high bits (their count depends on the ids) and ``keep`` (the changed ids)."""
        n = self.M * self.T * self.K
        head = 4 * self.T + (self.T + 7) // 8
        if self.xf != X.XF_KEEP:
            return head + self._values_size(n, False), head + self._values_size(n, True)
        mask = head + (n + 7) // 8
        first = self.M * self.K if self.T else 0  # every stream's first id is stored
        return mask + self._values_size(first, False), mask + self._values_size(n, True)

    def _values_size(self, n: int, most: bool) -> int:
        """Bytes of ``n`` stored ids (``most``: with every packed high bit present)."""
        if self.E <= 256:
            return n
        if self.hp == 0:
            return 2 * n
        if self.hp == 3:
            return n + (n + 4) // 5
        return n + (n + 7) // 8 if most else n


class Block:
    """Decoded body: ``token_ids`` [T] int64, ``experts`` layer-major [M, T, K], ``valid`` [T].

    ``prev_chain``: for a store chunk, the token chain before its first row (what its content
    address is computed from); None for whole records. ``chain``: the token chain after its
    rows, once its address was checked. ``max_id``: the largest expert id in its rows (-1: none
    or unknown). ``weights``: a store chunk's weights plane, if it has one. Not to be changed
    once built: the codec's and the store's readers share them.
    A slots class: one is built per store chunk, ~1500 per training step's read.
    """

    __slots__ = (
        "canonical", "chain", "experts", "max_id", "prev_chain", "token_ids", "valid", "weights",
        "weights_dtype",
    )  # fmt: skip

    def __init__(
        self,
        token_ids: np.ndarray,
        experts: np.ndarray,
        valid: np.ndarray,
        canonical: bool,
        prev_chain: bytes | None = None,
        chain: bytes | None = None,
        max_id: int = -1,
    ) -> None:
        self.token_ids = token_ids
        self.experts = experts
        self.valid = valid
        self.canonical = canonical
        self.prev_chain = prev_chain
        self.chain = chain
        self.max_id = max_id
        # A store chunk's weights plane: [M, T, K] float32 and its stored dtype; None: none.
        self.weights: np.ndarray | None = None
        self.weights_dtype: str | None = None

    def __repr__(self) -> str:
        return f"Block(T={self.token_ids.shape[0]}, experts={self.experts.shape})"


# ---------------------------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------------------------
def encode_body(
    token_ids: np.ndarray,
    experts_lm: np.ndarray,
    valid: np.ndarray,
    num_experts: int,
    *,
    canonical_order: bool = False,
    presorted: bool = False,
    transform: int | None = None,
) -> tuple[BodyHead, bytes]:
    """(the head, the zstd frame) of a block of rows; ``experts_lm`` is layer-major ``[M, T, K]``.

    ``canonical_order`` stores rows in canonical form (:func:`canonicalize`); ``presorted``
    says the caller already canonicalised them. ``transform`` forces a row transform (tests and
    benchmarks); by default the smallest estimate wins.
    """
    M, T, K = experts_lm.shape
    if canonical_order and not presorted:
        experts_lm = X.canonicalize(experts_lm)
    per_layer = M > 1 and T * K >= X.LAYER_BLOCK_MIN
    xf, keep_split = X.choose_transform(experts_lm, per_layer, canonical_order, transform)
    head = token_ids.astype("<u4", copy=False).tobytes() + np.packbits(valid).tobytes()
    whole_trial = False
    if transform is None and T > 1 and experts_lm.size and K * experts_lm.itemsize < 8:
        wins = X.tokens_wins(experts_lm, xf, num_experts)
        whole_trial = wins is None
        if wins:
            xf = X.XF_TOKENS
    lim = X.limit_for(num_experts, xf, experts_lm)
    rows, hp = X.row_segments(xf, experts_lm, per_layer, keep_split, lim)
    segments = [head, *rows]
    body = compress(segments)
    if whole_trial:  # a small block: both bodies compressed whole, the smaller kept
        lim_t = X.limit_for(num_experts, X.XF_TOKENS, experts_lm)
        alt_rows, alt_hp = X.row_segments(X.XF_TOKENS, experts_lm, False, limit=lim_t)
        alt_body = compress([head, *alt_rows])
        if len(alt_body) < 0.97 * len(body):
            xf, segments, body, hp = X.XF_TOKENS, [head, *alt_rows], alt_body, alt_hp
    raw = sum(len(x) for x in segments)
    return BodyHead(T, M, K, num_experts, xf, hp, canonical_order, raw), body


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------
def decompress(head: BodyHead, body: bytes | memoryview, what: str) -> bytes:
    """The decompressed body, its size checked against ``head`` before anything is allocated."""
    return decompress_exact(body, head.raw_len, what)


class Parsed:
    """A decompressed body, checked, before its rows are joined: ``lm`` the layer-major rows
    where they need no join, else ``mask`` and ``values`` for :func:`X.keep_join` (uint8 ids,
    which a batch joins at once)."""

    __slots__ = ("head", "lm", "mask", "token_bytes", "token_ids", "valid", "values")

    def __init__(self, head: BodyHead, token_bytes: memoryview, valid: np.ndarray) -> None:
        self.head = head
        self.token_bytes = token_bytes  # uint32 LE, as stored: what the token chain hashes
        self.token_ids = np.frombuffer(token_bytes, dtype="<u4").astype(np.int64)
        self.valid = valid
        self.lm: np.ndarray | None = None
        self.mask: np.ndarray | None = None
        self.values: np.ndarray | None = None


def parse_body(head: BodyHead, raw: bytes, what: str) -> Parsed:
    """Check a decompressed body's sizes against ``head`` and split it (see :class:`Parsed`)."""
    T, M, K, xf = head.T, head.M, head.K, head.xf
    mv = memoryview(raw)
    vb = (T + 7) // 8
    if head.raw_len < 4 * T + vb:
        raise RouteCorruptError(f"{what}: body size {head.raw_len} too small for {T} tokens")
    p = Parsed(
        head,
        mv[: 4 * T],
        np.unpackbits(np.frombuffer(mv[4 * T : 4 * T + vb], np.uint8), count=T).view(bool),
    )
    rows = mv[4 * T + vb :]
    if xf == X.XF_KEEP:
        _parse_keep(p, rows, what)
    else:
        p.lm = X.join_values(rows, M * T * K, (M, T, K), (head.E, xf, head.hp), None, what)
    return p


def _parse_keep(p: Parsed, rows: memoryview, what: str) -> None:
    h = p.head
    n = h.M * h.T * h.K
    mb = (n + 7) // 8
    if len(rows) < mb:
        raise RouteCorruptError(f"{what}: body size {h.raw_len} too small for its change bits")
    mask = np.frombuffer(rows[:mb], np.uint8)
    if h.E <= 256 and n % 8 == 0:
        # uint8 ids, whole mask bytes: joined, and checked, with the rest of the caller's batch
        # (check_keep names a block the batch check refuses).
        p.mask, p.values = mask, np.frombuffer(rows[mb:], np.uint8)
        return
    values = check_keep(p, mask, rows[mb:], what)
    p.lm = X.keep_join(mask, values, (1, h.M, h.T, h.K), np.array([values.size]))[0]


def check_keep(p: Parsed, mask: np.ndarray, data: memoryview, what: str) -> np.ndarray:
    """The ids of a ``keep`` body after its change bits ``mask``, every size and bit checked."""
    h = p.head
    M, T, K = h.M, h.T, h.K
    n = M * T * K
    # Every stream's first token must carry an id: its bit is set (else the join would read
    # another stream's id).
    first = np.arange(M * K, dtype=np.int64) * T
    if n and not ((mask[first >> 3] >> (7 - (first & 7)).astype(np.uint8)) & 1).all():
        raise RouteCorruptError(f"{what}: change bits leave a stream without its first id")
    if n % 8 and mask[-1] & ((1 << (8 - n % 8)) - 1):
        raise RouteCorruptError(f"{what}: change bits set past the last row")
    n_values = X.count_ones(mask)
    groups = (mask, K * T, M) if h.hp == 2 else None
    return X.join_values(data, n_values, (n_values,), (h.E, h.xf, h.hp), groups, what)


def join_parsed(parsed: list[Parsed], whats: list[str]) -> list[np.ndarray | RouteCorruptError]:
    """Layer-major rows of each parsed body, or its error; bodies waiting for a keep join are
    joined (and checked) together, one call per shape."""
    out: list[np.ndarray | RouteCorruptError | None] = [p.lm for p in parsed]
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    for i, p in enumerate(parsed):
        if p.lm is None:
            by_shape.setdefault((p.head.M, p.head.T, p.head.K), []).append(i)
    for shape, idx in by_shape.items():
        ps = [parsed[i] for i in idx]
        joined = X.keep_join(
            np.concatenate([p.mask for p in ps]),  # type: ignore[misc]
            np.concatenate([p.values for p in ps]),  # type: ignore[misc]
            (len(ps), *shape),
            np.array([p.values.size for p in ps]),  # type: ignore[union-attr]
        )
        for j, i in enumerate(idx):
            out[i] = joined[j] if joined is not None else _join_one(parsed[i], whats[i])
    return [
        x if isinstance(x, RouteCorruptError) else X.invert(p.head.xf, x)
        for p, x in zip(parsed, out, strict=True)
    ]  # type: ignore[arg-type]


def _join_one(p: Parsed, what: str) -> np.ndarray | RouteCorruptError:
    """A keep body its batch's check refused, checked alone: its rows, or what is wrong."""
    try:
        values = check_keep(p, p.mask, memoryview(p.values), what)  # type: ignore[arg-type]
    except RouteCorruptError as exc:
        return exc
    h = p.head
    return X.keep_join(p.mask, values, (1, h.M, h.T, h.K), np.array([values.size]))[0]  # type: ignore[index]


def decode_body(head: BodyHead, body: bytes | memoryview, what: str) -> Block:
    """One body decoded and checked (records; the store decodes chunks in batches)."""
    head.check(what)
    p = parse_body(head, decompress(head, body, what), what)
    (lm,) = join_parsed([p], [what])
    if isinstance(lm, RouteCorruptError):
        raise lm
    return Block(p.token_ids, lm, p.valid, head.canonical)
