"""What a training batch replays: route coverage, weight versions, and a policy that refuses
batches it should not train on.

Pure data (numpy): from a :class:`PositionMap` and its records. A position of the batch is

- ``replayed``: mapped to a row the engine routed for that very request,
- ``filled``: mapped to a row the service filled from its token-prefix index (a shared prefix
  another request of the same weights routed; ``metadata["filled_rows"]``),
- ``invalid``: mapped to a row with no route (the last sampled token, a row nobody could
  recover): it gets filler experts, i.e. the trainer's routing is not the rollout's there,
- ``no_route``: padding or a token no record covers.

A row covers every MoE layer at once (records hold all of the model's MoE layers or are refused),
so coverage per layer equals coverage per row; :class:`BatchCoverage.per_layer` says so
explicitly for dashboards that want one series per layer.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from routereplay.client import RouteRecord

from ._position_map import PositionMap
from .errors import ReplayPolicyError

__all__ = ["BatchCoverage", "RecordCoverage", "ReplayPolicy", "batch_coverage"]

UNKNOWN = "<unknown>"  # the version label of rows whose weights the engine did not report


@dataclass
class RecordCoverage:
    """Coverage of the positions that map to one record."""

    record: int
    route: str  # request id and choice, from the record's metadata
    replayed: int = 0
    filled: int = 0
    invalid: int = 0
    versions: Counter[str] = field(default_factory=Counter)

    @property
    def mapped(self) -> int:
        return self.replayed + self.filled + self.invalid


@dataclass
class BatchCoverage:
    positions: int
    replayed: int
    filled: int
    invalid: int
    no_route: int
    versions: Counter[str]  # replayed + filled positions per weight version
    records: list[RecordCoverage]
    layers: tuple[int, ...] = ()

    @property
    def mapped(self) -> int:
        return self.replayed + self.filled + self.invalid

    @property
    def coverage(self) -> float:
        """Share of mapped positions that replay a real route (replayed or filled)."""
        return (self.replayed + self.filled) / self.mapped if self.mapped else 1.0

    def per_layer(self) -> dict[int, dict[str, int]]:
        """The same counts for each MoE layer (a row covers all of them)."""
        row = {"replayed": self.replayed, "filled": self.filled, "invalid": self.invalid}
        return {layer: dict(row) for layer in self.layers}

    def as_metrics(self, prefix: str = "replay/") -> dict[str, float]:
        """Flat numbers for a step's metrics logger."""
        out = {
            f"{prefix}coverage": self.coverage,
            f"{prefix}rows_replayed": float(self.replayed),
            f"{prefix}rows_filled": float(self.filled),
            f"{prefix}rows_invalid": float(self.invalid),
            f"{prefix}rows_no_route": float(self.no_route),
        }
        for v, n in self.versions.items():
            out[f"{prefix}rows_version/{v}"] = float(n)
        return out


def _filled_mask(rec: RouteRecord) -> np.ndarray:
    mask = np.zeros(rec.num_tokens, dtype=bool)
    for a, b in rec.metadata.get("filled_rows") or ():
        mask[int(a) : int(b)] = True
    return mask


def _row_versions(rec: RouteRecord) -> np.ndarray:
    """Version label of every row (``UNKNOWN`` where the record says nothing)."""
    out = np.full(rec.num_tokens, UNKNOWN, dtype=object)
    for v, a, b in rec.weight_versions:
        out[a:b] = v
    return out


def _route_name(i: int, rec: RouteRecord) -> str:
    rid, choice = rec.metadata.get("request_id"), rec.metadata.get("choice")
    return f"{rid}-{choice}" if rid is not None and choice is not None else f"record {i}"


