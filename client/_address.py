"""Content addresses: the token chain and a chunk's digest (docs/CONTRACTS.md, "Addressing").

``chain[i] = H(chain[i-1] | token ids of block i)`` from a seed naming the model shape and the
weight version, and a chunk's address is ``H(rows | chain[i] | valid bits | extra planes)``:
two records that share a token prefix and its routes share those chunks, and a reader checks
every chunk it uses against its address. ``H`` is BLAKE3 truncated to 16 bytes: collision
resistant (a writer cannot make another record's address hold its rows), and the rows go first
because BLAKE3 hashes 1 KiB leaves in SIMD lanes in aligned groups: 32 bytes before the rows
would shift every leaf off that alignment and halve its speed.
"""

from __future__ import annotations

import blake3
import msgpack
import numpy as np

from ._schema import HASH_BYTES

_SEED_DOMAIN = b"routereplay-chain-1"


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
    shape = [model, num_experts, top_k, list(moe_layers), block_size, weight_version]
    return blake3.blake3(_SEED_DOMAIN + msgpack.packb(shape)).digest(HASH_BYTES)


def next_chain(prev: bytes, token_bytes: bytes | memoryview) -> bytes:
    """The chain after a block whose token ids are ``token_bytes`` (uint32 LE)."""
    h = blake3.blake3(prev)
    h.update(token_bytes)
    return h.digest(HASH_BYTES)


def token_chain(seed: bytes, token_ids: np.ndarray, block_size: int, n_blocks: int) -> list[bytes]:
    """``chain[i]`` for the first ``n_blocks`` blocks of ``token_ids``."""
    tok = token_ids.astype("<u4", copy=False)
    out: list[bytes] = []
    prev = seed
    for i in range(n_blocks):
        prev = next_chain(prev, tok[i * block_size : (i + 1) * block_size].tobytes())
        out.append(prev)
    return out


def chunk_digest(
    chain: bytes, valid: np.ndarray, rows_lm: np.ndarray, extra: bytes | memoryview = b""
) -> bytes:
    """A chunk's content address: its layer-major rows, token chain, validity bits and the
    stored bytes of any extra planes."""
    rows = np.ascontiguousarray(rows_lm).reshape(-1).view(np.uint8)
    h = blake3.blake3(rows)
    h.update(chain)
    h.update(np.packbits(valid))
    if extra:
        h.update(extra)
    return h.digest(HASH_BYTES)
