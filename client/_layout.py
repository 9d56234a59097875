"""The Redis layout of routereplay: key names, chunking, hashing, manifests. No I/O here.

Keys (``P`` is the store prefix, ``{...}`` a Redis Cluster hash tag):

- ``P:{<route id>}:m``    manifest of one record: metadata + ordered chunk keys.
- ``P:c:{<chunk hash>}``  content-addressed chunk: ``block_size`` token rows (the last one shorter).
- ``P:p:{<chain hash>}``  token-prefix index: chained hash of token blocks -> chunk hash, written
  for complete blocks whose rows are all valid.

A chunk hash is ``blake3(chain_i | valid bits | rows)`` (``blake2b`` before format 2) where
``chain_i`` chains the token ids of blocks ``0..i`` from a seed naming the model shape. Two
records that share a token prefix and its routes (the n samples of a GRPO group; earlier turns
of a multi-turn trajectory) therefore share those chunks: written once with ``SET NX``, read once
per batch. Blocks align at position 0, so a shared prefix of length ``p`` shares
``p // block_size`` chunks.

The sync and async stores (``_store.py``) only move the bytes this module plans and parses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack
import numpy as np

from ._codec import (
    KIND_CHUNK,
    KIND_MANIFEST,
    Block,
    canonicalize,
    check_crc,
    decode_body,
    encode_body,
    frame,
    record_fields,
    record_from_parts,
    unframe,
)
from ._errors import RouteCorruptError, RouteError, RouteEvictedError, RouteShapeError
from ._record import RouteRecord, expert_dtype

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_TTL_S", "KeySchema", "PutResult", "validate_route_id"]

# 128 tokens: the KV block size at which vLLM reports prefix-cache hits, so a cached prefix maps
# onto whole chunks; big enough that per-key overhead is < 1% of a chunk for real model shapes.
DEFAULT_BLOCK_SIZE = 128
DEFAULT_TTL_S = 24 * 3600

_ROUTE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_HASH_BYTES = 16


def validate_route_id(route_id: str) -> str:
    """Return ``route_id`` if it is 1-128 chars of ``[A-Za-z0-9._:-]``; else RouteShapeError."""
    # Ids of dots only would be normalised away as URL path segments ("..").
    if (
        not isinstance(route_id, str)
        or not _ROUTE_ID.fullmatch(route_id)
        or not route_id.strip(".")
    ):
        raise RouteShapeError(
            f"invalid route id {route_id!r}: expected 1-128 characters from [A-Za-z0-9._:-], "
            "not only dots"
        )
    return route_id


@dataclass(frozen=True)
class KeySchema:
    """The one place that names Redis keys."""

    prefix: str = "rr"

    def manifest(self, route_id: str) -> str:
        return f"{self.prefix}:{{{route_id}}}:m"

    def chunk(self, digest: bytes) -> str:
        return f"{self.prefix}:c:{{{digest.hex()}}}"

    def index(self, chain: bytes) -> str:
        return f"{self.prefix}:p:{{{chain.hex()}}}"

    def claim(self, name: str) -> str:
        """A lease on ``name`` (a request id in flight), held by one writer at a time."""
        return f"{self.prefix}:{{{name}}}:claim"

    def probe(self) -> str:
        """A scratch key writers set to learn whether Redis takes writes now."""
        return f"{self.prefix}:probe"


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


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    for p in parts:
        h.update(p)
    return h.digest()


def chain_seed(
    model: str,
    num_experts: int,
    top_k: int,
    moe_layers: tuple[int, ...],
    block_size: int,
    weight_version: str | None = None,
) -> bytes:
    """Seed of the token chain: the same tokens through another model shape, or through other
    weights of the same model, never collide, so a prefix-index fill never crosses versions."""
    shape = [model, num_experts, top_k, list(moe_layers), block_size]
    if weight_version is not None:  # unknown versions keep the seed of older writers
        shape.append(weight_version)
    return _h(b"routereplay-chain-v1", msgpack.packb(shape))


def record_seed(record: RouteRecord, block_size: int) -> bytes:
    return chain_seed(
        record.model, record.num_experts, record.top_k, record.moe_layers, block_size,
        record.prefix_version,
    )  # fmt: skip


# Chunk addresses hash every row byte (verified on every read), so the hash's speed is the
# reader's cost. blake3 (1.5 to 2.4 GB/s on one core of a 2-core machine here, docs/storage.md)
# for chunks written since format 2, blake2b (~0.6 GB/s) for older ones, which stay readable.
# All are collision-resistant: a writer cannot make another record's address hold its rows.
HASH_BLAKE2B = 1
HASH_BLAKE3 = 2  # blake3(chain | valid bits | rows): format 2 and 3 chunks
# blake3(rows | chain | valid bits), format 4: the rows first. blake3 hashes a tree of 1 KiB
# leaves and runs them through SIMD lanes in aligned power-of-two groups; 32 bytes before the
# rows shifted every leaf off that alignment and halved its speed on a 48 KiB chunk (bench
# trainer: 20 ms of a 256k-token step's read, now 10 ms, and the same on every put).
HASH_BLAKE3_ROWS = 3


def _chunk_digest(
    chain: bytes, valid: np.ndarray, rows_lm: np.ndarray, alg: int = HASH_BLAKE3_ROWS
) -> bytes:
    """A chunk's content address: its token chain, validity bits and layer-major rows."""
    rows = np.ascontiguousarray(rows_lm).reshape(-1).view(np.uint8)
    if alg == HASH_BLAKE3_ROWS:
        h = blake3.blake3(rows)
        h.update(chain)
        h.update(np.packbits(valid))
        return h.digest(_HASH_BYTES)
    if alg == HASH_BLAKE3:
        h = blake3.blake3(chain)
        h.update(np.packbits(valid))
        h.update(rows)
        return h.digest(_HASH_BYTES)
    return _h(chain, np.packbits(valid).tobytes(), rows.tobytes())


