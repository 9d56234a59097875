"""Routing replay for Hugging Face transformers MoE models (FSDP2, activation checkpointing,
gradient accumulation).

In transformers 5 every supported MoE block calls a router module that returns
``(router_logits [N, E], weights [N, K], indices [N, K])`` and hands the weights and indices to
its experts. :class:`HFRouterReplayer` puts a forward hook on each router: at the replayed rows
the indices become the engine's, and the weights are the model's own routing function evaluated
at those experts (its score function, top-k normalisation and scaling, computed from the
router's own logits, so the router still learns). ``weights="engine"`` takes the engine's
weights instead, with the gradient passed straight through to the router's own (the same form
as :class:`~routereplay.trainer_adapter.RouterReplayer`'s). Rows without a route (padding, a
token the trainer appended, a sample a :class:`ReplayPolicy` hands to the trainer's router)
keep the router's own choice.

Each supported router's weight function is checked against the router's own output on its
first call (the router's own experts through the replay function must give its own weights bit
for bit), so a transformers release whose router computes differently is refused, not replayed
wrongly.

    replayer = HFRouterReplayer(model)                 # after from_pretrained, before or after
    targets = gather_targets(pmap, records, replayer.layers, order="batch")   # fully_shard
    with replayer.micro_batch(targets):  # the backward inside: recompute replays
        loss = model(input_ids, ...).loss
        loss.backward()
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ._replay_common import ShadowCounts, ShadowReport, _EngineProbs
from ._targets import ReplayTargets
from .errors import ReplayConfigError, RouteLayerMismatchError, TargetShapeError

__all__ = [
    "MIN_TRANSFORMERS",
    "SUPPORTED_MODEL_TYPES",
    "HFRouter",
    "HFRouterReplayer",
    "find_hf_routers",
    "packed_inputs",
]

WeightFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _softmax_topk(router: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """Qwen3-MoE, Qwen2-MoE, OLMoE: softmax over all experts in float32, the chosen experts'
    probabilities, renormalised if ``norm_topk_prob``, cast back to the logits' dtype."""
    w = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, idx)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def _mixtral(router: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """Mixtral: softmax in float32, the chosen experts' probabilities renormalised (float32)."""
    w = torch.softmax(logits.float(), dim=-1).gather(1, idx)
    return w / w.sum(dim=-1, keepdim=True)


def _deepseek_v3(router: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """DeepSeek-V3: sigmoid scores (the correction bias picks experts, it does not weigh them),
    renormalised if ``norm_topk_prob``, times ``routed_scaling_factor``."""
    w = logits.sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def _gpt_oss(router: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """gpt-oss: softmax over the chosen experts' logits, in the logits' dtype."""
    top = logits.gather(1, idx)
    return torch.softmax(top, dim=1, dtype=top.dtype)


# model_type -> (router class name, its weight function)
_FAMILIES: dict[str, tuple[str, WeightFn]] = {
    "qwen3_moe": ("Qwen3MoeTopKRouter", _softmax_topk),
    "qwen2_moe": ("Qwen2MoeTopKRouter", _softmax_topk),
    "olmoe": ("OlmoeTopKRouter", _softmax_topk),
    "mixtral": ("MixtralTopKRouter", _mixtral),
    "deepseek_v3": ("DeepseekV3TopkRouter", _deepseek_v3),
    "gpt_oss": ("GptOssTopKRouter", _gpt_oss),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES)
# The oldest release whose routers all return (logits, weights, indices) from raw logits: before
# 5.6 the Qwen/OLMoE/Mixtral routers return probabilities as their first output, before 5.13
# DeepSeek-V3's returns its logits alone. Older releases are refused, never replayed wrongly.
MIN_TRANSFORMERS = "5.13"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class HFRouter:
    """One MoE router of a transformers model: global 0-based decoder layer, the module and its
    model family's weight function."""

    layer: int
    name: str
    module: torch.nn.Module
    weight_fn: WeightFn
    top_k: int
    num_experts: int


def _model_type(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise ReplayConfigError(
            f"routing replay does not support {type(model).__name__} (model_type "
            f"{model_type!r}); supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return str(model_type)


def _other_layout(what: str) -> ReplayConfigError:
    import transformers

    return ReplayConfigError(
        f"{what}: transformers {transformers.__version__} lays its MoE routers out differently "
        f"from the one routing replay knows (transformers >= {MIN_TRANSFORMERS}: a router module "
        "that returns (logits, weights, indices))"
    )


def find_hf_routers(model: torch.nn.Module) -> list[HFRouter]:
    """The model's MoE routers by global decoder layer, ascending. Refuses a model type it does
    not support, and a supported one whose routers it cannot find (another transformers layout)."""
    router_cls, fn = _FAMILIES[_model_type(model)]
    found: list[HFRouter] = []
    for name, mod in model.named_modules():
        if type(mod).__name__ != router_cls:
            continue
        m = _LAYER.search(name)
        if m is None:
            raise ReplayConfigError(f"router {name!r} is not under a decoder layer (layers.<i>.)")
        if not all(hasattr(mod, a) for a in ("top_k", "num_experts", "weight")):
            raise _other_layout(f"{router_cls} has no top_k, num_experts or weight")
        found.append(HFRouter(int(m.group(1)), name, mod, fn, int(mod.top_k),
                              int(mod.num_experts)))  # fmt: skip
    if not found:
        raise _other_layout(f"no {router_cls} in {type(model).__name__}")
    found.sort(key=lambda r: r.layer)
    return found


def _batch_major(a: np.ndarray, batch_size: int, axis: int) -> np.ndarray:
    """Rows in sequence-major order (``s * B + b``, as :func:`gather_targets` writes them) to the
    batch-major order (``b * S + s``) in which a transformers router sees ``[B, S]`` tokens."""
    if batch_size == 1:
        return a
    n = a.shape[axis]
    if n % batch_size:
        raise TargetShapeError(f"{n} target rows are not a multiple of batch_size={batch_size}")
    shape = (*a.shape[:axis], n // batch_size, batch_size, *a.shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(a.reshape(shape), axis, axis + 1)).reshape(a.shape)


@dataclass
class _Installed:
    """One router's targets for the current micro-batch, on its device."""

    experts: torch.Tensor  # [N, K] int64
    replay: torch.Tensor  # [N] bool: rows that take the engine's experts
    engine: torch.Tensor | None  # [N, K] float32 engine weights (weights="engine")
    calls: int = 0

    def move_to(self, device: torch.device) -> None:
        self.experts = self.experts.to(device)
        self.replay = self.replay.to(device)
        if self.engine is not None:
            self.engine = self.engine.to(device)


class HFRouterReplayer:
    """Replays stored routes into a transformers MoE model's routers.

    Args:
        model: a transformers model of a supported type (:data:`SUPPORTED_MODEL_TYPES`), plain
            or under FSDP2 (``fully_shard``), with or without gradient checkpointing.
        weights: ``"ids"``: the replayed experts are weighted by the model's own routing
            function at those experts; ``"engine"``: by the engine's weights
            (``gather_targets(..., weights=True)``), gradient straight through to the router's.
        shadow: count where each router's own top-k differs from the replayed experts
            (:meth:`shadow_report`).

    Every router call must come inside :meth:`micro_batch`, which also checks, on the way out,
    that every router consumed its targets: a forward that skipped them (a fused MoE kernel from
    the Hub, a router the compiler removed) raises instead of training on the trainer's own
    routing. Under ``torch.compile`` the hooks run eagerly between the compiled graphs
    (``torch.compiler.disable``), so replay holds there too, at the cost of a graph break per
    router.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        weights: Literal["ids", "engine"] = "ids",
        shadow: bool = False,
    ) -> None:
        if weights not in ("ids", "engine"):
            raise ValueError(f"weights must be 'ids' or 'engine', not {weights!r}")
        self.weights = weights
        self.shadow = shadow
        self.routers = find_hf_routers(model)
        self._installed: dict[int, _Installed] | None = None
        self._checked: set[int] = set()
        self._shadow = ShadowCounts()
        self._hooks = [r.module.register_forward_hook(self._hook(r)) for r in self.routers]

    @property
    def layers(self) -> tuple[int, ...]:
        """Global 0-based MoE layer indices of the routers (what to gather targets for)."""
        return tuple(r.layer for r in self.routers)

    @contextmanager
    def micro_batch(
        self, targets: ReplayTargets, *, batch_size: int | None = None
    ) -> Iterator[None]:
        """Replay ``targets`` (:func:`gather_targets` of this micro-batch's ``[B, S]`` position
        map) in every router call inside the block: the forward, and the recompute of activation
        checkpointing when the backward runs inside it too.

        The row order comes from the targets (:attr:`ReplayTargets.batch_shape`, ``order``):
        ``gather_targets(..., order="batch")`` writes the rows as a transformers router sees
        them. ``batch_size`` is needed only for targets that carry no batch shape (built by
        hand); given with targets that do, it must be their ``B``."""
        if self._installed is not None:
            raise ReplayConfigError("micro_batch blocks do not nest")
        self._installed = self._install(targets, batch_size)
        try:
            yield
        except BaseException:
            self._installed = None
            raise
        installed, self._installed = self._installed, None
        skipped = [layer for layer, t in installed.items() if t.calls == 0]
        if skipped:
            raise ReplayConfigError(
                f"the routers of layers {skipped} never ran inside micro_batch: the forward "
                "bypassed them (torch.compile, a fused MoE kernel), so it trained on its own "
                "routing"
            )

    @staticmethod
    def _sequence_batch(targets: ReplayTargets, batch_size: int | None) -> int:
        """How many sequences interleave in sequence-major rows (1 when already batch-major)."""
        shape = targets.batch_shape
        if shape is None:
            if batch_size is None:
                raise ReplayConfigError(
                    "these targets carry no batch shape (built by hand): pass "
                    "micro_batch(targets, batch_size=B), or gather them with gather_targets"
                )
            return batch_size
        if batch_size is not None and batch_size != shape[0]:
            raise TargetShapeError(
                f"batch_size={batch_size}, but the targets were gathered for a [B={shape[0]}, "
                f"S={shape[1]}] batch"
            )
        return 1 if targets.order == "batch" else shape[0]

    def _install(self, targets: ReplayTargets, batch_size: int | None) -> dict[int, _Installed]:
        if not isinstance(targets, ReplayTargets):
            raise ReplayConfigError(
                f"micro_batch takes ReplayTargets, not {type(targets).__name__}"
            )
        if tuple(targets.layers) != self.layers:
            raise RouteLayerMismatchError(
                f"targets are for MoE layers {list(targets.layers)}, the model's routers are at "
                f"{list(self.layers)}"
            )
        B = self._sequence_batch(targets, batch_size)
        engine = None
        if self.weights == "engine":
            engine = _batch_major(targets.engine_weights(), B, 1)
        experts = _batch_major(targets.experts, B, 1)
        replay = _batch_major(targets.replayed_rows(), B, 0)
        out: dict[int, _Installed] = {}
        for k, r in enumerate(self.routers):
            dev = r.module.weight.device
            out[r.layer] = _Installed(
                torch.from_numpy(experts[k]).to(dev, torch.int64),
                torch.from_numpy(replay).to(dev),
                None if engine is None else torch.from_numpy(engine[k]).to(dev),
            )
        return out

    def _hook(self, r: HFRouter) -> Callable[..., Any]:
        # Never traced into a compiled graph: the targets change every micro-batch, and the
        # checks below must run each time. Under torch.compile the graph breaks here.
        @torch.compiler.disable
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
            if self._installed is None:
                raise ReplayConfigError(
                    f"router of layer {r.layer} ran outside micro_batch (a forward without "
                    "targets, or a recompute after the block closed: run the backward inside it)"
                )
            return self._replace(r, self._installed[r.layer], output)

        return hook

    def _replace(self, r: HFRouter, t: _Installed, output: Any) -> Any:
        if not isinstance(output, tuple) or len(output) < 3:
            raise _other_layout(f"{type(r.module).__name__} does not return a 3-tuple")
        logits, own_w, own_idx = output[0], output[1], output[2]
        if logits.shape[0] != t.experts.shape[0]:
            raise TargetShapeError(
                f"layer {r.layer}: the router sees {logits.shape[0]} rows, the targets have "
                f"{t.experts.shape[0]} (batch_size must be the batch's B)"
            )
        if t.experts.device != logits.device:
            # The router's weight lives elsewhere than its activations (FSDP2 CPU offload):
            # the targets follow the activations, once per micro-batch.
            t.move_to(logits.device)
        t.calls += 1
        if r.layer not in self._checked:
            self._check_weight_fn(r, logits, own_w, own_idx)
        idx = torch.where(t.replay.unsqueeze(1), t.experts, own_idx.to(torch.int64))
        w = r.weight_fn(r.module, logits, idx)
        if t.engine is not None:
            w = _EngineProbs.apply(w, t.engine.to(w.dtype), t.replay)
        if self.shadow and t.calls == 1:  # not again in activation checkpointing's recompute
            self._shadow.add(r.layer, own_idx, t.experts, t.replay)
        return (logits, w, idx.to(own_idx.dtype), *output[3:])

    def _check_weight_fn(
        self, r: HFRouter, logits: torch.Tensor, own_w: torch.Tensor, own_idx: torch.Tensor
    ) -> None:
        with torch.no_grad():
            mine = r.weight_fn(r.module, logits, own_idx.to(torch.int64))
        # Equal up to a rounding or two (a compiled router fuses the same arithmetic); another
        # routing function differs by far more.
        eps = torch.finfo(own_w.dtype).eps
        if mine.dtype != own_w.dtype or not torch.allclose(mine, own_w, rtol=4 * eps, atol=eps):
            import transformers

            raise ReplayConfigError(
                f"{type(r.module).__name__} of transformers {transformers.__version__} computes "
                "its routing weights differently from what routing replay reproduces: replaying "
                "would change the model's weights, so it is refused (transformers >= "
                f"{MIN_TRANSFORMERS} is supported)"
            )
        self._checked.add(r.layer)

    def shadow_report(self, *, reset: bool = True) -> ShadowReport:
        """Per layer, where the routers' own top-k differed from the replayed experts since the
        last report (rows that do not replay are not counted)."""
        if not self.shadow:
            raise ReplayConfigError("shadow diagnostics are off: HFRouterReplayer(shadow=True)")
        return self._shadow.report(self.routers[0].top_k, reset=reset)

    def remove(self) -> None:
        """Take the hooks off: the model routes on its own again."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def packed_inputs(
    sequences: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A position-id pack of ``sequences`` for a transformers forward: ``input_ids`` and
    ``position_ids`` ``[1, T]`` (positions restart at each sequence, as TRL and verl pack) and a
    4-D additive ``attention_mask`` ``[1, 1, T, T]`` (causal within each sequence, nothing across
    them), for attention implementations that do not derive it from the position ids."""
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)[None]
    pos = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    seq = torch.cat([torch.full((len(s),), i) for i, s in enumerate(sequences)])
    T = int(seq.numel())
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.zeros(T, T, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return ids, pos, mask[None, None]
