"""The one module that touches Megatron-Core: installs replay targets into RouterReplay.

Two paths, one API: megatron-core >= 0.16 has ``RouterReplay`` (native, the default there: build
with ``moe_enable_routing_replay=True``); 0.12 to 0.15 get :mod:`._legacy`'s equivalent, attached
to the built model's routers by :class:`RouterReplayer` (no config flag exists there).

Routers are found by walking the model (every VPP chunk), never through
``RouterReplay.global_router_replay_instances``: that list grows across model builds and a stale
entry silently disables replay. Each router is matched to its targets by its global 1-based
``layer_number`` (pipeline offset included), never by position in a list.

Per micro-batch: targets + REPLAY_FORWARD before the forward, REPLAY_BACKWARD right after, so
activation recompute during backward pops this micro-batch's targets (RouterReplay keeps a FIFO
per router; 1F1B runs backwards in forward order). Everything is cleared at each step boundary.

Rows a :class:`ReplayPolicy` hands to the trainer's router (``own_routing``) ride on the target
tensor itself, so the FIFO gives recompute the same rows as the forward; the forward's choice at
those rows replaces the queued target, so recompute repeats it rather than choosing again.

Under ``weights="engine"`` the engine's routing weights ride on the target tensor the same way;
a forward hook on each router puts them into its output probs at the replayed rows (exact
forward values, gradient straight through to the router's own probs), in the forward and in
recompute alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import _legacy
from ._legacy import LegacyRouterReplay
from ._replay_common import ShadowCounts, ShadowReport, _EngineProbs
from ._targets import ReplayTargets
from .errors import ReplayConfigError, RouteLayerMismatchError, TargetShapeError

try:  # megatron-core >= 0.16
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    NATIVE = True
except ImportError:  # 0.12 - 0.15: no RouterReplay; the legacy path is the only one
    RouterReplay = None  # type: ignore[assignment,misc]
    RouterReplayAction = _legacy.ReplayAction  # type: ignore[assignment,misc]
    NATIVE = False

ReplayState = Any  # a RouterReplay (native) or a LegacyRouterReplay: the same interface
_STATES: tuple[type, ...] = (LegacyRouterReplay,) if RouterReplay is None else (
    RouterReplay, LegacyRouterReplay,
)  # fmt: skip


def _action(rr: ReplayState) -> str | None:
    """The router's replay action by value (either path's enum)."""
    a = rr.router_replay_action
    return None if a is None else a.value


# Attribute of an installed target tensor: ``[N]`` bool on its device, True at the rows whose
# experts the router chooses itself. On the tensor, not beside it: RouterReplay queues the very
# tensor for recompute, so the mask cannot drift from its micro-batch.
_OWN_ROWS = "_routereplay_own_rows"
# Attributes of an installed target under ``weights="engine"``, for the same reason: ``[N, K]``
# float32 engine weights in the target's slot order, and ``[N]`` bool, True at the rows whose
# router output takes them (replayed rows of real routes; not fillers, not own-routing rows).
_ENGINE_W = "_routereplay_engine_weights"
_ENGINE_ROWS = "_routereplay_engine_rows"


def _queued(rr: ReplayState, act: str | None) -> torch.Tensor | None:
    """The target this call of the router replays, read before RouterReplay pops it."""
    if act == "replay_forward":
        return rr.target_topk_idx
    if act == "replay_backward" and rr.replay_backward_list:
        return rr.replay_backward_list[0]
    return None


def _requeue(rr: ReplayState, target: torch.Tensor, chosen: torch.Tensor) -> None:
    """Queue the forward's experts (replayed and the router's own) for recompute in place of
    ``target``: recompute then repeats the forward's decisions exactly, even where recomputed
    scores would differ in the last bit and tip a near tie."""
    for i, t in enumerate(rr.replay_backward_list):
        if t is target:
            chosen = chosen.detach()
            for name in (_ENGINE_W, _ENGINE_ROWS):  # the engine rows keep their ids: same rows
                if hasattr(target, name):
                    setattr(chosen, name, getattr(target, name))
            rr.replay_backward_list[i] = chosen
            return


def _engine_probs(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The router's dense ``[N, E]`` probs with ``target``'s engine weights at its engine rows."""
    w = getattr(target, _ENGINE_W)
    idx = target.to(probs.device, torch.int64)
    engine = torch.zeros_like(probs).scatter(1, idx, w.to(probs.device, probs.dtype))
    return _EngineProbs.apply(probs, engine, getattr(target, _ENGINE_ROWS).to(probs.device))