def _next_chain(prev: bytes, token_ids: np.ndarray) -> bytes:
    return _h(prev, token_ids.astype("<u4", copy=False).tobytes())


def token_chain(seed: bytes, token_ids: np.ndarray, block_size: int, n_blocks: int) -> list[bytes]:
    """``chain[i] = H(chain[i-1] | tokens of block i)``, for the first ``n_blocks`` blocks."""
    tok = token_ids.astype("<u4", copy=False)
    out: list[bytes] = []
    prev = seed
    for i in range(n_blocks):
        prev = _h(prev, tok[i * block_size : (i + 1) * block_size].tobytes())
        out.append(prev)
    return out


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
    index_entries: list[tuple[str, bytes]]
    manifest_key: str
    manifest_blob: bytes
    canonical: bool
    encoded: dict[int, bytes] = field(default_factory=dict)

    def chunk_blob(self, i: int) -> bytes:
        if i not in self.encoded:
            a, b = self.spans[i]
            payload = encode_body(
                self.record.token_ids[a:b],
                self.block_rows[i],
                self.record.valid[a:b],
                self.record.num_experts,
                canonical_order=self.canonical,
                presorted=True,
            )
            payload["pc"] = self.prev_chains[i]
            payload["ha"] = HASH_BLAKE3_ROWS
            self.encoded[i] = frame(KIND_CHUNK, payload)
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
    index_entries: list[tuple[str, bytes]] = []
    for (a, b), chain in zip(spans, chains, strict=True):
        rows = np.ascontiguousarray(lm[:, a:b, :])
        valid = record.valid[a:b]
        digest = _chunk_digest(chain, valid, rows)
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
        index_entries=index_entries,
        manifest_key=keys.manifest(route_id),
        manifest_blob=frame(KIND_MANIFEST, manifest),
        canonical=canonical_order,
    )


