"""What the Megatron-Core and the Hugging Face installers share: the straight-through gate of
``weights="engine"`` and the shadow diagnostics' report. Torch only, no trainer framework."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ShadowCounts", "ShadowReport", "shadow_counts"]


class _EngineProbs(torch.autograd.Function):
    """Forward: the engine's weights at ``rows`` (exact values), the router's probs elsewhere.
    Backward: the identity into the router's probs (straight-through), so the router's gradient
    is the one ids-only replay computes for the same upstream gradient."""

    @staticmethod
    def forward(ctx: Any, probs: torch.Tensor, engine: torch.Tensor, rows: torch.Tensor) -> Any:
        return torch.where(rows.unsqueeze(1), engine, probs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None, None


def shadow_counts(
    own: torch.Tensor, replayed: torch.Tensor, valid: torch.Tensor | None
) -> torch.Tensor:
    """``[rows, tokens whose top-k set differs, chosen experts that differ]`` of one router call
    (on the device, no host sync): ``own`` and ``replayed`` ``[N, K]`` expert ids, ``valid``
    ``[N]`` the rows that count (None: all)."""
    replayed = replayed.to(own.device)
    # Experts of the router's own top-k that the replayed row does not hold.
    off = (own.unsqueeze(2) != replayed.unsqueeze(1)).all(2).sum(1)
    if valid is not None and valid.shape[0] == own.shape[0]:
        off = off * valid  # rows outside ``valid`` count as agreeing, and are not counted as rows
        rows = valid.sum()
    else:
        rows = torch.full((), own.shape[0], device=own.device)
    return torch.stack([rows, off.count_nonzero(), off.sum()])


@dataclass(frozen=True)
class ShadowReport:
    """Shadow diagnostics of some replayed forwards: ``per_layer[layer] = (rows, tokens whose
    top-k set differs, chosen experts that differ)``; global 0-based layers."""

    per_layer: dict[int, tuple[int, int, int]]
    top_k: int

    def token_mismatch(self, layer: int | None = None) -> float:
        """Share of (token, layer) decisions whose expert set differs from the replayed one."""
        items = [self.per_layer[layer]] if layer is not None else list(self.per_layer.values())
        rows = sum(r for r, _, _ in items)
        return sum(t for _, t, _ in items) / rows if rows else 0.0

    def slot_mismatch(self, layer: int | None = None) -> float:
        """Share of the router's own chosen experts that were not the replayed ones."""
        items = [self.per_layer[layer]] if layer is not None else list(self.per_layer.values())
        rows = sum(r for r, _, _ in items)
        return sum(s for _, _, s in items) / (rows * self.top_k) if rows else 0.0

    def as_metrics(self, prefix: str = "replay/") -> dict[str, float]:
        out = {
            f"{prefix}router_token_mismatch": self.token_mismatch(),
            f"{prefix}router_slot_mismatch": self.slot_mismatch(),
        }
        for layer in self.per_layer:
            out[f"{prefix}router_token_mismatch/layer_{layer}"] = self.token_mismatch(layer)
        return out


class ShadowCounts:
    """Per-layer sums of :func:`shadow_counts` on the device (no host sync until
    :meth:`report`)."""

    def __init__(self) -> None:
        self._acc: dict[int, torch.Tensor] = {}

    def add(
        self, layer: int, own: torch.Tensor, replayed: torch.Tensor, valid: torch.Tensor | None
    ) -> None:
        counts = shadow_counts(own, replayed, valid)
        acc = self._acc.get(layer)
        self._acc[layer] = counts if acc is None else acc + counts

    def report(self, top_k: int, *, reset: bool = True) -> ShadowReport:
        per: dict[int, tuple[int, int, int]] = {}
        for layer, acc in sorted(self._acc.items()):
            rows, tok, slots = (int(x) for x in acc.tolist())
            per[layer] = (rows, tok, slots)
        if reset:
            self._acc.clear()
        return ShadowReport(per, top_k)