__all__ = [
    "NATIVE",
    "R2Recorder",
    "RouterReplayAction",
    "RouterReplayer",
    "RouterSlot",
    "ShadowReport",
    "attach_legacy_replay",
    "check_replay_config",
    "find_routers",
]

TargetsLike = ReplayTargets | torch.Tensor | Mapping[int, torch.Tensor]


def check_replay_config(config: Any, *, legacy: bool = False) -> None:
    """Raise :class:`ReplayConfigError` if ``config`` (a ``TransformerConfig``) cannot replay.

    Refused because replay is silently bypassed or undone: the fused router kernel (ignores
    RouterReplay), sinkhorn routing (its own assignment), forced random load balancing, token
    dropping (an expert capacity drops replayed assignments), and quantile-style balancing options
    of newer releases. ``legacy`` (megatron-core 0.12-0.15, which has no replay flag) also
    refuses input jitter (noise on the router input), padding to capacity, 0.12's
    ``alltoall_seq`` dispatcher (its router sees rows gathered across tensor parallel ranks, not
    this rank's) and CUDA graphs (they would capture one micro-batch's experts).
    """
    problems = []
    if not legacy and not getattr(config, "moe_enable_routing_replay", False):
        problems.append("moe_enable_routing_replay is False (routers have no RouterReplay)")
    if legacy:
        if getattr(config, "moe_input_jitter_eps", None):
            problems.append(
                f"moe_input_jitter_eps={config.moe_input_jitter_eps} (noise on the router input)"
            )
        if getattr(config, "moe_pad_expert_input_to_capacity", False):
            problems.append("moe_pad_expert_input_to_capacity=True (capacity padding)")
        if getattr(config, "moe_token_dispatcher_type", None) == "alltoall_seq":
            problems.append(
                "moe_token_dispatcher_type='alltoall_seq' (the router sees rows gathered across "
                "tensor-parallel ranks; use 'alltoall' or 'allgather')"
            )
        for name in ("enable_cuda_graph", "external_cuda_graph"):
            if getattr(config, name, False):
                problems.append(f"{name}=True (a captured graph replays one batch's experts)")
    if getattr(config, "moe_router_fusion", False):
        problems.append("moe_router_fusion=True (the fused top-k kernel bypasses replay)")
    lb = getattr(config, "moe_router_load_balancing_type", None)
    lbs = lb if isinstance(lb, list | tuple) else [lb]
    for t in lbs:
        if isinstance(t, str) and (t == "sinkhorn" or "quantile" in t):
            problems.append(
                f"moe_router_load_balancing_type={t!r} (this routing computes its own assignment "
                "and ignores replay)"
            )
    if getattr(config, "moe_router_force_load_balancing", False):
        problems.append("moe_router_force_load_balancing=True (random logits)")
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        problems.append(
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} "
            "(token dropping discards replayed assignments)"
        )
    for name in dir(config):
        if "quantile" in name and not name.startswith("_") and getattr(config, name, None):
            problems.append(
                f"{name}={getattr(config, name)!r} (quantile balancing bypasses replay)"
            )
    if problems:
        raise ReplayConfigError("routing replay cannot be exact with: " + "; ".join(problems))


@dataclass(frozen=True)
class RouterSlot:
    """One router of this rank.

    Attributes:
        layer_number: Megatron's global 1-based layer number (pipeline offset included).
        router: the ``TopKRouter`` module.
        replay: its ``RouterReplay`` (or ``LegacyRouterReplay`` on megatron-core 0.12-0.15).
        top_k, num_experts: its routing shape.
        name: module path, for messages.
        chunk: index of the (virtual pipeline) model chunk holding it.
    """

    layer_number: int
    router: torch.nn.Module
    replay: ReplayState
    top_k: int
    num_experts: int
    name: str
    chunk: int = 0

    @property
    def layer(self) -> int:
        """Global 0-based layer index, the records' ``moe_layers`` numbering."""
        return self.layer_number - 1