# ---------------------------------------------------------------------------------------------
# get
# ---------------------------------------------------------------------------------------------
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

    def needed(self, start: int) -> list[int]:
        """Indices of the chunks that hold rows ``start..T``."""
        if not 0 <= start <= self.T:
            raise RouteShapeError(
                f"route {self.route_id!r}: start={start} out of range [0, {self.T}]"
            )
        return list(range(start // self.block_size, len(self.digests)))

    def seed(self) -> bytes:
        """The token chain before chunk 0 (see :func:`chain_seed`)."""
        f = self.fields
        wv = f.get("wv")
        version = str(wv[0][0]) if wv else None
        return chain_seed(
            str(f["model"]), self.E, self.K, tuple(f["moe"]), self.block_size, version
        )


def parse_manifest(route_id: str, blob: bytes) -> Manifest:
    what = f"manifest of route {route_id!r}"
    p = unframe(blob, KIND_MANIFEST, what)
    try:
        T, M, K, E, bs = (int(p[k]) for k in ("T", "M", "K", "E", "bs"))
        digests = [bytes(d) for d in p["chunks"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise RouteCorruptError(f"{what}: field missing or malformed: {exc}") from exc
    if bs < 1 or len(digests) != -(-T // bs):
        raise RouteCorruptError(f"{what}: {len(digests)} chunks cannot hold {T} rows of block {bs}")
    if p.get("id") != route_id:
        raise RouteCorruptError(f"{what}: manifest belongs to route {p.get('id')!r}")
    return Manifest(route_id, p, T, M, K, E, bs, digests)


def decode_chunk(digest: bytes, blob: bytes) -> Block:
    """Decode a chunk and check it against its content address (chunks of this version carry
    the chain they were addressed with; older ones are checked as they are assembled)."""
    what = f"chunk {digest.hex()}"
    # A chunk that carries its chain is checked against its content address below, which
    # covers every byte a reader uses: its frame checksum is computed only to name the cause
    # when a check fails (a third of the read's hashing, bench trainer), or when it has no chain.
    p = unframe(blob, KIND_CHUNK, what, check_crc=False)
    if p.get("pc") is None:
        check_crc(blob, what)
    try:
        block = decode_body(p, what)
        chain = None
        if block.prev_chain is not None:
            chain = _next_chain(block.prev_chain, block.token_ids)
            if _chunk_digest(chain, block.valid, block.experts, block.address_hash) != digest:
                raise RouteCorruptError(
                    f"{what}: content does not match its address (a chunk stored under another "
                    "chunk's key, or altered bytes)"
                )
    except RouteCorruptError:
        check_crc(blob, what)  # altered bytes are named as such
        raise
    # Kept: each record using this chunk continues its chain from it (no second hash), and its
    # largest id is checked against each record's E without another pass over the rows. Set on
    # the block just built, before anything else sees it.
    e = block.experts
    block.chain = chain
    block.max_id = int(e.max()) if e.size else -1
    return block


def _chunk_what(m: Manifest, index: int) -> str:
    # Built only when a check fails: the checks run for every chunk of every read.
    return f"chunk {index} ({m.digests[index].hex()}) of route {m.route_id!r}"


def _check_chunk(m: Manifest, index: int, block: Block, prev: bytes | None) -> bytes | None:
    """Check that ``block`` is chunk ``index`` of ``m``; returns its token chain (None if it
    cannot be known: an older chunk read from the middle of a record)."""
    want_t = min(m.block_size, m.T - index * m.block_size)
    got = block.experts.shape
    if got != (m.M, want_t, m.K):
        raise RouteCorruptError(
            f"{_chunk_what(m, index)}: holds rows {got}, expected {(m.M, want_t, m.K)}"
        )
    if block.prev_chain is not None:
        if prev is not None and block.prev_chain != prev:
            raise RouteCorruptError(
                f"{_chunk_what(m, index)}: does not continue the record's token chain"
            )
        return block.chain or _next_chain(block.prev_chain, block.token_ids)
    if prev is None:
        return None
    chain = _next_chain(prev, block.token_ids)
    if _chunk_digest(chain, block.valid, block.experts, block.address_hash) != m.digests[index]:
        raise RouteCorruptError(f"{_chunk_what(m, index)}: content does not match its address")
    return chain


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
) -> RouteRecord:
    """The record's rows ``start..T`` from its decoded chunks (a :class:`StoredRecord`),
    checking each chunk belongs and holds only ids below ``E``. ``got``: the blocks of
    ``m.needed(start)`` in order, where the caller has them already (a lookup each saved)."""
    n = m.T - start
    bs = m.block_size
    needed = m.needed(start)
    if got is None:
        got = [blocks[m.digests[i]] for i in needed]
    prev = m.seed() if needed and needed[0] == 0 else None
    parts: list[tuple[int, np.ndarray]] = []
    toks: list[np.ndarray] = []
    valids: list[np.ndarray] = []
    row = 0
    most = -1
    E = m.E
    # The common chunk (a whole block of this version, its chain known once its address was
    # checked, continuing the one before) is checked inline: a call per chunk was a third of
    # assembling (~2100 chunk uses per training step's read).
    full, n_full = (m.M, bs, m.K), m.T // bs
    for i, blk in zip(needed, got, strict=True):
        pc, chain = blk.prev_chain, blk.chain
        if (
            chain is not None and pc is not None and (prev is None or pc == prev)
            and i < n_full and blk.experts.shape == full
        ):  # fmt: skip
            prev = chain
        else:
            prev = _check_chunk(m, i, blk, prev)
        lo = start - i * bs  # > 0 only for the first chunk, when it starts inside
        if lo > 0:
            rows = blk.experts[:, lo:]
            top = int(rows.max()) if rows.size else -1
            toks.append(blk.token_ids[lo:])
            valids.append(blk.valid[lo:])
        else:
            rows = blk.experts
            # decode_chunk computed the largest id (-1: a block without one, or no rows)
            top = blk.max_id if blk.max_id >= 0 else (int(rows.max()) if rows.size else -1)
            toks.append(blk.token_ids)
            valids.append(blk.valid)
        if top >= E:
            raise RouteCorruptError(
                f"route {m.route_id!r}: chunk {i} holds expert id {top} >= num_experts={E}"
            )
        parts.append((row, rows))
        row += rows.shape[1]
        if top > most:
            most = top
    if row != n:  # _check_chunk checked every chunk's rows; this is their sum
        raise RouteCorruptError(f"route {m.route_id!r}: chunks hold {row} rows, not {n}")
    if not parts:
        parts = [(0, np.empty((m.M, 0, m.K), expert_dtype(m.E)))]
    tok = np.concatenate(toks) if toks else np.empty(0, np.int64)
    valid = np.concatenate(valids) if valids else np.empty(0, bool)
    p = dict(m.fields)
    pl = min(max(int(p["pl"]) - start, 0), n)
    p["pl"] = pl
    p["nc"] = min(int(p["nc"]), pl)
    if start:
        p["meta"] = {**(p.get("meta") or {}), "row_start": start}
        p["wv"] = [
            [v, max(a, start) - start, b - start] for v, a, b in p.get("wv") or () if b > start
        ]
    p["E"] = m.E
    return record_from_parts(
        p, tok, (parts, most), valid, f"route {m.route_id!r}", cls=StoredRecord
    )


ReadResult = RouteRecord | RouteError | None


@dataclass
class ReadPlan:
    """A read after its manifests arrived: which chunks it needs, and the per-id outcomes known
    so far (a missing manifest is None, a malformed one its error)."""

    start: int
    results: list[ReadResult]
    manifests: list[tuple[int, Manifest, list[int]]]  # (position, manifest, needed chunks)

    def digests(self) -> list[bytes]:
        """Distinct chunk digests the read needs, in first-use order."""
        seen: dict[bytes, None] = {}
        for _, m, needed in self.manifests:
            for i in needed:
                seen.setdefault(m.digests[i])
        return list(seen)


def plan_read(
    route_ids: Sequence[str], manifest_blobs: Sequence[bytes | None], start: int = 0
) -> ReadPlan:
    plan = ReadPlan(start, [None] * len(route_ids), [])
    for idx, (rid, blob) in enumerate(zip(route_ids, manifest_blobs, strict=True)):
        if blob is None:
            continue
        try:
            m = parse_manifest(rid, blob)
            plan.manifests.append((idx, m, m.needed(start)))
        except RouteError as e:
            plan.results[idx] = e
    return plan


try:  # the batch chunk decoder (client/_cbatch.c); optional, decode_chunk is the reference
    from . import _cbatch as _BATCH
except ImportError:  # built without a C compiler, or a source tree that was never built
    _BATCH = None
_U8, _U16 = np.dtype(np.uint8), np.dtype(np.uint16)


def batch_decoder() -> str | None:
    """None when store reads decode chunks with the compiled batch decoder (whole batches
    without the GIL, so decode threads scale), else why they decode in Python (same results,
    ~23 us of GIL per chunk)."""
    if _BATCH is None:
        return "the compiled batch decoder (client/_cbatch.c) is not built"
    return _BATCH.available()


def _decode_one(d: bytes, blob: bytes | None) -> Block | RouteError | None:
    try:
        return None if blob is None else decode_chunk(d, blob)
    except RouteError as e:
        return e


def _decode_chunks(items: Sequence[tuple[bytes, bytes | None]]) -> list[Block | RouteError | None]:
    if len(items) < 2 or batch_decoder() is not None:
        return [_decode_one(d, blob) for d, blob in items]
    digests = [d for d, _ in items]
    blobs = [b for _, b in items]
    tok_buf, valid_buf, results = _BATCH.decode_chunks(digests, blobs)
    toks = np.frombuffer(tok_buf, np.int64)
    valid = np.frombuffer(valid_buf, np.bool_)
    out: list[Block | RouteError | None] = []
    for (d, blob), r in zip(items, results, strict=True):
        if r is None:  # not one the batch decoder takes (or a bad one): the Python path names why
            out.append(_decode_one(d, blob))
            continue
        buf, off, T, M, K, isz, canon, top, pc, chain, at = r
        rows = np.frombuffer(buf, _U8 if isz == 1 else _U16, M * T * K, off)
        blk = Block(toks[at : at + T], rows.reshape(M, T, K), valid[at : at + T], canon, pc,
                    HASH_BLAKE3_ROWS, chain, top)  # fmt: skip
        out.append(blk)
    return out


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    k = -(-len(items) // max(1, parts))
    return [items[i : i + k] for i in range(0, len(items), k)] if items else []


class ChunkDecoder(Mapping[bytes, "Block | RouteError | None"]):
    """Decodes chunks (checked against their addresses) as their bytes arrive; a mapping from
    digest to the decoded :class:`Block`, the chunk's error, or None (no bytes).

    With a thread pool each batch is split among its workers, each part decoded by one call of
    the compiled batch decoder (without the GIL; :func:`batch_decoder`), so chunks decode in
    parallel while the caller waits on Redis for the next batch; looking a chunk up waits only
    for the part holding it, and :meth:`wait` for every part. Without a pool, chunks decode on
    the caller's thread as they are added.
    """

    def __init__(self, pool: Executor | None = None, parts: int = 1) -> None:
        self.pool = pool
        self.parts = parts
        self._done: dict[bytes, Block | RouteError | None] = {}
        self._pending: dict[bytes, Future[list[Block | RouteError | None]]] = {}
        self._members: dict[Future[list[Block | RouteError | None]], list[bytes]] = {}

    def add(self, digests: Sequence[bytes], blobs: Sequence[bytes | None]) -> None:
        items = list(zip(digests, blobs, strict=True))
        if self.pool is None or len(items) < 2:
            self._done.update(zip(digests, _decode_chunks(items), strict=True))
            return
        for part in _split(items, self.parts):
            fut = self.pool.submit(_decode_chunks, part)
            self._members[fut] = [d for d, _ in part]
            self._pending.update((d, fut) for d, _ in part)

    def wait(self) -> None:
        """Return once every chunk added so far is decoded (the caller blocked meanwhile, not
        holding the GIL)."""
        if self._members:
            futures.wait(list(self._members))

    def __getitem__(self, digest: bytes) -> Block | RouteError | None:
        if digest not in self._done:
            fut = self._pending[digest]  # KeyError: a chunk never added
            self._done.update(zip(self._members.pop(fut), fut.result(), strict=True))
        return self._done[digest]

    def take(self, digests: Sequence[bytes]) -> list[Block | RouteError | None]:
        """``[self[d] for d in digests]`` with one dictionary lookup each once they are
        decoded (a record's ~17 chunks, ~2100 a training step's read)."""
        done = self._done
        for d in digests:
            if d not in done:
                self[d]  # waits for the part holding it
        return [done[d] for d in digests]

    def __iter__(self) -> Iterator[bytes]:
        yield from self._done
        yield from (d for d in self._pending if d not in self._done)

    def __len__(self) -> int:
        return len(self._done) + sum(1 for d in self._pending if d not in self._done)


def finish_read(plan: ReadPlan, chunk_blobs: Mapping[bytes, bytes | None]) -> list[ReadResult]:
    """The records of ``plan`` from their chunks' bytes (digest -> bytes, None: gone).

    Each distinct chunk is decoded and checked against its address once. A result is the record,
    None (no manifest), or the error that id alone hit: :class:`RouteEvictedError` (a chunk is
    gone), :class:`RouteCorruptError` (bytes fail a check), :class:`RouteShapeError` (``start``
    out of range). One bad record never fails the others. Decoded on the caller's thread
    (:class:`ChunkDecoder` with a pool is the store's pipelined path).
    """
    dec = ChunkDecoder()
    digests = plan.digests()
    dec.add(digests, [chunk_blobs.get(d) for d in digests])
    return assemble_read(plan, dec)


def assemble_read(
    plan: ReadPlan, decoded: Mapping[bytes, Block | RouteError | None]
) -> list[ReadResult]:
    """The results of ``plan`` from its decoded chunks (see :func:`finish_read`), record by
    record in order: with a :class:`ChunkDecoder`, each waits only for its own chunks. (On the
    caller's thread: assembling on the pool as well was measured slower, its copies contend
    with the decoding for memory bandwidth and the GIL.)"""
    out = list(plan.results)
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
                out[idx] = assemble(m, decoded, plan.start, got)  # type: ignore[arg-type]
            except RouteError as e:
                out[idx] = e
    return out


def read_records(
    route_ids: Sequence[str],
    manifest_blobs: Sequence[bytes | None],
    chunk_blobs: Mapping[bytes, bytes | None],
    start: int = 0,
) -> list[ReadResult]:
    """:func:`plan_read` then :func:`finish_read`: records from stored bytes, one result per id."""
    return finish_read(plan_read(route_ids, manifest_blobs, start), chunk_blobs)


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
    prefix is not trusted: its rows stay invalid."""
    rec = plan.record
    if not chunks:
        return rec, 0
    experts = np.array(rec.experts, copy=True)
    valid = rec.valid.copy()
    filled = 0
    bs = plan.block_size
    chain_of = dict(zip(plan.blocks, plan.chains, strict=True))
    for i, (digest, blob) in chunks.items():
        what = f"prefix-index chunk {digest.hex()}"
        block = decode_body(unframe(blob, KIND_CHUNK, what), what)
        a, b = i * bs, (i + 1) * bs
        if (
            block.experts.shape != (rec.num_moe_layers, bs, rec.top_k)
            or not np.array_equal(block.token_ids, rec.token_ids[a:b])
            or _chunk_digest(chain_of[i], block.valid, block.experts, block.address_hash) != digest
        ):
            # A hit whose content disagrees with its address is not ours to trust.
            continue
        take = ~valid[a:b] & block.valid
        if take.any():
            experts[a:b][take] = block.experts.transpose(1, 0, 2)[take]
            valid[a:b] |= take
            filled += int(take.sum())
    if not filled:
        return rec, 0
    # Which rows came from the index (not from this request's engine pass): [[start, stop], ...].
    newly = valid & ~rec.valid
    edges = np.flatnonzero(np.diff(np.concatenate([[0], newly.view(np.int8), [0]])))
    spans = [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2], strict=True)]
    out = dataclasses.replace(
        rec, experts=experts, valid=valid,
        metadata={**rec.metadata, "rows_filled_from_index": filled, "filled_rows": spans},
    )  # fmt: skip
    return out, filled
