"""The Redis layout of routereplay: key names, chunking, hashing, manifests. No I/O here.

Keys (``P`` is the store prefix, ``{...}`` a Redis Cluster hash tag):

- ``P:{<route id>}:m``    manifest of one record: metadata + ordered chunk keys.
- ``P:c:{<chunk hash>}``  content-addressed chunk: ``block_size`` token rows (the last one shorter).
- ``P:p:{<chain hash>}``  token-prefix index: chained hash of token blocks -> chunk hash, written
  for complete blocks whose rows are all valid.

A chunk hash is ``blake2b(chain_i | valid bits | rows)`` where ``chain_i`` chains the token ids of
blocks ``0..i`` from a seed naming the model shape. Two records that share a token prefix and
its routes (the n samples of a GRPO group; earlier turns of a multi-turn trajectory) therefore
share those chunks: written once with ``SET NX``, read once per batch. Blocks align at position 0,
so a shared prefix of length ``p`` shares ``p // block_size`` chunks.

The sync and async stores (``_store.py``) only move the bytes this module plans and parses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ._codec import (
    KIND_CHUNK,
    KIND_MANIFEST,
    Block,
    canonicalize,
    decode_body,
    encode_body,
    frame,
    record_fields,
    record_from_parts,
    unframe,
)
from ._errors import RouteCorruptError, RouteShapeError
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
    model: str, num_experts: int, top_k: int, moe_layers: tuple[int, ...], block_size: int
) -> bytes:
    """Seed of the token chain: the same tokens through another model shape never collide."""
    return _h(
        b"routereplay-chain-v1",
        msgpack.packb([model, num_experts, top_k, list(moe_layers), block_size]),
    )


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
    seed = chain_seed(record.model, record.num_experts, record.top_k, record.moe_layers, block_size)
    chains = token_chain(seed, record.token_ids, block_size, len(spans))
    chunk_digests: list[bytes] = []
    block_rows: list[np.ndarray] = []
    index_entries: list[tuple[str, bytes]] = []
    for (a, b), chain in zip(spans, chains, strict=True):
        rows = np.ascontiguousarray(lm[:, a:b, :])
        valid = record.valid[a:b]
        digest = _h(chain, np.packbits(valid).tobytes(), rows.tobytes())
        chunk_digests.append(digest)
        block_rows.append(rows)
        if b - a == block_size and valid.all():
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
    chunk_keys: list[str]

    def needed(self, start: int) -> list[int]:
        """Indices of the chunks that hold rows ``start..T``."""
        if not 0 <= start <= self.T:
            raise RouteShapeError(
                f"route {self.route_id!r}: start={start} out of range [0, {self.T}]"
            )
        return list(range(start // self.block_size, len(self.chunk_keys)))


def parse_manifest(keys: KeySchema, route_id: str, blob: bytes) -> Manifest:
    what = f"manifest of route {route_id!r}"
    p = unframe(blob, KIND_MANIFEST, what)
    try:
        T, M, K, E, bs = (int(p[k]) for k in ("T", "M", "K", "E", "bs"))
        chunks = [keys.chunk(bytes(d)) for d in p["chunks"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise RouteCorruptError(f"{what}: field missing or malformed: {exc}") from exc
    if bs < 1 or len(chunks) != -(-T // bs):
        raise RouteCorruptError(f"{what}: {len(chunks)} chunks cannot hold {T} rows of block {bs}")
    if p.get("id") != route_id:
        raise RouteCorruptError(f"{what}: manifest belongs to route {p.get('id')!r}")
    return Manifest(route_id, p, T, M, K, E, bs, chunks)


def decode_chunk(key: str, blob: bytes, m: Manifest, index: int) -> Block:
    what = f"chunk {index} ({key}) of route {m.route_id!r}"
    p = unframe(blob, KIND_CHUNK, what)
    block = decode_body(p, what)
    want_t = min(m.block_size, m.T - index * m.block_size)
    got = block.experts.shape
    if got != (m.M, want_t, m.K) or int(p["E"]) != m.E:
        raise RouteCorruptError(
            f"{what}: holds rows {got} of E={p['E']}, expected {(m.M, want_t, m.K)} of E={m.E}"
        )
    return block


def assemble(m: Manifest, blocks: dict[str, Block], start: int = 0) -> RouteRecord:
    """Join decoded chunks into the record's rows ``start..T``."""
    n = m.T - start
    lm = np.empty((m.M, n, m.K), dtype=expert_dtype(m.E))
    tok = np.empty(n, dtype=np.int64)
    valid = np.empty(n, dtype=bool)
    bs = m.block_size
    for i in m.needed(start):
        blk = blocks[m.chunk_keys[i]]
        a = i * bs
        lo = max(start - a, 0)
        dst = slice(a + lo - start, a + blk.token_ids.shape[0] - start)
        lm[:, dst, :] = blk.experts[:, lo:, :]
        tok[dst] = blk.token_ids[lo:]
        valid[dst] = blk.valid[lo:]
    p = dict(m.fields)
    pl = min(max(int(p["pl"]) - start, 0), n)
    p["pl"] = pl
    p["nc"] = min(int(p["nc"]), pl)
    if start:
        p["meta"] = {**(p.get("meta") or {}), "row_start": start}
    p["E"] = m.E
    return record_from_parts(
        p, Block(tok, lm, valid, bool(p.get("canon"))), f"route {m.route_id!r}"
    )


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


def plan_fill(keys: KeySchema, record: RouteRecord, block_size: int) -> FillPlan:
    full = record.num_tokens // block_size
    need = [i for i in range(full) if not record.valid[i * block_size : (i + 1) * block_size].all()]
    if not need:
        return FillPlan(record, block_size, [], [])
    seed = chain_seed(record.model, record.num_experts, record.top_k, record.moe_layers, block_size)
    chains = token_chain(seed, record.token_ids, block_size, need[-1] + 1)
    return FillPlan(record, block_size, need, [keys.index(chains[i]) for i in need])


def apply_fill(plan: FillPlan, chunks: dict[int, tuple[str, bytes]]) -> tuple[RouteRecord, int]:
    """Copy valid rows of the found chunks into the record's invalid rows."""
    rec = plan.record
    if not chunks:
        return rec, 0
    experts = np.array(rec.experts, copy=True)
    valid = rec.valid.copy()
    filled = 0
    bs = plan.block_size
    for i, (key, blob) in chunks.items():
        what = f"prefix-index chunk {key}"
        block = decode_body(unframe(blob, KIND_CHUNK, what), what)
        a, b = i * bs, (i + 1) * bs
        if block.experts.shape != (rec.num_moe_layers, bs, rec.top_k) or not np.array_equal(
            block.token_ids, rec.token_ids[a:b]
        ):
            # A chain-hash hit whose content disagrees is not ours to trust: leave rows invalid.
            continue
        take = ~valid[a:b] & block.valid
        if take.any():
            experts[a:b][take] = block.experts.transpose(1, 0, 2)[take]
            valid[a:b] |= take
            filled += int(take.sum())
    if not filled:
        return rec, 0
    out = dataclasses.replace(
        rec, experts=experts, valid=valid,
        metadata={**rec.metadata, "rows_filled_from_index": filled},
    )  # fmt: skip
    return out, filled