def find_routers(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[RouterSlot]:
    """This rank's routers that carry a RouterReplay, sorted by global layer number.

    ``model`` is a module or the list of VPP model chunks; wrappers (DDP, Float16Module) are
    walked through. Raises :class:`RouteLayerMismatchError` if a router lacks a layer number or
    two routers share one.
    """
    chunks = list(model) if isinstance(model, Sequence) else [model]
    seen: set[int] = set()
    slots: list[RouterSlot] = []
    for ci, chunk in enumerate(chunks):
        for name, mod in chunk.named_modules():
            rr = getattr(mod, "router_replay", None)
            if not isinstance(rr, _STATES) or id(mod) in seen:
                continue
            seen.add(id(mod))
            ln = getattr(mod, "layer_number", None)
            if ln is None:
                raise RouteLayerMismatchError(f"router {name} (chunk {ci}) has no layer_number")
            slots.append(
                RouterSlot(
                    int(ln),
                    mod,
                    rr,
                    int(mod.topk),
                    int(mod.config.num_moe_experts),
                    f"chunk{ci}.{name}" if len(chunks) > 1 else name,
                    ci,
                )
            )
    slots.sort(key=lambda s: s.layer_number)
    nums = [s.layer_number for s in slots]
    if len(set(nums)) != len(nums):
        raise RouteLayerMismatchError(f"routers share layer numbers: {nums}")
    return slots


def attach_legacy_replay(model: torch.nn.Module | Sequence[torch.nn.Module]) -> int:
    """Give every ``TopKRouter`` of ``model`` (a module or VPP chunks) a
    :class:`LegacyRouterReplay`, replacing a native ``RouterReplay`` if it has one, and make
    megatron-core's top-k selection consult it (:func:`._legacy.install`). Returns how many
    routers it attached to. Routers keep routing normally until an action is set."""
    from megatron.core.transformer.moe.router import TopKRouter

    _legacy.install()
    chunks = list(model) if isinstance(model, Sequence) else [model]
    n = 0
    for chunk in chunks:
        for mod in chunk.modules():
            if isinstance(mod, TopKRouter):
                if not isinstance(getattr(mod, "router_replay", None), LegacyRouterReplay):
                    mod.router_replay = LegacyRouterReplay()
                n += 1
    return n


def _rows_of(x: torch.Tensor) -> int:
    """Tokens a router input ``[S, B, H]`` (or ``[N, H]``) holds."""
    return int(x.numel() // x.shape[-1])


class RouterReplayer:
    """Installs replay targets into this rank's routers.

    A trainer's ``forward_step`` wraps its model call::

        replayer = RouterReplayer(model)               # once, after the model is built
        with replayer.step():                          # each optimizer step
            ...schedule calls forward_step per micro-batch...
        def forward_step(data_iter, model):
            batch = next(data_iter)                    # batch["replay_targets"]: ReplayTargets
            with replayer.micro_batch(batch["replay_targets"]):
                out = model(...)
            return out, loss_func

    ``targets`` rows must be what each router sees (see :class:`PositionMap.local`). Every router's
    input row count is checked against its target in a forward pre-hook, during forward and during
    recompute; a mismatch raises :class:`TargetShapeError` instead of leaving tokens unrouted.

    ``weights="engine"``: the router's output probs ``[N, E]`` take the engine's weights
    (:attr:`ReplayTargets.weights`, cast to the probs' dtype) at the replayed rows, exactly, with
    the gradient passed straight through to the router's own probs of the replayed experts;
    fillers and own-routing rows keep the router's probs. ``"ids"``: the router's probs gate the
    replayed experts.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        *,
        dtype: torch.dtype = torch.int64,
        check_config: bool = True,
        shadow: bool = False,
        path: Literal["auto", "native", "legacy"] = "auto",
        weights: Literal["ids", "engine"] = "ids",
    ) -> None:
        if weights not in ("ids", "engine"):
            raise ValueError(f"weights must be 'ids' or 'engine', not {weights!r}")
        self.weights = weights
        if path not in ("auto", "native", "legacy"):
            raise ValueError(f"path must be 'auto', 'native' or 'legacy', not {path!r}")
        if path == "native" and not NATIVE:
            raise ReplayConfigError(
                "this megatron-core has no RouterReplay (it arrived in 0.16): use path='auto'"
            )
        # auto: native where megatron-core has it, else the legacy path (0.12-0.15).
        self.legacy = path == "legacy" or (path == "auto" and not NATIVE)
        if self.legacy:
            attach_legacy_replay(model)
        self.slots = find_routers(model)
        if self.legacy:
            self.slots = [s for s in self.slots if isinstance(s.replay, LegacyRouterReplay)]
        if not self.slots:
            raise ReplayConfigError(
                "no MoE router found in the model"
                if self.legacy
                else "no router with RouterReplay found in the model: build it with "
                "moe_enable_routing_replay=True"
            )
        if check_config:
            check_replay_config(self.slots[0].router.config, legacy=self.legacy)
        if dtype not in (torch.int64, torch.int32):
            raise TargetShapeError(f"RouterReplay gathers need int64 or int32 targets, not {dtype}")
        self.dtype = dtype
        self._chunks = list(model) if isinstance(model, Sequence) else [model]
        self._hooks = [
            s.router.register_forward_pre_hook(self._make_check(s), with_kwargs=True)
            for s in self.slots
        ]
        if self.legacy:
            self._hooks += [
                s.router.register_forward_hook(self._make_served(s)) for s in self.slots
            ]
        # The target each router's top-k used in its current call (forward or recompute), for
        # the output hook that puts the engine's weights in place (weights="engine").
        self._in_use: dict[int, torch.Tensor | None] = {}
        if weights == "engine":
            self._hooks += [
                s.router.register_forward_hook(self._make_engine_probs(s)) for s in self.slots
            ]
        # Shadow diagnostics: in each replayed forward, also compute the experts the router
        # itself would choose, and count the (token, layer) decisions that differ. ``shadow``
        # may be switched off and on again (e.g. on some steps only).
        self.shadow = shadow
        self._shadow = ShadowCounts()
        self._shadow_valid: dict[int, torch.Tensor | None] = {}
        for s in self.slots:
            self._wrap_topk(s)

    # -- the router's own top-k: own_routing rows and shadow diagnostics -------------------------
    def _wrap_topk(self, slot: RouterSlot) -> None:
        rr = slot.replay
        original = rr.get_replay_topk  # the bound method; the wrapper shadows it on the instance

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default=None):  # type: ignore[no-untyped-def]
            act = _action(rr)
            target = _queued(rr, act)
            if self.weights == "engine":
                self._in_use[slot.layer] = target
            own_rows = getattr(target, _OWN_ROWS, None)
            probs, idx = original(scores, topk, num_groups, group_topk, default)
            shadow = self.shadow and act == "replay_forward"
            if own_rows is None and not shadow:
                return probs, idx
            if default is None:
                raise ReplayConfigError(
                    f"layer {slot.layer_number} ({slot.name}): the router's top-k function was "
                    "not given to the replay state; its own choice cannot be computed"
                )
            with torch.no_grad():
                _, own = default(scores.detach(), topk, num_groups=num_groups,
                                 group_topk=group_topk)  # fmt: skip
            if own_rows is not None:
                idx = torch.where(own_rows.unsqueeze(1), own.to(idx.dtype), idx)
                probs = scores.gather(1, idx)  # gradients reach the router at every row
                if act == "replay_forward":
                    _requeue(rr, target, idx)
            if shadow:
                self._shadow_count(slot, own, idx)
            return probs, idx

        rr.get_replay_topk = get_replay_topk

    def _shadow_count(self, slot: RouterSlot, own: torch.Tensor, replayed: torch.Tensor) -> None:
        """Accumulate [rows, token mismatches, slot mismatches] on the device (no host sync;
        a handful of small ops per layer)."""
        self._shadow.add(slot.layer, own, replayed, self._shadow_valid.get(slot.layer))

    def shadow_report(self, *, reset: bool = True) -> ShadowReport:
        """What the routers would have chosen without replay, since the last report (or
        :meth:`clear`): per layer, the share of tokens whose top-k set differs from the replayed
        one and the share of chosen experts that differ. Filler rows are not counted."""
        if not self.shadow:
            raise ReplayConfigError(
                "shadow diagnostics are off: RouterReplayer(model, shadow=True)"
            )
        return self._shadow.report(self.slots[0].top_k, reset=reset)

    # -- introspection ----------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        """Global 0-based MoE layer indices of this rank's routers (what to gather targets for)."""
        return tuple(s.layer for s in self.slots)

    @property
    def device(self) -> torch.device:
        return next(self.slots[0].router.parameters()).device

    # -- shape check during forward/recompute -----------------------------------------------------
    @staticmethod
    def _make_check(slot: RouterSlot):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            rr = slot.replay
            act = _action(rr)
            if act == "replay_forward":
                t = rr.target_topk_idx
                when = "forward"
            elif act == "replay_backward":
                if not torch.is_grad_enabled():
                    # Megatron recomputes under enable_grad; a no-grad forward here is an eval or
                    # logprob pass run after micro_batch() inside step(): it would pop (and
                    # misalign) the targets queued for recompute.
                    raise ReplayConfigError(
                        f"layer {slot.layer_number} ({slot.name}): a no-grad forward ran while "
                        "targets wait for recompute; run it outside RouterReplayer.step() or "
                        "inside its own micro_batch()/R2Recorder.record()"
                    )
                if not rr.replay_backward_list:
                    raise TargetShapeError(
                        f"layer {slot.layer_number} ({slot.name}): recompute found no queued "
                        "targets; was the micro-batch run outside RouterReplayer.micro_batch?"
                    )
                t = rr.replay_backward_list[0]
                when = "recompute"
            else:
                return
            if isinstance(rr, LegacyRouterReplay):
                rr.served = 0
            x = args[0] if args else kwargs.get("input", next(iter(kwargs.values()), None))
            n = _rows_of(x)
            if t is None or t.shape[0] != n:
                raise TargetShapeError(
                    f"layer {slot.layer_number} ({slot.name}) {when}: router sees {n} tokens "
                    f"but the replay target has {None if t is None else t.shape[0]} rows"
                )

        return hook

    def _make_engine_probs(self, slot: RouterSlot):
        """weights="engine": the router's output probs take the engine's weights at the
        replayed rows of the target its top-k just used (forward, or recompute's FIFO entry)."""

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
            target = self._in_use.pop(slot.layer, None)
            if target is None or not hasattr(target, _ENGINE_W):
                return None
            probs, routing_map = output[0], output[1]
            return (_engine_probs(probs, target), routing_map, *output[2:])

        return hook

    @staticmethod
    def _make_served(slot: RouterSlot):
        """Legacy path: after a replayed forward (or recompute), the router's top-k must have
        taken its experts from the replay state. Something that replaced ``TopKRouter.routing``
        or the top-k function before the replayer wrapped them (e.g. a vendor adaptor) and does
        not call the release's top-k would otherwise route on its own, silently."""

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            rr = slot.replay
            if _action(rr) in ("replay_forward", "replay_backward") and rr.served == 0:
                raise ReplayConfigError(
                    f"layer {slot.layer_number} ({slot.name}): the router ran without reaching "
                    "the replay hook (its routing or top-k was replaced by code that does not "
                    "call megatron-core's top-k function); replay is not applied"
                )
            rr.served = 0

        return hook

    # -- installing -------------------------------------------------------------------------------
    def slots_of(self, model: torch.nn.Module | None = None) -> list[RouterSlot]:
        """The routers of one model chunk (as passed to ``forward_step``), or all of them.

        With virtual pipeline, ``forward_step`` runs one chunk at a time: installing into the
        other chunks' routers too would queue extra entries in their recompute FIFOs.
        """
        if model is None:
            if len(self._chunks) > 1:
                # Installing into every chunk at each forward_step queues extra recompute
                # entries: recompute then replays another micro-batch's routes (measured).
                raise ReplayConfigError(
                    f"the model has {len(self._chunks)} virtual-pipeline chunks: pass the chunk "
                    "forward_step runs (micro_batch(targets, model=chunk))"
                )
            return self.slots
        for ci, chunk in enumerate(self._chunks):
            if chunk is model:
                return [s for s in self.slots if s.chunk == ci]
        ids = {id(m) for m in model.modules()}
        return [s for s in self.slots if id(s.router) in ids]

    def _per_layer(
        self, targets: TargetsLike, layers: Sequence[int] | None, slots: list[RouterSlot]
    ) -> list[torch.Tensor]:
        dev = self.device
        want = tuple(s.layer for s in slots)
        if isinstance(targets, ReplayTargets):
            if targets.order != "sequence":
                raise TargetShapeError(
                    f"targets are in {targets.order}-major row order; Megatron-Core's routers "
                    "see the rows sequence-major: gather_targets(..., order='sequence')"
                )
            if targets.num_experts != self.slots[0].num_experts:
                raise RouteLayerMismatchError(
                    f"targets are for {targets.num_experts} experts, the model has "
                    f"{self.slots[0].num_experts}"
                )
            sel = targets.select(want)
            per = list(sel.to_torch(dev, self.dtype).unbind(0))
            if targets.replay_mask is not None:
                own = torch.from_numpy(~targets.replay_mask).to(dev)
                for t in per:
                    setattr(t, _OWN_ROWS, own)
            if self.weights == "engine":
                self._attach_weights(sel, per)
            return per
        if self.weights == "engine":
            raise ReplayConfigError(
                "weights='engine' replays ReplayTargets carrying the engine's weights "
                "(gather_targets(..., weights=True)), not raw id tensors"
            )
        if isinstance(targets, Mapping):
            missing = sorted(set(want) - set(targets))
            if missing:
                raise RouteLayerMismatchError(
                    f"no targets for this rank's MoE layers {missing} (global 0-based); got "
                    f"{sorted(targets)}"
                )
            return [targets[x].to(dev, self.dtype) for x in want]
        if layers is None:
            layers = self.layers
        if targets.ndim != 3 or targets.shape[0] != len(layers):
            raise TargetShapeError(
                f"targets must be [M={len(layers)}, N, K], got {tuple(targets.shape)}"
            )
        idx = {x: i for i, x in enumerate(layers)}
        missing = sorted(set(want) - set(idx))
        if missing:
            raise RouteLayerMismatchError(
                f"no targets for this rank's MoE layers {missing}; got {list(layers)}"
            )
        t = targets.to(dev, self.dtype)
        return [t[idx[x]] for x in want]

    def _attach_weights(self, targets: ReplayTargets, per: list[torch.Tensor]) -> None:
        weights = targets.weights_torch(self.device)
        rows = torch.from_numpy(targets.replayed_rows()).to(self.device)
        for t, w in zip(per, weights.unbind(0), strict=True):
            setattr(t, _ENGINE_W, w)
            setattr(t, _ENGINE_ROWS, rows)

    def set_targets(
        self,
        targets: TargetsLike,
        *,
        layers: Sequence[int] | None = None,
        num_tokens: int | None = None,
        check_values: bool = True,
        model: torch.nn.Module | None = None,
    ) -> None:
        """Queue one micro-batch's targets into the routers of ``model`` (a VPP chunk; default
        all of this rank's), without changing their action.

        ``targets``: :class:`ReplayTargets` (compact, widened on the device), a ``[M, N, K]`` tensor
        whose layers are ``layers`` (default this rank's), or ``{layer: [N, K] tensor}``. Checks
        top-k, row count (all layers equal, and ``num_tokens`` if given) and the expert range.
        """
        slots = self.slots_of(model)
        if not slots:
            return  # a chunk without MoE layers
        per = self._per_layer(targets, layers, slots)
        n0 = per[0].shape[0]
        for s, t in zip(slots, per, strict=True):
            if t.ndim != 2 or t.shape[1] != s.top_k:
                raise TargetShapeError(
                    f"layer {s.layer_number} ({s.name}): target shape {tuple(t.shape)}, expected "
                    f"[tokens, top_k={s.top_k}]"
                )
            if t.shape[0] != n0 or (num_tokens is not None and t.shape[0] != num_tokens):
                raise TargetShapeError(
                    f"layer {s.layer_number} ({s.name}): target has {t.shape[0]} rows, expected "
                    f"{num_tokens if num_tokens is not None else n0}"
                )
        if check_values and not isinstance(targets, ReplayTargets):
            # ReplayTargets are in range by construction; raw tensors are checked (one sync).
            allt = torch.stack(per)
            lo, hi = int(allt.min()), int(allt.max())
            if lo < 0 or hi >= self.slots[0].num_experts:
                raise TargetShapeError(
                    f"target expert ids span [{lo}, {hi}], expected [0, "
                    f"{self.slots[0].num_experts})"
                )
        for s, t in zip(slots, per, strict=True):
            s.replay.set_target_indices(t)

    def set_action(
        self, action: RouterReplayAction | None, *, model: torch.nn.Module | None = None
    ) -> None:
        """Set (``None``: clear) the replay action of ``model``'s routers (default all)."""
        for s in self.slots_of(model):
            if action is None:
                s.replay.clear_router_replay_action()
            else:
                s.replay.set_router_replay_action(action)

    @contextmanager
    def micro_batch(
        self, targets: TargetsLike, *, model: torch.nn.Module | None = None, **kwargs: Any
    ) -> Iterator[None]:
        """Replay ``targets`` for the forward inside the block; afterwards switch to
        REPLAY_BACKWARD so recompute in the (later) backward pops them in FIFO order.

        ``model``: the chunk ``forward_step`` was called with (required with virtual pipeline,
        where each call runs one chunk); ``targets`` may cover more layers than it holds.
        Rows that :attr:`ReplayTargets.replay_mask` marks False take the router's own top-k of
        the forward's scores; recompute repeats the experts the forward chose there.
        """
        self.set_targets(targets, model=model, **kwargs)
        if self.shadow:
            valid = getattr(targets, "valid", None)
            replay = getattr(targets, "replay_mask", None)
            if valid is not None and replay is not None:
                valid = valid & replay  # the router's own rows agree with themselves
            mask = None if valid is None else torch.from_numpy(valid).to(self.device)
            for s in self.slots_of(model):
                self._shadow_valid[s.layer] = mask
        self.set_action(RouterReplayAction.REPLAY_FORWARD, model=model)
        try:
            yield
        finally:
            self.set_action(RouterReplayAction.REPLAY_BACKWARD, model=model)

    def clear(self) -> None:
        """Drop all queued targets, recorded indices and actions (routers route normally)."""
        for s in self.slots:
            s.replay.clear_indices()
            s.replay.clear_router_replay_action()
        self._shadow_valid.clear()
        self._in_use.clear()

    @contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step: cleared on entry and exit (also on error), so targets never leak
        into the next step or into an eval forward."""
        self.clear()
        try:
            yield
        finally:
            self.clear()

    def remove(self) -> None:
        """Remove the shape-check hooks and shadow wrappers, and clear."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for s in self.slots:
            s.replay.__dict__.pop("get_replay_topk", None)
        self.clear()


def _compact_dtype(num_experts: int) -> torch.dtype:
    return (
        torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32768 else torch.int32
    )


class R2Recorder:
    """R2 (router replay without a service): record the routes of the old-logprob pass, replay
    them in the update passes.

    ::

        r2 = R2Recorder(replayer)
        for i, mb in enumerate(micro_batches):         # old-logprob pass (no grad)
            with r2.record(i):                         # with VPP: r2.record(i, model=chunk)
                model(...)
        with replayer.step():
            for i, mb in enumerate(micro_batches):     # update
                with r2.replay(i):                     # with VPP: r2.replay(i, model=chunk)
                    model(...)
        r2.clear()
    """

    def __init__(self, replayer: RouterReplayer) -> None:
        self.replayer = replayer
        self._recorded: dict[tuple[Any, int | None], tuple[tuple[int, ...], torch.Tensor]] = {}

    def _key(self, key: Any, model: torch.nn.Module | None) -> tuple[Any, int | None]:
        if model is None:
            return (key, None)
        slots = self.replayer.slots_of(model)
        return (key, slots[0].chunk if slots else -1)

    @contextmanager
    def record(self, key: Any, *, model: torch.nn.Module | None = None) -> Iterator[None]:
        """Record the routes of ``model``'s routers (default all) in the forward inside the
        block, under ``key``."""
        rp = self.replayer
        slots = rp.slots_of(model)
        rp.set_action(RouterReplayAction.RECORD, model=model)
        for s in slots:
            s.replay.recorded_topk_idx = None
        try:
            yield
        finally:
            rp.set_action(None, model=model)
        rows = []
        for s in slots:
            t = s.replay.get_recorded_indices()
            if t is None:
                raise TargetShapeError(f"layer {s.layer_number} ({s.name}) recorded nothing")
            # Compact on the device: 1-2 bytes per id instead of 8 until the replay.
            rows.append(t.detach().to(_compact_dtype(s.num_experts)))
        if rows:
            layers = tuple(s.layer for s in slots)
            self._recorded[self._key(key, model)] = (layers, torch.stack(rows))

    def recorded(self, key: Any, *, model: torch.nn.Module | None = None) -> torch.Tensor:
        """``[M, N, K]`` compact (uint8/int16) routes recorded under ``key``; layers are the
        recorded routers' (``replayer.layers`` when no chunk was given)."""
        return self._recorded[self._key(key, model)][1]

    @contextmanager
    def replay(self, key: Any, *, model: torch.nn.Module | None = None) -> Iterator[None]:
        """Replay what :meth:`record` captured under ``key`` (same ``model`` chunk)."""
        k = self._key(key, model)
        if k not in self._recorded and not self.replayer.slots_of(model):
            yield  # a chunk without MoE layers
            return
        layers, t = self._recorded[k]
        with self.replayer.micro_batch(t, layers=layers, model=model, check_values=False):
            yield

    def clear(self) -> None:
        self._recorded.clear()
