"""The Redis layout of a route record: put plans, manifests, and records assembled from their
chunks. No I/O here; the sync and async stores (``_store.py``) only move the bytes this module
plans and parses. Keys are named in ``_keys``, addresses computed in ``_address``, chunks encoded
and decoded in ``_chunks``.

A record is split into ``block_size``-row chunks aligned at position 0, each stored under its
content address (``_address``): two records that share a token prefix and its routes (the n
samples of a GRPO group; earlier turns of a multi-turn trajectory) share those chunks, written
once with ``SET NX`` and read once per batch. A manifest per route id lists its chunks in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._address import chain_seed, chunk_digest, token_chain
from ._body import Block, encode_body
from ._chunks import (
    MALFORMED,
    ChunkDecoder,
    ChunkShape,
    chunk_blob,
    decode_chunks,
    sections_bytes,
)
from ._codec import check_planes, check_slot_order, record_fields, record_from_parts, weights_plane
from ._errors import RouteCorruptError, RouteError, RouteEvictedError, RouteShapeError
from ._frame import KIND_MANIFEST, frame_map, unframe_map
from ._keys import KeySchema, validate_route_id
from ._limits import DEFAULT_LIMITS, ReadLimits
from ._record import RouteRecord, expert_dtype
from ._schema import body_shape, check_record_fields, need_int, need_type, show
from ._schema import digests as manifest_digests
from ._transforms import canonicalize
from ._weights import WEIGHTS, encode_weights

__all__ = ["PutResult", "StoredRecord"]


@dataclass
class PutResult:
    """What a put wrote. ``bytes_written`` counts only new chunks + the manifest."""

    route_id: str
    num_tokens: int
    chunks_total: int
    chunks_written: int
    bytes_written: int
    manifest_bytes: int

    @property
    def chunks_reused(self) -> int:
        return self.chunks_total - self.chunks_written


def record_seed(record: RouteRecord, block_size: int) -> bytes:
    return chain_seed(
        record.model, record.num_experts, record.top_k, record.moe_layers, block_size,
        record.prefix_version,
    )  # fmt: skip


def _blocks(num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    return [(a, min(a + block_size, num_tokens)) for a in range(0, num_tokens, block_size)]


# ---------------------------------------------------------------------------------------------
# put
# ---------------------------------------------------------------------------------------------
@dataclass
class PutPlan:
    """Everything a put writes, in order: chunks (NX), index entries, then the manifest."""

    route_id: str
    record: RouteRecord
    spans: list[tuple[int, int]]
    chunk_keys: list[str]
    block_rows: list[np.ndarray]  # contiguous [M, b, K] per chunk, reused by the encoder
    prev_chains: list[bytes]  # token chain before each chunk: readers verify the address with it
    extras: list[list[tuple[str, bytes]]]  # each chunk's extra plane sections (its weights)
    index_entries: list[tuple[str, bytes]]
    manifest_key: str
    manifest_blob: bytes
    canonical: bool
    encoded: dict[int, bytes] = field(default_factory=dict)

    def chunk_blob(self, i: int) -> bytes:
        if i not in self.encoded:
            a, b = self.spans[i]
            head, body = encode_body(
                self.record.token_ids[a:b],
                self.block_rows[i],
                self.record.valid[a:b],
                self.record.num_experts,
                canonical_order=self.canonical,
                presorted=True,
            )
            self.encoded[i] = chunk_blob(head, body, self.prev_chains[i], self.extras[i])
        return self.encoded[i]


def plan_put(
    keys: KeySchema,
    route_id: str,
    record: RouteRecord,
    block_size: int,
    *,
    canonical_order: bool = False,
) -> PutPlan:
    validate_route_id(route_id)
    check_slot_order(record, canonical_order)
    lm = record.layer_major()
    if canonical_order:
        lm = canonicalize(lm)
    T = record.num_tokens
    spans = _blocks(T, block_size)
    seed = record_seed(record, block_size)
    chains = token_chain(seed, record.token_ids, block_size, len(spans))
    # The index is keyed by the prefix version: only rows routed by those weights may enter it.
    index_stop = record.version_stop()
    chunk_digests: list[bytes] = []
    block_rows: list[np.ndarray] = []
    extras = _weights_sections(record, spans)
    index_entries: list[tuple[str, bytes]] = []
    for (a, b), chain, extra in zip(spans, chains, extras, strict=True):
        rows = np.ascontiguousarray(lm[:, a:b, :])
        valid = record.valid[a:b]
        # The address covers the weights as stored: equal ids with other weights never share.
        digest = chunk_digest(chain, valid, rows, sections_bytes(extra))
        chunk_digests.append(digest)
        block_rows.append(rows)
        if b - a == block_size and b <= index_stop and valid.all():
            index_entries.append((keys.index(chain), digest))
    manifest = {
        "id": route_id,
        "T": T,
        "M": record.num_moe_layers,
        "K": record.top_k,
        "E": record.num_experts,
        "bs": block_size,
        "canon": canonical_order,
        "chunks": chunk_digests,
        **record_fields(record),
    }
    return PutPlan(
        route_id=route_id,
        record=record,
        spans=spans,
        chunk_keys=[keys.chunk(d) for d in chunk_digests],
        block_rows=block_rows,
        prev_chains=[seed, *chains[:-1]],
        extras=extras,
        index_entries=index_entries,
        manifest_key=keys.manifest(route_id),
        manifest_blob=frame_map(KIND_MANIFEST, manifest),
        canonical=canonical_order,
    )


def _weights_sections(
    record: RouteRecord, spans: list[tuple[int, int]]
) -> list[list[tuple[str, bytes]]]:
    """Each chunk's extra plane sections: its weights plane, where the record has weights."""
    if record.weights is None:
        return [[] for _ in spans]
    w_lm = record.weights.transpose(1, 0, 2)
    dtype = record.weights_dtype
    return [[(WEIGHTS, encode_weights(w_lm[:, a:b], dtype))] for a, b in spans]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# get
