"""Routing-weight capture for the in-process vLLM engine: the combine weights beside the ids.

vLLM's routed-experts capture records only ``topk_ids``. This extension widens that capture in
place, without forking vLLM: every routed row becomes ``[num_layers, 2 * top_k]`` int32, the ids
in slots ``:K`` and the float32 bit patterns of the weights in slots ``K:``. The weights are the
router's ``topk_weights`` as handed to the experts (after renormalisation and any routed scaling,
in the router's slot order, so slot ``k`` of a weight belongs to slot ``k`` of an id). Everything
downstream in vLLM (step snapshots, the prefix-cache block store, engine outputs) is generic over
the row shape and dtype, so cached-prefix rows carry their weights too.

Patch points (listed once in :data:`SYMBOLS`; :func:`check_supported` compares the source of
each function it replaces with those of the releases it was reviewed against, :data:`REVIEWED`,
before the engine starts):

- ``BaseRouter._select_experts`` hands ``topk_weights`` to the capture callback with the ids;
- ``RoutedExpertsCapturer.__init__`` / ``capture`` / ``snapshot_routing_data`` hold the wide row;
- the worker connector's ``bind_routed_experts_capturer`` refuses routers that would call the
  capture with ids only (model-specific routers, monolithic kernels' sinks);
- ``WorkerWrapperBase.routereplay_route_weights_dtype`` reports the dtype the weights had.

The worker installs it from the general plugin ``routereplay_capture`` (``plugins``) when
the service sets ``RR_CAPTURE_ROUTE_WEIGHTS`` (``--route-weights request|on``); without it vLLM
runs untouched.
"""

from __future__ import annotations

import hashlib
import inspect
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

__all__ = [
    "ENV",
    "REVIEWED",
    "SYMBOLS",
    "RouteWeightsUnsupported",
    "Symbol",
    "check_supported",
    "install",
    "installed",
    "installed_sources",
    "reviewed_release",
    "source_digest",
    "split_routes",
]

# Outside the ROUTEREPLAY_ namespace: those variables are the service's settings (the user's
# ROUTEREPLAY_ROUTE_WEIGHTS=request is --route-weights), which this internal flag must not touch.
ENV = "RR_CAPTURE_ROUTE_WEIGHTS"


@dataclass(frozen=True)
class Symbol:
    """One vLLM object the extension uses: ``name`` in ``module``; for a function it replaces or
    wraps (``replaced``), its ``attr`` (a method of the class ``name``; None: ``name`` itself),
    whose source must be one of a reviewed release's (:data:`REVIEWED`). Any other source is
    refused: a vLLM that changed one of them might route, capture or bind differently from what
    the patch assumes."""

    module: str
    name: str
    attr: str | None = None
    replaced: bool = False  # False: used as it is

    @property
    def label(self) -> str:
        return self.name if self.attr is None else f"{self.name}.{self.attr}"


_ROUTER = "vllm.model_executor.layers.fused_moe.router.base_router"
_CAPTURER = "vllm.model_executor.layers.fused_moe.routed_experts_capturer"
_CONNECTOR = "vllm.distributed.aux_output_connector.worker"
# Every vLLM object the extension touches, once. The worker connector imports the bind by name
# and calls it through its own module global, which is what the extension replaces.
SYMBOLS = (
    Symbol(_ROUTER, "BaseRouter", "_select_experts", replaced=True),
    Symbol(_CAPTURER, "RoutedExpertsCapturer", "__init__", replaced=True),
    Symbol(_CAPTURER, "RoutedExpertsCapturer", "capture", replaced=True),
    Symbol(_CAPTURER, "RoutedExpertsCapturer", "snapshot_routing_data", replaced=True),
    Symbol(_CAPTURER, "RoutedExpertsCaptureSource"),
    Symbol(_CONNECTOR, "bind_routed_experts_capturer", replaced=True),
    Symbol("vllm.v1.worker.worker_base", "WorkerWrapperBase"),
)
# Per release whose sources were read against the extension, the source of each function it
# replaces: sha256 of ``inspect.getsource``, first 16 hex digits (the CPU and CUDA wheels of a
# release alike). 0.31 binds a monolithic kernel's capture by ``set_capture_fn``, 0.32 by a
# ``RoutedExpertsSink``: the extension refuses monolithic kernels in both. 0.33's ``capture``
# restores sequence-parallel shards without DP metadata and writes dual-batch-overlap
# micro-batches at their offset; it slices and gathers along rows only, so the widened rows
# pass through it as ids do. 0.30 and older have no worker connector to extend.
REVIEWED: dict[str, dict[str, str]] = {
    "0.31.0": {
        "BaseRouter._select_experts": "72be73a361f8d723",
        "RoutedExpertsCapturer.__init__": "b7eb06724f882c2b",
        "RoutedExpertsCapturer.capture": "1d7c389ce43821b4",
        "RoutedExpertsCapturer.snapshot_routing_data": "18f44cd391ac7455",
        "bind_routed_experts_capturer": "cf3720c598567abd",
    },
    "0.32.0": {
        "BaseRouter._select_experts": "72be73a361f8d723",
        "RoutedExpertsCapturer.__init__": "b7eb06724f882c2b",
        "RoutedExpertsCapturer.capture": "1d7c389ce43821b4",
        "RoutedExpertsCapturer.snapshot_routing_data": "18f44cd391ac7455",
        "bind_routed_experts_capturer": "16f8f68f9d2aecae",
    },
    "0.33.0": {
        "BaseRouter._select_experts": "72be73a361f8d723",
        "RoutedExpertsCapturer.__init__": "b7eb06724f882c2b",
        "RoutedExpertsCapturer.capture": "5ccc3f525de4a36f",
        "RoutedExpertsCapturer.snapshot_routing_data": "18f44cd391ac7455",
        "bind_routed_experts_capturer": "16f8f68f9d2aecae",
    },
}
# The router's weight dtype seen by this worker (None until the first routed forward).
_weights_dtype: str | None = None