def batch_coverage(
    pmap: PositionMap, records: Sequence[RouteRecord], layers: Sequence[int] = ()
) -> BatchCoverage:
    """Count what each position of ``pmap`` replays (see the module docstring)."""
    rec_idx = pmap.record.reshape(-1)
    tok_idx = pmap.token.reshape(-1)
    per: list[RecordCoverage] = []
    totals = Counter[str]()
    versions = Counter[str]()
    for ri in np.unique(rec_idx[rec_idx >= 0]).tolist():
        r = records[ri]
        rows = tok_idx[rec_idx == ri]
        valid = r.valid[rows]
        filled = _filled_mask(r)[rows] & valid
        c = RecordCoverage(ri, _route_name(ri, r))
        c.filled = int(filled.sum())
        c.replayed = int(valid.sum()) - c.filled
        c.invalid = int((~valid).sum())
        vs, counts = np.unique(_row_versions(r)[rows[valid]].astype(str), return_counts=True)
        c.versions.update(dict(zip(vs.tolist(), counts.tolist(), strict=True)))
        versions.update(c.versions)
        totals.update({"replayed": c.replayed, "filled": c.filled, "invalid": c.invalid})
        per.append(c)
    return BatchCoverage(
        positions=int(rec_idx.size),
        replayed=totals["replayed"],
        filled=totals["filled"],
        invalid=totals["invalid"],
        no_route=int((rec_idx < 0).sum()),
        versions=versions,
        records=per,
        layers=tuple(int(x) for x in layers),
    )


_TRAILING_INT = re.compile(r"(\d+)$")


def _step(version: str) -> int | None:
    m = _TRAILING_INT.search(version)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ReplayPolicy:
    """When a batch may train (fail closed: :meth:`check` raises, naming the records).

    Attributes:
        require_version: every replayed or filled row must come from these weights.
        current_version, max_staleness: rows at most ``max_staleness`` versions behind
            ``current_version``; versions are compared by their trailing integer ("step-12").
        allow_unknown_version: accept rows whose weights the engine did not report.
        min_coverage: least share of each record's mapped positions that replay a real route.
        max_invalid_rows: most positions of one record that get fillers (the final sampled token
            of a sample is one).
    """

    require_version: str | None = None
    current_version: str | None = None
    max_staleness: int | None = None
    allow_unknown_version: bool = True
    min_coverage: float = 0.0
    max_invalid_rows: int | None = None

    def check(self, cov: BatchCoverage) -> None:
        problems: list[str] = []
        now = None
        if self.max_staleness is not None:
            if self.current_version is None or _step(self.current_version) is None:
                raise ReplayPolicyError(
                    "max_staleness needs current_version with a trailing step number, e.g. "
                    f"'step-12' (got {self.current_version!r})"
                )
            now = _step(self.current_version)
        for c in cov.records:
            for v, n in c.versions.items():
                if v == UNKNOWN:
                    if not self.allow_unknown_version or self.require_version is not None:
                        problems.append(f"{c.route}: {n} rows from unknown weights")
                    continue
                if self.require_version is not None and v != self.require_version:
                    problems.append(
                        f"{c.route}: {n} rows from weights {v!r}, required {self.require_version!r}"
                    )
                if now is not None:
                    step = _step(v)
                    if step is None or now - step > self.max_staleness:
                        problems.append(
                            f"{c.route}: {n} rows from weights {v!r}, more than "
                            f"{self.max_staleness} versions behind {self.current_version!r}"
                        )
            if c.mapped and (c.replayed + c.filled) / c.mapped < self.min_coverage:
                problems.append(
                    f"{c.route}: coverage {(c.replayed + c.filled) / c.mapped:.3f} below "
                    f"{self.min_coverage}"
                )
            if self.max_invalid_rows is not None and c.invalid > self.max_invalid_rows:
                problems.append(
                    f"{c.route}: {c.invalid} positions without a route (fillers), at most "
                    f"{self.max_invalid_rows} allowed"
                )
        if problems:
            shown = "; ".join(problems[:10])
            more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
            raise ReplayPolicyError(f"batch refused by the replay policy: {shown}{more}")
