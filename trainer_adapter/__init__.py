"""Trainer adapter: align stored routes to packed Megatron batches and replay them.

The alignment half (position maps, builders, parallel slicing, target gathering) is pure
numpy and imports no Megatron. The Megatron installer (:class:`RouterReplayer`,
:class:`R2Recorder`, :func:`check_replay_config`) lives in one module, ``_megatron``, loaded on
first use; the Hugging Face transformers one in :mod:`routereplay.trainer_adapter.hf`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._coverage import (
    BatchCoverage,
    OnViolation,
    RecordCoverage,
    ReplayPolicy,
    SampleCoverage,
    batch_coverage,
)
from ._layers import moe_layer_pattern
from ._position_map import (
    NO_ROUTE,
    PositionMap,
    SampleMap,
    cp_zigzag_index,
    multi_turn_sample,
    padded_position_map,
    sample_from_record,
    shared_prefix_sample,
    thd_cp_index,
    thd_position_map,
)
from ._prefetch import Prefetcher
from ._report import VIOLATION_KINDS, ReplayReport, SampleDecision, step_scalars
from ._share import TargetShareError, share_targets, sp_slice
from ._targets import ReplayTargets, TargetBuffers, filler_experts, gather_targets
from .errors import (
    MissingWeightsError,
    ReplayConfigError,
    ReplayPolicyError,
    RouteAlignmentError,
    RouteLayerMismatchError,
    TargetShapeError,
    TokenMismatchError,
)

if TYPE_CHECKING:
    from ._megatron import (
        R2Recorder,
        RouterReplayer,
        RouterSlot,
        ShadowReport,
        attach_legacy_replay,
        check_replay_config,
        find_routers,
    )

__all__ = [
    "NO_ROUTE",
    "VIOLATION_KINDS",
    "BatchCoverage",
    "MissingWeightsError",
    "OnViolation",
    "PositionMap",
    "Prefetcher",
    "R2Recorder",
    "RecordCoverage",
    "ReplayConfigError",
    "ReplayPolicy",
    "ReplayPolicyError",
    "ReplayReport",
    "ReplayTargets",
    "RouteAlignmentError",
    "RouteLayerMismatchError",
    "RouterReplayer",
    "RouterSlot",
    "SampleCoverage",
    "SampleDecision",
    "SampleMap",
    "ShadowReport",
    "TargetBuffers",
    "TargetShapeError",
    "TargetShareError",
    "TokenMismatchError",
    "attach_legacy_replay",
    "batch_coverage",
    "check_replay_config",
    "cp_zigzag_index",
    "filler_experts",
    "find_routers",
    "gather_targets",
    "moe_layer_pattern",
    "multi_turn_sample",
    "padded_position_map",
    "sample_from_record",
    "share_targets",
    "shared_prefix_sample",
    "sp_slice",
    "step_scalars",
    "thd_cp_index",
    "thd_position_map",
]

_MEGATRON = {
    "R2Recorder",
    "attach_legacy_replay",
    "RouterReplayer",
    "RouterSlot",
    "ShadowReport",
    "check_replay_config",
    "find_routers",
}


def __getattr__(name: str) -> Any:
    # Megatron (and torch) load only when the installer is used: alignment runs without them.
    if name in _MEGATRON:
        from . import _megatron

        return getattr(_megatron, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
