"""Which global transformer layers are MoE layers, from the model's layer pattern."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import RouteLayerMismatchError

__all__ = ["moe_layer_pattern"]


def moe_layer_pattern(
    num_layers: int, moe_layer_freq: int | Sequence[int] = 1, *, first_k_dense: int = 0
) -> tuple[int, ...]:
    """Global 0-based indices of the MoE layers, as Megatron-Core builds them.

    ``moe_layer_freq`` follows ``TransformerConfig.moe_layer_freq``: an int ``f`` makes layer ``i``
    MoE when ``i % f == 0``; a list of ``num_layers`` 0/1 flags names each layer. ``first_k_dense``
    additionally makes the first ``k`` layers dense (DeepSeek-style "first k dense"). The result
    is what routes are mapped by: a global layer number, never ``i + offset``.
    """
    if num_layers < 1:
        raise RouteLayerMismatchError(f"num_layers must be >= 1, got {num_layers}")
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise RouteLayerMismatchError(f"moe_layer_freq must be >= 1, got {moe_layer_freq}")
        flags = [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    else:
        flags = [int(x) for x in moe_layer_freq]
        if len(flags) != num_layers:
            raise RouteLayerMismatchError(
                f"moe_layer_freq lists {len(flags)} layers but the model has {num_layers}"
            )
        if any(f not in (0, 1) for f in flags):
            raise RouteLayerMismatchError(f"moe_layer_freq flags must be 0 or 1, got {flags}")
    if not 0 <= first_k_dense <= num_layers:
        raise RouteLayerMismatchError(f"first_k_dense={first_k_dense} out of [0, {num_layers}]")
    return tuple(i for i, f in enumerate(flags) if f and i >= first_k_dense)