# ---------------------------------------------------------------------------------------------
def check_stop(start: int, stop: int | None) -> None:
    """:class:`RouteShapeError` for a read's ``stop`` that is not past its ``start`` (None: a
    read to the record's end)."""
    if stop is not None and stop <= start:
        raise RouteShapeError(f"stop={stop} must be greater than start={start}")


@dataclass
class Manifest:
    route_id: str
    fields: dict[str, Any]
    T: int
    M: int
    K: int
    E: int
    block_size: int
    digests: list[bytes]
    weights_dtype: str | None = None  # the record's weights plane; None: it has none

    def end(self, start: int, stop: int | None = None) -> int:
        """The row a read of rows ``start..stop`` ends at: ``T``, or ``stop`` clipped to ``T``;
        :class:`RouteShapeError` for a ``start`` out of ``[0, T]`` or a ``stop`` not past it."""
        if not 0 <= start <= self.T:
            raise RouteShapeError(
                f"route {self.route_id!r}: start={start} out of range [0, {self.T}]"
            )
        check_stop(start, stop)
        return self.T if stop is None else min(stop, self.T)

    def needed(self, start: int, stop: int | None = None) -> list[int]:
        """Indices of the chunks that hold rows ``start..min(stop, T)`` (``stop`` None: to T)."""
        end = self.end(start, stop)
        return list(range(start // self.block_size, -(-end // self.block_size)))

    def seed(self) -> bytes:
        """The token chain before chunk 0 (see :func:`chain_seed`)."""
        f = self.fields
        wv = f.get("wv")
        version = wv[0][0] if wv else None  # a str: parse_manifest checked it
        return chain_seed(
            str(f["model"]), self.E, self.K, tuple(f["moe"]), self.block_size, version
        )


def parse_manifest(route_id: str, blob: bytes, limits: ReadLimits = DEFAULT_LIMITS) -> Manifest:
    """A manifest's fields, each checked for type and range, and its record's declared size
    against ``limits`` (RouteLimitError) before any chunk of it is read."""
    what = f"manifest of route {route_id!r}"
    p = unframe_map(blob, KIND_MANIFEST, what)
    check_planes(p, what)
    T, M, K, E = body_shape(p, what)
    bs = need_int(p, "bs", what, lo=1)
    need_type(p, "canon", what, bool)
    digests = manifest_digests(p, what)
    if len(digests) != -(-T // bs):
        raise RouteCorruptError(f"{what}: {len(digests)} chunks cannot hold {T} rows of block {bs}")
    if p.get("id") != route_id:
        raise RouteCorruptError(f"{what}: manifest belongs to route {show(p.get('id'))}")
    check_record_fields(p, T, M, what)
    dtype = weights_plane(p, what)
    limits.check(T, M, K, E, dtype is not None, what)
    return Manifest(route_id, p, T, M, K, E, bs, digests, dtype)


def _chunk_what(m: Manifest, index: int) -> str:
    # Built only when a check fails: the checks run for every chunk of every read.
    return f"chunk {index} ({m.digests[index].hex()}) of route {m.route_id!r}"


def _check_chunk(m: Manifest, index: int, block: Block, prev: bytes | None) -> bytes | None:
    """Check that ``block`` is chunk ``index`` of ``m`` and continues the token chain ``prev``
    (None: not known, a read from the middle of a record); returns its chain."""
    want_t = min(m.block_size, m.T - index * m.block_size)
    got = block.experts.shape
    if got != (m.M, want_t, m.K):
        raise RouteCorruptError(
            f"{_chunk_what(m, index)}: holds rows {got}, expected {(m.M, want_t, m.K)}"
        )
    if prev is not None and block.prev_chain != prev:
        raise RouteCorruptError(
            f"{_chunk_what(m, index)}: does not continue the record's token chain"
        )
    return block.chain


# The one zero behind StoredRecord's validation stand-in (read-only: the stand-in is too).
_ZERO8 = np.zeros(8, np.uint8)
_ZERO8.flags.writeable = False


class StoredRecord(RouteRecord):
    """A record read from a store: its rows stay the decoded chunks they came in until
    ``experts`` (or :meth:`layer_major`) is first asked for, when they are joined once.

    Why: a training step's batch is read only to be copied into the step's targets; joining
    every record first (100 MB for a 256k-token step) doubled that copy (bench trainer). Token
    ids and validity are joined at once (small). In every other respect a :class:`RouteRecord`:
    equal to the same rows built in memory, and ``dataclasses.replace`` gives a plain copy.
    """

    _parts: list[tuple[int, np.ndarray]] | None
    _lm: np.ndarray | None
    _parts_max: int = -1  # the largest id in the parts, known from their chunks

    @property  # type: ignore[override]
    def experts(self) -> np.ndarray:
        lm, parts = self._lm, self._parts
        if lm is None and parts is not None:
            arrs = [a for _, a in parts]
            lm = np.concatenate(arrs, axis=1) if len(arrs) > 1 else arrs[0].copy()
            self._lm = lm  # before the parts go: another thread finds one or the other
            self._parts = None
        elif lm is None:  # another thread joined them between the two reads above
            lm = self._lm
        assert lm is not None
        return lm.transpose(1, 0, 2)

    @experts.setter
    def experts(self, value: np.ndarray | tuple[list[tuple[int, np.ndarray]], int]) -> None:
        if isinstance(value, tuple):  # from assemble(): the chunks' layer-major parts, max id
            (self._parts, self._parts_max), self._lm = value, None
        else:
            self._parts, self._lm = None, np.asarray(value).transpose(1, 0, 2)

    @property
    def top_k(self) -> int:
        parts = self._parts
        return int(parts[0][1].shape[2]) if parts is not None else super().top_k

    def layer_major_parts(self) -> list[tuple[int, np.ndarray]]:
        parts = self._parts
        return list(parts) if parts is not None else super().layer_major_parts()

    def _max_expert_id(self) -> int:
        return self._parts_max if self._parts is not None else super()._max_expert_id()

    def _experts_to_validate(self) -> np.ndarray:
        parts = self._parts
        if parts is None:
            return self.experts
        # Shape and dtype from the parts without joining them: a stand-in whose every element
        # is one zero (np.broadcast_to does the same at ~5x the cost, per record read).
        p0 = parts[0][1]
        last_row, last = parts[-1]
        T = last_row + last.shape[1]  # parts are consecutive from row 0 (assemble)
        return np.ndarray((T, p0.shape[0], p0.shape[2]), p0.dtype, _ZERO8, 0, (0, 0, 0))

    def __getstate__(self) -> dict[str, Any]:
        _ = self.experts  # pickles joined: the parts are views of shared chunk buffers
        return self.__dict__


def assemble(
    m: Manifest,
    blocks: Mapping[bytes, Block],
    start: int = 0,
    got: Sequence[Block] | None = None,
    stop: int | None = None,
) -> RouteRecord:
    """The record's rows ``start..end`` (``end``: ``T``, or ``stop`` clipped to ``T``) from its
    decoded chunks (a :class:`StoredRecord`), checking each chunk belongs and holds only ids
    below ``E``: equal to the rows ``start..T`` cut with ``rows(0, end - start)``. ``got``: the
    blocks of ``m.needed(start, stop)`` in order, where the caller has them already (a lookup
    each saved)."""
    end = m.end(start, stop)
    bs = m.block_size
    needed = m.needed(start, stop)
    if got is None:
        got = [blocks[m.digests[i]] for i in needed]
    prev = m.seed() if needed and needed[0] == 0 else None
    parts: list[tuple[int, np.ndarray]] = []
    weights: list[np.ndarray] | None = [] if m.weights_dtype is not None else None
    toks: list[np.ndarray] = []
    valids: list[np.ndarray] = []
    row = 0
    most = -1
    E = m.E
    # The common chunk (a whole block continuing the one before) is checked inline: a call per
    # chunk was a third of assembling (~2100 chunk uses per training step's read).
    full, n_full = (m.M, bs, m.K), m.T // bs
    for i, blk in zip(needed, got, strict=True):
        if (prev is None or blk.prev_chain == prev) and i < n_full and blk.experts.shape == full:
            prev = blk.chain
        else:
            prev = _check_chunk(m, i, blk, prev)
        # The window's rows of this chunk: a first chunk may start inside, a last end inside.
        lo, hi = max(start - i * bs, 0), min(end - i * bs, blk.experts.shape[1])
        if lo or hi < blk.experts.shape[1]:
            rows = blk.experts[:, lo:hi]
            top = int(rows.max()) if rows.size else -1
            toks.append(blk.token_ids[lo:hi])
            valids.append(blk.valid[lo:hi])
        else:
            rows = blk.experts
            top = blk.max_id  # computed as the chunk was decoded (-1: no rows)
            toks.append(blk.token_ids)
            valids.append(blk.valid)
        if top >= E:
            raise RouteCorruptError(
                f"route {m.route_id!r}: chunk {i} holds expert id {top} >= num_experts={E}"
            )
        parts.append((row, rows))
        if weights is not None:
            weights.append(_chunk_weights(m, i, blk, lo, hi))
        row += rows.shape[1]
        if top > most:
            most = top
    if row != end - start:  # _check_chunk checked every chunk's rows; this is their sum
        raise RouteCorruptError(f"route {m.route_id!r}: chunks hold {row} rows, not {end - start}")
    if not parts:
        parts = [(0, np.empty((m.M, 0, m.K), expert_dtype(m.E)))]
    tok = np.concatenate(toks) if toks else np.empty(0, np.int64)
    valid = np.concatenate(valids) if valids else np.empty(0, bool)
    w = None
    if weights is not None:
        w = np.concatenate(weights, axis=1) if weights else np.empty((m.M, 0, m.K), np.float32)
        w = w.transpose(1, 0, 2)
    p = _window_fields(m, start, end)
    return record_from_parts(
        p, tok, (parts, most), valid, f"route {m.route_id!r}", cls=StoredRecord, weights=w
    )


def _window_fields(m: Manifest, start: int, end: int) -> dict[str, Any]:
    """The manifest's record fields for rows ``start..end``, as :meth:`RouteRecord.rows` gives
    them: prompt length and cached tokens clipped to the window, weight-version spans clipped
    and renumbered from ``start`` (those outside it dropped), ``row_start`` where ``start > 0``."""
    p = dict(m.fields)
    pl = min(max(int(p["pl"]) - start, 0), end - start)
    p["pl"] = pl
    p["nc"] = min(int(p["nc"]), pl)
    if start:
        p["meta"] = {**(p.get("meta") or {}), "row_start": start}
    if start or end < m.T:
        p["wv"] = [
            [v, max(a, start) - start, min(b, end) - start]
            for v, a, b in p.get("wv") or ()
            if min(b, end) > max(a, start)
        ]
    p["E"] = m.E
    return p


def _chunk_weights(m: Manifest, index: int, blk: Block, lo: int, hi: int) -> np.ndarray:
    """Chunk ``index``'s weights of rows ``lo..hi``, layer-major; the manifest lists a weights
    plane, so a chunk without one (or in another dtype) is not this record's."""
    if blk.weights is None or blk.weights_dtype != m.weights_dtype:
        raise RouteCorruptError(
            f"{_chunk_what(m, index)}: holds no {m.weights_dtype} weights plane, which its "
            "manifest lists"
        )
    return blk.weights[:, lo:hi] if lo or hi < blk.weights.shape[1] else blk.weights


ReadResult = RouteRecord | RouteError | None


@dataclass
class ReadPlan:
    """A read after its manifests arrived: which chunks it needs, and the per-id outcomes known
    so far (a missing manifest is None, a malformed one its error)."""

    start: int
    results: list[ReadResult]
    manifests: list[tuple[int, Manifest, list[int]]]  # (position, manifest, needed chunks)
    stop: int | None = None  # rows ``start..stop`` (None: to each record's end)

    def digests(self) -> list[bytes]:
        """Distinct chunk digests the read needs, in first-use order."""
        return list(self.shapes())

    def shapes(self) -> dict[bytes, ChunkShape]:
        """The shape each needed chunk must declare, by digest, from the first manifest that
        names it: a chunk is sized from its manifest (checked against the reader's limits),
        never from its own header alone."""
        out: dict[bytes, ChunkShape] = {}
        for _, m, needed in self.manifests:
            for i in needed:
                if m.digests[i] not in out:
                    rows = min(m.block_size, m.T - i * m.block_size)
                    out[m.digests[i]] = ChunkShape(rows, m.M, m.K, m.E)
        return out


def plan_read(
    route_ids: Sequence[str],
    manifest_blobs: Sequence[bytes | None],
    start: int = 0,
    limits: ReadLimits = DEFAULT_LIMITS,
    *,
    stop: int | None = None,
) -> ReadPlan:
    """Which chunks a read of rows ``start..stop`` (``stop`` None: to the end, else clipped to
    each record's end) of ``route_ids`` needs, from their manifests' bytes (None: no manifest)."""
    plan = ReadPlan(start, [None] * len(route_ids), [], stop)
    for idx, (rid, blob) in enumerate(zip(route_ids, manifest_blobs, strict=True)):
        if blob is None:
            continue
        try:
            m = parse_manifest(rid, blob, limits)
            plan.manifests.append((idx, m, m.needed(start, stop)))
        except RouteError as e:
            plan.results[idx] = e
    return plan


def finish_read(
    plan: ReadPlan,
    chunk_blobs: Mapping[bytes, bytes | None],
    pool: Executor | None = None,
    parts: int = 1,
) -> list[ReadResult]:
    """The records of ``plan`` from their chunks' bytes (digest -> bytes, None: gone).

    Each distinct chunk is decoded and checked against its address once, on ``pool`` in
    ``parts`` tasks (or the caller's thread). A result is the record, None (no manifest), or the
    error that id alone hit: :class:`RouteEvictedError` (a chunk is gone),
    :class:`RouteCorruptError` (bytes fail a check), :class:`RouteShapeError` (``start`` out of
    range, or ``stop`` not past it). One bad record never fails the others.
    """
    shapes = plan.shapes()
    dec = ChunkDecoder(pool, parts, shapes)
    digests = list(shapes)
    dec.add(digests, [chunk_blobs.get(d) for d in digests])
    dec.wait()
    return assemble_read(plan, dec)


def assemble_read(
    plan: ReadPlan, decoded: Mapping[bytes, Block | RouteError | None]
) -> list[ReadResult]:
    """The results of ``plan`` from its decoded chunks (see :func:`finish_read`), record by
    record in order: with a :class:`ChunkDecoder`, each waits only for its own chunks. (On the
    caller's thread: assembling on the pool as well was measured slower, its copies contend
    with the decoding for memory bandwidth and the GIL.)"""
    out = list(plan.results)
    start, stop = plan.start, plan.stop
    take = decoded.take if isinstance(decoded, ChunkDecoder) else None
    for idx, m, needed in plan.manifests:
        ds = [m.digests[i] for i in needed]
        got = take(ds) if take is not None else [decoded[d] for d in ds]
        problems = [b for b in got if not isinstance(b, Block)]
        if any(p is None for p in problems):
            out[idx] = RouteEvictedError(
                f"route {m.route_id!r}: a chunk named by its manifest is missing (expired or "
                "evicted before the manifest)"
            )
        elif problems:
            out[idx] = type(problems[0])(f"route {m.route_id!r}: {problems[0]}")
        else:
            try:
                out[idx] = assemble(m, decoded, start, got, stop)  # type: ignore[arg-type]
            except RouteError as e:
                out[idx] = e
            except MALFORMED as e:  # a check missed: still this id's error alone, named
                out[idx] = RouteCorruptError(f"route {m.route_id!r}: malformed: {e!r}")
    return out


# ---------------------------------------------------------------------------------------------
# prefix index
# ---------------------------------------------------------------------------------------------
@dataclass
class FillPlan:
    """Complete blocks of a record that have invalid rows, with their index keys."""

    record: RouteRecord
    block_size: int
    blocks: list[int]
    index_keys: list[str]
    chains: list[bytes]  # token chain of each of those blocks: what its chunk is addressed by


def plan_fill(keys: KeySchema, record: RouteRecord, block_size: int) -> FillPlan:
    # Only blocks within the prefix version's rows: the index holds no other version's rows.
    full = min(record.num_tokens, record.version_stop()) // block_size
    need = [i for i in range(full) if not record.valid[i * block_size : (i + 1) * block_size].all()]
    if not need:
        return FillPlan(record, block_size, [], [], [])
    seed = record_seed(record, block_size)
    chains = token_chain(seed, record.token_ids, block_size, need[-1] + 1)
    return FillPlan(
        record, block_size, need, [keys.index(chains[i]) for i in need], [chains[i] for i in need]
    )


def apply_fill(plan: FillPlan, chunks: dict[int, tuple[bytes, bytes]]) -> tuple[RouteRecord, int]:
    """Copy valid rows of the found chunks (block -> (digest, bytes)) into the record's invalid
    rows. A chunk whose content does not match the address the index gave for this exact token
    prefix is not trusted: its rows stay invalid. A record with weights takes a chunk's rows only
    with their weights (a chunk without a weights plane in its dtype fills nothing); a record
    without takes the ids alone."""
    rec = plan.record
    if not chunks:
        return rec, 0
    experts = np.array(rec.experts, copy=True)
    weights = None if rec.weights is None else rec.weights.copy()
    valid = rec.valid.copy()
    filled = 0
    bs = plan.block_size
    chain_of = dict(zip(plan.blocks, plan.chains, strict=True))
    for i, (digest, blob) in chunks.items():
        shape = ChunkShape(bs, rec.num_moe_layers, rec.top_k, rec.num_experts)
        (block,) = decode_chunks([(digest, blob)], {digest: shape})  # checked against its address
        a, b = i * bs, (i + 1) * bs
        if (
            not isinstance(block, Block)
            or block.experts.shape != (rec.num_moe_layers, bs, rec.top_k)
            or block.chain != chain_of[i]
            or not np.array_equal(block.token_ids, rec.token_ids[a:b])
            or (weights is not None and block.weights_dtype != rec.weights_dtype)
        ):
            # A hit whose content disagrees with the address the index gave for this exact token
            # prefix is not ours to trust.
            continue
        take = ~valid[a:b] & block.valid
        if take.any():
            experts[a:b][take] = block.experts.transpose(1, 0, 2)[take]
            if weights is not None:  # a record with weights takes rows only with theirs
                weights[a:b][take] = block.weights.transpose(1, 0, 2)[take]  # type: ignore[union-attr]
            valid[a:b] |= take
            filled += int(take.sum())
    if not filled:
        return rec, 0
    # Which rows came from the index (not from this request's engine pass): [[start, stop], ...].
    newly = valid & ~rec.valid
    edges = np.flatnonzero(np.diff(np.concatenate([[0], newly.view(np.int8), [0]])))
    spans = [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2], strict=True)]
    out = dataclasses.replace(
        rec, experts=experts, valid=valid, weights=weights,
        metadata={**rec.metadata, "rows_filled_from_index": filled, "filled_rows": spans},
    )  # fmt: skip
    return out, filled
