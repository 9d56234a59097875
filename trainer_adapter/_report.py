"""The per-batch replay report: what :meth:`ReplayPolicy.decide` did with each sample.

Pure data (numpy). The masks have the batch's ``[B, S]`` shape (THD: ``[1, T]``), unsliced: every
rank of a batch holds the same report, and :func:`gather_targets` slices the replay decision
along with the position map (``own_routing=report.own_routing``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

import numpy as np

if TYPE_CHECKING:
    from ._coverage import BatchCoverage
    from ._position_map import PositionMap

__all__ = ["VIOLATION_KINDS", "ReplayReport", "SampleDecision", "step_scalars"]

VIOLATION_KINDS = (
    "missing",
    "version",
    "staleness",
    "unknown_version",
    "coverage",
    "invalid_rows",
    "missing_weights",
)
"""Why a sample breaks a :class:`ReplayPolicy` (:attr:`SampleDecision.kinds`)."""

T = TypeVar("T")


@dataclass(frozen=True)
class SampleDecision:
    """What happened to one sample that broke the policy.

    Attributes:
        sample: the sample's index in the batch (:attr:`PositionMap.sample`).
        action: ``"drop"`` or ``"own_routing"``.
        records: indices of the records the sample reads, ascending.
        routes: their names (the route ids given to ``decide``, else request id and choice).
        kinds: the kinds of violation found (:data:`VIOLATION_KINDS`), first seen first.
        reasons: one message per violation, worded as :class:`ReplayPolicyError` words them.
        rows: the sample's positions in the batch: the rows dropped or routed by the router.
    """

    sample: int
    action: Literal["drop", "own_routing"]
    records: tuple[int, ...]
    routes: tuple[str, ...]
    kinds: tuple[str, ...]
    reasons: tuple[str, ...]
    rows: int


@dataclass(frozen=True)
class ReplayReport:
    """One batch's replay decisions.

    Attributes:
        on_violation: the policy's action for samples that break it.
        num_samples: samples in the batch (``max(pmap.sample) + 1``).
        decisions: one :class:`SampleDecision` per sample that broke the policy, by sample.
        loss_mask: ``[B, S]`` bool, True at the positions of kept samples; False at dropped
            samples' positions and at positions of no sample (padding). Multiply it into the
            trainer's own loss mask when the batch is not re-packed without the dropped samples.
        replay_mask: ``[B, S]`` bool, False at the positions of ``own_routing`` samples (the
            trainer's router chooses their experts), True elsewhere (padding replays fillers).
        coverage: the :class:`BatchCoverage` the decisions were made from.
    """

    on_violation: str
    num_samples: int
    decisions: tuple[SampleDecision, ...]
    loss_mask: np.ndarray
    replay_mask: np.ndarray
    coverage: BatchCoverage

    @classmethod
    def of(
        cls,
        pmap: PositionMap,
        coverage: BatchCoverage,
        decisions: tuple[SampleDecision, ...],
        on_violation: str,
    ) -> ReplayReport:
        """The report of ``decisions`` on the batch ``pmap``, masks included."""
        smp = pmap.sample
        dropped = [d.sample for d in decisions if d.action == "drop"]
        own = [d.sample for d in decisions if d.action == "own_routing"]
        return cls(
            on_violation=on_violation,
            num_samples=int(smp.max()) + 1 if smp.size else 0,
            decisions=decisions,
            loss_mask=(smp >= 0) & ~np.isin(smp, dropped),
            replay_mask=~np.isin(smp, own),
            coverage=coverage,
        )

    @property
    def dropped(self) -> tuple[int, ...]:
        """Samples that leave the batch."""
        return tuple(d.sample for d in self.decisions if d.action == "drop")

    @property
    def own_routing(self) -> tuple[int, ...]:
        """Samples whose experts the trainer's router chooses."""
        return tuple(d.sample for d in self.decisions if d.action == "own_routing")

    @property
    def kept(self) -> tuple[int, ...]:
        """Samples that stay in the batch (replayed or routed by the router), ascending."""
        gone = set(self.dropped)
        return tuple(i for i in range(self.num_samples) if i not in gone)

    def select(self, items: Sequence[T]) -> list[T]:
        """The kept ones of per-sample ``items`` (sample maps, token ids, route ids), to re-pack
        the batch without the dropped samples."""
        if len(items) != self.num_samples:
            raise ValueError(f"{len(items)} items for a batch of {self.num_samples} samples")
        return [items[i] for i in self.kept]

    def scalars(self, prefix: str = "replay/") -> dict[str, float]:
        """Flat numbers for a metrics logger: samples and rows per decision, samples per kind of
        violation (every kind, zeros included, so series stay continuous), and the coverage's
        :meth:`BatchCoverage.as_metrics`."""
        own = [d for d in self.decisions if d.action == "own_routing"]
        drop = [d for d in self.decisions if d.action == "drop"]
        out = {
            f"{prefix}samples": float(self.num_samples),
            f"{prefix}kept_samples": float(self.num_samples - len(drop)),
            f"{prefix}dropped_samples": float(len(drop)),
            f"{prefix}dropped_rows": float(sum(d.rows for d in drop)),
            f"{prefix}own_routing_samples": float(len(own)),
            f"{prefix}own_routing_rows": float(sum(d.rows for d in own)),
        }
        for kind in VIOLATION_KINDS:
            n = sum(kind in d.kinds for d in self.decisions)
            out[f"{prefix}violations/{kind}"] = float(n)
        out.update(self.coverage.as_metrics(prefix))
        return out


def step_scalars(reports: Sequence[ReplayReport], prefix: str = "replay/") -> dict[str, float]:
    """:meth:`ReplayReport.scalars` of a step's micro-batches: counts summed, the coverage share
    recomputed from the summed rows."""
    out: dict[str, float] = {}
    for r in reports:
        for k, v in r.scalars(prefix).items():
            out[k] = out.get(k, 0.0) + v
    if reports:
        covered = out[f"{prefix}rows_replayed"] + out[f"{prefix}rows_filled"]
        mapped = covered + out[f"{prefix}rows_invalid"] + out[f"{prefix}rows_missing"]
        out[f"{prefix}coverage"] = covered / mapped if mapped else 1.0
    return out