class RouteWeightsUnsupported(RuntimeError):
    """This vLLM's internals are not the ones the capture extension patches."""


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _symbols() -> dict[str, Any]:
    """The objects :data:`SYMBOLS` name, by name (one this vLLM lacks is absent)."""
    import importlib

    found: dict[str, Any] = {}
    for sym in SYMBOLS:
        try:
            m = importlib.import_module(sym.module)
        except ImportError:
            continue
        if hasattr(m, sym.name):
            found[sym.name] = getattr(m, sym.name)
    return found


def _source_digest(obj: Any) -> str:
    try:
        return source_digest(inspect.getsource(obj))
    except (OSError, TypeError):  # no source to read (a compiled or stripped vLLM)
        return "unreadable"


def source_digest(source: str) -> str:
    """The digest :data:`REVIEWED` holds for a function's source text."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def installed_sources() -> dict[str, str]:
    """The digest of each replaced function's source in this process's vLLM ("missing" for one
    it lacks, "unreadable" where vLLM ships no source); :class:`RouteWeightsUnsupported` names
    the first object of :data:`SYMBOLS` it lacks."""
    syms = _symbols()
    for sym in SYMBOLS:
        if sym.name not in syms:
            raise RouteWeightsUnsupported(
                f"--route-weights: vLLM {_vllm_version()} has no {sym.module}.{sym.name}"
            )
    digests = {}
    for sym in SYMBOLS:
        if sym.replaced:
            obj = syms[sym.name] if sym.attr is None else getattr(syms[sym.name], sym.attr, None)
            digests[sym.label] = "missing" if obj is None else _source_digest(obj)
    return digests


def reviewed_release(digests: dict[str, str] | None = None, version: str | None = None) -> str:
    """The reviewed release (a key of :data:`REVIEWED`) whose sources this vLLM's equal (or
    ``digests``', those of vLLM ``version``); :class:`RouteWeightsUnsupported` names the first
    function that differs from the release of the same version (else the newest reviewed)."""
    have = installed_sources() if digests is None else digests
    for release, sources in REVIEWED.items():
        if sources == have:
            return release
    version = version or _vllm_version()
    nearest = REVIEWED.get(version) or REVIEWED[max(REVIEWED, key=_release_key)]
    label = next(k for k in nearest if have.get(k) != nearest[k])
    want = ", ".join(f"{r} {s[label]}" for r, s in REVIEWED.items())
    raise RouteWeightsUnsupported(
        f"--route-weights: vLLM {version}'s {label} is not the code the routing-weight capture "
        f"replaces (source sha256 {have.get(label, 'missing')}; reviewed: {want}); serve "
        "without --route-weights"
    )


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


def check_supported() -> None:
    """Raise :class:`RouteWeightsUnsupported` unless this vLLM's capture sources are a reviewed
    release's (:func:`reviewed_release`)."""
    if not installed():  # patched in this process once this check passed
        reviewed_release()


def install() -> None:
    """Patch vLLM in this process (a worker: called by the general plugin). Idempotent."""
    check_supported()
    syms = _symbols()
    router = syms["BaseRouter"]
    if getattr(router._select_experts, "_routereplay", False):
        return
    _patch_router(router)
    _patch_capturer(syms["RoutedExpertsCapturer"])
    import vllm.distributed.aux_output_connector.worker as worker

    worker.bind_routed_experts_capturer = partial(
        _bind_checked, worker.bind_routed_experts_capturer, syms["RoutedExpertsCaptureSource"]
    )
    syms["WorkerWrapperBase"].routereplay_route_weights_dtype = lambda self: _weights_dtype


