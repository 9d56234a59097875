"""What a training batch replays: route coverage, weight versions, and a policy that decides,
per sample, what happens to samples it should not replay.

Pure data (numpy): from a :class:`PositionMap` and its records. A position of the batch is

- ``replayed``: mapped to a row the engine routed for that very request,
- ``filled``: mapped to a row the service filled from its token-prefix index (a shared prefix
  another request of the same weights routed; ``metadata["filled_rows"]``),
- ``invalid``: mapped to a row with no route (the last sampled token, a row nobody could
  recover): it gets filler experts, i.e. the trainer's routing is not the rollout's there,
- ``missing``: mapped to a record the store did not have (``None`` in the record list, what
  ``get_many(..., missing_ok=True)`` returns for it): fillers too,
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
from typing import Literal, get_args

import numpy as np

from routereplay.client import RouteRecord

from ._position_map import PositionMap
from ._report import ReplayReport, SampleDecision
from .errors import ReplayPolicyError

__all__ = [
    "BatchCoverage",
    "OnViolation",
    "RecordCoverage",
    "ReplayPolicy",
    "SampleCoverage",
    "batch_coverage",
]

UNKNOWN = "<unknown>"  # the version label of rows whose weights the engine did not report


@dataclass
class RecordCoverage:
    """Coverage of the positions that map to one record (in the whole batch, or in one sample:
    :attr:`SampleCoverage.records`)."""

    record: int
    route: str  # the route id given to batch_coverage, else request id and choice from metadata
    replayed: int = 0
    filled: int = 0
    invalid: int = 0
    versions: Counter[str] = field(default_factory=Counter)
    missing: int = 0  # positions mapped to this record while the store did not have it
    no_weights: int = 0  # positions mapped to this record while it lacks the engine's weights

    @property
    def mapped(self) -> int:
        return self.replayed + self.filled + self.invalid + self.missing

    def add(self, other: RecordCoverage) -> None:
        self.replayed += other.replayed
        self.filled += other.filled
        self.invalid += other.invalid
        self.missing += other.missing
        self.no_weights += other.no_weights
        self.versions.update(other.versions)


@dataclass
class SampleCoverage:
    """Coverage of one sample: its positions in the batch (``rows``, including positions of the
    sample that no record covers, such as an EOS the trainer appended) and, per record it reads,
    the coverage of the positions it reads there."""

    sample: int
    rows: int
    records: list[RecordCoverage]


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
    missing: int = 0
    samples: list[SampleCoverage] = field(default_factory=list)

    @property
    def mapped(self) -> int:
        return self.replayed + self.filled + self.invalid + self.missing

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
            f"{prefix}rows_missing": float(self.missing),
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


def _route_name(i: int, rec: RouteRecord | None, route_ids: Sequence[str] | None) -> str:
    if route_ids is not None:
        return str(route_ids[i])
    if rec is None:
        return f"record {i}"
    rid, choice = rec.metadata.get("request_id"), rec.metadata.get("choice")
    return f"{rid}-{choice}" if rid is not None and choice is not None else f"record {i}"


def _read_coverage(ri: int, name: str, rec: RouteRecord | None, rows: np.ndarray) -> RecordCoverage:
    """Coverage of the positions that read ``rows`` of record ``ri``."""
    c = RecordCoverage(ri, name)
    if rec is None:
        c.missing = int(rows.size)
        return c
    valid = rec.valid[rows]
    filled = _filled_mask(rec)[rows] & valid
    c.filled = int(filled.sum())
    c.replayed = int(valid.sum()) - c.filled
    c.invalid = int((~valid).sum())
    if getattr(rec, "weights", None) is None:
        c.no_weights = int(rows.size)
    vs, counts = np.unique(_row_versions(rec)[rows[valid]].astype(str), return_counts=True)
    c.versions.update(dict(zip(vs.tolist(), counts.tolist(), strict=True)))
    return c


def batch_coverage(
    pmap: PositionMap,
    records: Sequence[RouteRecord | None],
    layers: Sequence[int] = (),
    *,
    route_ids: Sequence[str] | None = None,
) -> BatchCoverage:
    """Count what each position of ``pmap`` replays (see the module docstring), for the batch,
    per record and per sample. ``records`` may hold ``None`` for a record the store did not
    have; ``route_ids`` (one per record) names records in messages and reports, default their
    request id and choice."""
    rec_idx = pmap.record.reshape(-1)
    tok_idx = pmap.token.reshape(-1)
    smp_idx = pmap.sample.reshape(-1)
    per: list[RecordCoverage] = []
    by_sample: dict[int, list[RecordCoverage]] = {}
    for ri in np.unique(rec_idx[rec_idx >= 0]).tolist():
        r = records[ri]
        name = _route_name(ri, r, route_ids)
        at = rec_idx == ri
        rows, smp = tok_idx[at], smp_idx[at]
        total = RecordCoverage(ri, name)
        for si in np.unique(smp).tolist():
            c = _read_coverage(ri, name, r, rows[smp == si])
            by_sample.setdefault(si, []).append(c)
            total.add(c)
        per.append(total)
    totals = RecordCoverage(-1, "")
    for c in per:
        totals.add(c)
    ids, counts = np.unique(smp_idx[smp_idx >= 0], return_counts=True)
    samples = [
        SampleCoverage(s, n, by_sample.get(s, []))
        for s, n in zip(ids.tolist(), counts.tolist(), strict=True)
    ]
    return BatchCoverage(
        positions=int(rec_idx.size),
        replayed=totals.replayed,
        filled=totals.filled,
        invalid=totals.invalid,
        no_route=int((rec_idx < 0).sum()),
        versions=totals.versions,
        records=per,
        layers=tuple(int(x) for x in layers),
        missing=totals.missing,
        samples=samples,
    )


_TRAILING_INT = re.compile(r"(\d+)$")


def _step(version: str) -> int | None:
    m = _TRAILING_INT.search(version)
    return int(m.group(1)) if m else None


OnViolation = Literal["raise", "drop", "own_routing"]
"""What :meth:`ReplayPolicy.decide` does with a sample that breaks the policy."""

Violation = tuple[str, str]  # (kind, message)


@dataclass(frozen=True)
class ReplayPolicy:
    """Which samples may replay their routes, and what happens to the others.

    Attributes:
        require_version: every replayed or filled row must come from these weights.
        current_version, max_staleness: rows at most ``max_staleness`` versions behind
            ``current_version``; versions are compared by their trailing integer ("step-12").
        allow_unknown_version: accept rows whose weights the engine did not report.
        min_coverage: least share of each record's mapped positions that replay a real route.
        max_invalid_rows: most positions of one record that get fillers (the final sampled token
            of a sample is one).
        require_weights: every record carries the engine's routing weights
            (``RouterReplayer(..., weights="engine")``); kind ``"missing_weights"``.
        on_violation: what :meth:`decide` does with a sample that breaks the policy: ``"raise"``
            (fail closed: :class:`ReplayPolicyError` for the batch, naming every record at
            fault), ``"drop"`` (the sample leaves the batch: :attr:`ReplayReport.kept`,
            :attr:`ReplayReport.loss_mask`) or ``"own_routing"`` (replay is off at the sample's
            positions and the trainer's router chooses their experts:
            ``gather_targets(..., own_routing=report.own_routing)``).

    A record the store did not have (``None`` in the record list) always breaks the policy.
    """

    require_version: str | None = None
    current_version: str | None = None
    max_staleness: int | None = None
    allow_unknown_version: bool = True
    min_coverage: float = 0.0
    max_invalid_rows: int | None = None
    on_violation: OnViolation = "raise"
    require_weights: bool = False

    def __post_init__(self) -> None:
        if self.on_violation not in get_args(OnViolation):
            raise ValueError(
                f"on_violation must be one of {get_args(OnViolation)}, not {self.on_violation!r}"
            )

    def check(self, cov: BatchCoverage) -> None:
        """Raise :class:`ReplayPolicyError` if any record of the batch breaks the policy (over
        all the positions that read it), naming each one; whatever ``on_violation`` says."""
        now = self._now()
        problems = [msg for c in cov.records for _, msg in self._violations(c, now)]
        if problems:
            shown = "; ".join(problems[:10])
            more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
            raise ReplayPolicyError(f"batch refused by the replay policy: {shown}{more}")

    def decide(
        self,
        pmap: PositionMap,
        records: Sequence[RouteRecord | None],
        layers: Sequence[int] = (),
        *,
        route_ids: Sequence[str] | None = None,
    ) -> ReplayReport:
        """Judge every sample of the batch ``pmap`` (the unsliced map: every rank of the batch
        decides alike) and return the :class:`ReplayReport`.

        A sample breaks the policy when a record it reads breaks it over the positions the
        sample reads there. ``"raise"``: :meth:`check` over the whole batch, as one error.
        ``records``, ``layers`` and ``route_ids`` are :func:`batch_coverage`'s.
        """
        cov = batch_coverage(pmap, records, layers, route_ids=route_ids)
        if self.on_violation == "raise":
            self.check(cov)
            return ReplayReport.of(pmap, cov, (), self.on_violation)
        now = self._now()
        decisions = []
        for sc in cov.samples:
            found = [v for c in sc.records for v in self._violations(c, now)]
            if found:
                decisions.append(
                    SampleDecision(
                        sample=sc.sample,
                        action=self.on_violation,
                        records=tuple(c.record for c in sc.records),
                        routes=tuple(c.route for c in sc.records),
                        kinds=tuple(dict.fromkeys(k for k, _ in found)),
                        reasons=tuple(msg for _, msg in found),
                        rows=sc.rows,
                    )
                )
        return ReplayReport.of(pmap, cov, tuple(decisions), self.on_violation)

    def _now(self) -> int | None:
        """``current_version``'s step when staleness is bounded."""
        if self.max_staleness is None:
            return None
        now = None if self.current_version is None else _step(self.current_version)
        if now is None:
            raise ReplayPolicyError(
                "max_staleness needs current_version with a trailing step number, e.g. "
                f"'step-12' (got {self.current_version!r})"
            )
        return now

    def _violations(self, c: RecordCoverage, now: int | None) -> list[Violation]:
        """How the positions counted in ``c`` break the policy: ``(kind, message)`` each."""
        if c.missing:
            return [("missing", f"{c.route}: no route record ({c.missing} positions)")]
        out = self._version_violations(c, now)
        if self.require_weights and c.no_weights:
            out.append(
                (
                    "missing_weights",
                    f"{c.route}: no engine routing weights ({c.no_weights} positions)",
                )
            )
        if c.mapped and (c.replayed + c.filled) / c.mapped < self.min_coverage:
            out.append(
                (
                    "coverage",
                    f"{c.route}: coverage {(c.replayed + c.filled) / c.mapped:.3f} below "
                    f"{self.min_coverage}",
                )
            )
        if self.max_invalid_rows is not None and c.invalid > self.max_invalid_rows:
            out.append(
                (
                    "invalid_rows",
                    f"{c.route}: {c.invalid} positions without a route (fillers), at most "
                    f"{self.max_invalid_rows} allowed",
                )
            )
        return out

    def _version_violations(self, c: RecordCoverage, now: int | None) -> list[Violation]:
        out: list[Violation] = []
        for v, n in c.versions.items():
            if v == UNKNOWN:
                if not self.allow_unknown_version or self.require_version is not None:
                    out.append(("unknown_version", f"{c.route}: {n} rows from unknown weights"))
                continue
            if self.require_version is not None and v != self.require_version:
                out.append(
                    (
                        "version",
                        f"{c.route}: {n} rows from weights {v!r}, required "
                        f"{self.require_version!r}",
                    )
                )
            if now is not None:
                step = _step(v)
                if step is None or now - step > self.max_staleness:  # type: ignore[operator]
                    out.append(
                        (
                            "staleness",
                            f"{c.route}: {n} rows from weights {v!r}, more than "
                            f"{self.max_staleness} versions behind {self.current_version!r}",
                        )
                    )
        return out
