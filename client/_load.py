"""The expert load of route records: per weight version, the tokens each expert of each MoE layer
received, and the load figures the service's telemetry and ``routereplay report`` draw from them.
Pure numpy on :class:`RouteRecord`, so a report needs neither the service nor Prometheus."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ._record import RouteRecord

__all__ = ["UNKNOWN_VERSION", "expert_counts", "load_figures"]

UNKNOWN_VERSION = "unknown"


def expert_counts(record: RouteRecord) -> Iterator[tuple[str, np.ndarray, int]]:
    """Per weight span of ``record`` (rows of no known version: :data:`UNKNOWN_VERSION`):
    ``(version, counts [M, E] int64, tokens)`` over its valid rows."""
    M, E = len(record.moe_layers), record.num_experts
    offsets = (np.arange(M, dtype=np.int64) * E)[None, :, None]
    for version, start, stop in record.weight_versions or [(None, 0, record.num_tokens)]:
        rows = record.experts[start:stop][record.valid[start:stop]]
        flat = (rows.astype(np.int64) + offsets).ravel()
        counts = np.bincount(flat, minlength=M * E).reshape(M, E)
        yield str(version or UNKNOWN_VERSION), counts, len(rows)


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
