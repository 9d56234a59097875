"""Errors the trainer adapter raises. Each message names the sample, position or layer at fault
and what was expected, so a drifted tokenizer or a misconfigured model is found from the log alone.
"""

from __future__ import annotations

from routereplay.client import RouteError, RouteShapeError

__all__ = [
    "MissingWeightsError",
    "ReplayConfigError",
    "ReplayPolicyError",
    "RouteAlignmentError",
    "RouteLayerMismatchError",
    "TargetShapeError",
    "TokenMismatchError",
]


class RouteAlignmentError(RouteShapeError):
    """Records cannot be placed on the trainer's packed batch (lengths, offsets or shapes)."""


class TokenMismatchError(RouteAlignmentError):
    """A record's token id differs from the trainer's token id at a mapped position."""

    def __init__(
        self, sample: int, position: int, expected: int, found: int, detail: str = ""
    ) -> None:
        self.sample = sample
        self.position = position
        self.expected = expected  # the trainer's token id
        self.found = found  # the record's token id
        super().__init__(
            f"sample {sample} position {position}: trainer token id {expected} but the route "
            f"record has {found}"
            + (f" ({detail})" if detail else "")
            + "; the routes were computed for different tokens (retokenization drift?)"
        )


class RouteLayerMismatchError(RouteShapeError):
    """The records' MoE layers, expert count or top-k do not match the model's routers."""


class TargetShapeError(RouteShapeError):
    """A replay target does not fit its router (rows, top-k, dtype or expert range).

    Megatron's RouterReplay checks none of this: too few rows silently leave tokens unrouted.
    """


class MissingWeightsError(RouteShapeError):
    """A route record without the engine's routing weights where ``weights="engine"`` replay
    needs them. ``kind`` is the per-sample policy's name for it."""

    kind = "missing_weights"

    def __init__(self, route: str, record: int) -> None:
        self.route = route
        self.record = record
        super().__init__(
            f"route {route} (record {record}) has no engine routing weights, which "
            "weights='engine' replay needs; store them with the routes, or replay ids only"
        )


class ReplayConfigError(RouteError, ValueError):
    """The model's configuration bypasses routing replay (fused router, sinkhorn, ...)."""


class ReplayPolicyError(RouteError, ValueError):
    """A batch fails the trainer's replay policy (weight versions, staleness, coverage); the
    message names each record at fault."""
