"""The expert load of route records: per weight version, the tokens each expert of each MoE layer
received, and the load figures the service's telemetry and ``routereplay report`` draw from them.
Pure numpy on :class:`RouteRecord`, so a report needs neither the service nor Prometheus."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ._record import RouteRecord

__all__ = ["UNKNOWN_VERSION", "expert_counts", "layer_counts", "load_figures"]

UNKNOWN_VERSION = "unknown"


def expert_counts(record: RouteRecord) -> Iterator[tuple[str, np.ndarray, int]]:
    """Per weight span of ``record`` (rows of no known version: :data:`UNKNOWN_VERSION`):
    ``(version, counts [M, E] int64, tokens)`` over its valid rows."""
    for version, start, stop in record.weight_versions or [(None, 0, record.num_tokens)]:
        valid = record.valid[start:stop]
        counts = layer_counts(record.experts[start:stop], valid, record.num_experts)
        yield str(version or UNKNOWN_VERSION), counts, int(valid.sum())


BLOCK_IDS = 1 << 18  # expert ids per bincount (see layer_counts)


def layer_counts(experts: np.ndarray, valid: np.ndarray, num_experts: int) -> np.ndarray:
    """Expert counts ``[M, E]`` int64 of the valid rows of ``experts`` ``[T, M, K]``.

    One bincount of ``layer * E + id`` per block of rows: the int64 copy that bincount works on
    is one block's (``max(2**18, M * E)`` ids: 2 MiB for most models), never one of the whole
    ``[T, M, K]``. A bincount per layer bounds memory as well, but gathering each layer's
    strided ids made it about 2x slower on a 48-layer, top-8 record."""
    T, M, K = experts.shape
    bins = M * num_experts
    rows = max(1, max(BLOCK_IDS, bins) // max(1, M * K))
    offsets = (np.arange(M, dtype=np.intp) * num_experts)[:, None]
    out = np.zeros(bins, np.int64)
    for a in range(0, T, rows):
        ok = valid[a : a + rows]
        block = experts[a : a + rows] if ok.all() else experts[a : a + rows][ok]
        out += np.bincount((block + offsets).ravel(), minlength=bins)
    return out.reshape(M, num_experts)


def load_figures(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer of ``counts`` ``[M, E]`` (tokens routed to each expert): the load imbalance
    (max / mean; 1 when balanced), the routing entropy of the load normalised by ``log E`` (1
    when uniform, 0 when one expert takes everything) and the share of experts with no token.
    Layers without tokens give NaN."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(axis=1)
    E = counts.shape[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        imbalance = counts.max(axis=1) / (total / E)
        p = counts / total[:, None]
        logp = np.where(p > 0, np.log(np.where(p > 0, p, 1.0)), 0.0)
        entropy = -(p * logp).sum(axis=1) / np.log(E)
    unused = (counts == 0).mean(axis=1)
    empty = total == 0
    for a in (imbalance, entropy, unused):
        a[empty] = np.nan
    return imbalance, entropy, unused