def _patch_router(router: type) -> None:
    def _select_experts(
        self: Any,
        hidden_states: Any,
        router_logits: Any,
        topk_indices_dtype: Any = None,
        *,
        input_ids: Any = None,
    ) -> tuple[Any, Any]:
        # vLLM 0.32.0's steps, with the weights handed to the capture beside the logical ids.
        self._validate_eplb_state()
        topk_weights, topk_ids = self._compute_routing(
            hidden_states, router_logits, topk_indices_dtype, input_ids=input_ids
        )
        if self.capture_fn is not None:
            self.capture_fn(topk_ids, topk_weights)
        topk_ids = self._apply_eplb_mapping(topk_ids)
        topk_ids = self._convert_indices_dtype(topk_ids, topk_indices_dtype)
        return topk_weights, topk_ids

    _select_experts._routereplay = True  # type: ignore[attr-defined]
    router._select_experts = _select_experts


def _patch_capturer(capturer: type) -> None:
    import torch

    orig_init, orig_capture = capturer.__init__, capturer.capture

    def __init__(self: Any, max_num_batched_tokens: int, vllm_config: Any) -> None:
        orig_init(self, max_num_batched_tokens, vllm_config)
        num_layers, top_k = self.shape_per_token
        # Read by vLLM's worker connector to size its buffers and block store.
        self.shape_per_token = (num_layers, 2 * top_k)
        self.output_dtype_name = "int32"
        self.output_dtype = torch.int32
        self.device_buffer = torch.zeros(
            (max_num_batched_tokens, num_layers, 2 * top_k),
            dtype=torch.int32,
            device=self.device_buffer.device,
        )

    def capture(self: Any, layer_id: int, topk_ids: Any, topk_weights: Any = None) -> None:
        global _weights_dtype
        if topk_weights is None:
            raise RouteWeightsUnsupported(
                f"routing-weight capture: layer {layer_id} routed without handing its weights"
            )
        _weights_dtype = str(topk_weights.dtype).removeprefix("torch.")
        # One int32 row: ids, then the weights' float32 bits (exact for bf16/fp16/fp32). vLLM's
        # capture then slices this rank's rows (data / sequence parallel) as it does for ids.
        bits = topk_weights.to(torch.float32).view(torch.int32)
        orig_capture(self, layer_id, torch.cat((topk_ids.to(torch.int32), bits), dim=1))

    def snapshot_routing_data(self: Any, num_tokens: int) -> Any:
        # vLLM's .to(uint8) copied; int32 -> int32 would alias the buffer the next step reuses.
        return self.device_buffer[:num_tokens].clone()

    capturer.__init__ = __init__
    capturer.capture = capture
    capturer.snapshot_routing_data = snapshot_routing_data


def _bind_checked(bind: Any, source: type, model: Any, capturer: Any) -> None:
    """vLLM's bind, refusing capture sources that hand over ids without weights."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    for module in model.modules():
        own = isinstance(module, source)
        if own or (isinstance(module, MoERunner) and module._quant_method.is_monolithic):
            raise RouteWeightsUnsupported(
                f"--route-weights: {type(module).__name__} routes outside vLLM's FusedMoE "
                "router (a model-specific router or a monolithic MoE kernel), which gives the "
                "capture no weights; serve this model without --route-weights"
            )
    bind(model, capturer)


def installed() -> bool:
    """Whether this process's vLLM routes with the weights handed to the capture."""
    try:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    except ImportError:
        return False
    return bool(getattr(BaseRouter._select_experts, "_routereplay", False))


def maybe_install() -> None:
    """Install when the service asked for it (``RR_CAPTURE_ROUTE_WEIGHTS=1``)."""
    if os.environ.get(ENV) == "1":
        install()


def split_routes(
    routes: np.ndarray, top_k: int, num_experts: int, weights: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """A widened ``[R, L, 2K]`` int32 capture -> ids ``[R, L, K]`` (vLLM's uint8/uint16) and
    weights ``[R, L, K]`` float32 (the engine's values, exactly; None unless ``weights``: a
    request that did not ask for them takes no copy).

    The ids are checked in range as int32 before they are narrowed: narrowing first would turn
    a layout change (weights' float bits in the id slots) into plausible small ids."""
    if routes.dtype != np.int32 or routes.ndim != 3 or routes.shape[2] != 2 * top_k:
        raise ValueError(
            f"routes of shape {routes.shape} {routes.dtype} are not the routing-weight "
            f"capture's [rows, layers, {2 * top_k}] int32"
        )
    wide = routes[:, :, :top_k]
    if wide.size and (int(wide.min()) < 0 or int(wide.max()) >= num_experts):
        raise ValueError(
            f"routing-weight capture: expert ids in [{int(wide.min())}, {int(wide.max())}] "
            f"outside [0, {num_experts}); the capture's row layout is not the expected one"
        )
    ids = wide.astype(np.uint8 if num_experts <= 256 else np.uint16)
    if not weights:
        return ids, None
    return ids, np.ascontiguousarray(routes[:, :, top_k:]).view(np.float32)
