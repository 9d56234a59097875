"""Router replay for megatron-core releases without ``RouterReplay`` (0.12 to 0.15).

megatron-core 0.16 added ``transformer/moe/router_replay.py`` and threads a ``RouterReplay`` into
the top-k selection of ``TopKRouter``. Older releases select top-k in a closure inside one
function of ``moe_utils`` (``topk_softmax_with_capacity`` in 0.12/0.13, which also returns the
tokens per expert; ``topk_routing_with_score_function`` in 0.14/0.15), which ``router.py``
imports by name. This module gives those releases the same mechanism:

- :class:`LegacyRouterReplay`: per-router replay state with the semantics (and the attribute and
  method names) of 0.16's ``RouterReplay``, so :class:`~._megatron.RouterReplayer` drives both the
  same way: targets, the forward action, a FIFO that activation recompute pops in order.
- :func:`install`: replaces the top-k function *in router.py's namespace* (patching ``moe_utils``
  alone would not reach the router) with one that, while a replay action is set on the calling
  router, takes the experts from the replay state and computes the gates from the router's own
  scores at those experts (gradients flow into the router through them); with no action it calls
  the original unchanged. ``TopKRouter.routing`` is wrapped to say which router is calling: the
  top-k function is not given the router.

Nothing here touches a device API: tensors stay where the router's logits are.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from .errors import ReplayConfigError

__all__ = ["LegacyRouterReplay", "ReplayAction", "install", "is_installed", "topk_function_name"]

# The router whose routing() is running (set by the TopKRouter.routing wrapper).
_ACTIVE: contextvars.ContextVar[LegacyRouterReplay | None] = contextvars.ContextVar(
    "routereplay_active_router_replay", default=None
)
_MARK = "_routereplay_legacy_replay"
_TOPK_NAMES = ("topk_routing_with_score_function", "topk_softmax_with_capacity")

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class ReplayAction(enum.Enum):
    """What a router does with its replay state (0.16's ``RouterReplayAction``)."""

    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


class LegacyRouterReplay:
    """One router's replay state (the interface of 0.16's ``RouterReplay``, no global registry).

    ``set_target_indices`` makes ``t`` the forward target and queues it for the recompute that
    backward may run; REPLAY_FORWARD uses the target, REPLAY_BACKWARD pops the queue's head,
    RECORD keeps the router's own choice.
    """

    def __init__(self) -> None:
        self.target_topk_idx: torch.Tensor | None = None
        self.recorded_topk_idx: torch.Tensor | None = None
        self.router_replay_action: ReplayAction | None = None
        self.replay_backward_list: list[torch.Tensor] = []
        # Replayed selections served since the router's forward began (RouterReplayer checks it
        # after each replayed forward: a patched routing that never reaches the hook is an error).
        self.served = 0

    def set_target_indices(self, topk_indices: torch.Tensor) -> None:
        self.target_topk_idx = topk_indices
        self.replay_backward_list.append(topk_indices)

    def get_recorded_indices(self) -> torch.Tensor | None:
        return self.recorded_topk_idx

    def record_indices(self, topk_indices: torch.Tensor) -> None:
        self.recorded_topk_idx = topk_indices

    def clear_indices(self) -> None:
        self.recorded_topk_idx = None
        self.target_topk_idx = None
        self.replay_backward_list = []

    def set_router_replay_action(self, action: enum.Enum) -> None:
        # Either enum (this one or 0.16's RouterReplayAction): the same values.
        self.router_replay_action = ReplayAction(action.value)

    def clear_router_replay_action(self) -> None:
        self.router_replay_action = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores at the chosen experts, the chosen experts)`` for this call's action."""
        action = self.router_replay_action
        if action == ReplayAction.RECORD:
            assert default_compute_topk is not None
            values, idx = default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk
            )
            self.record_indices(idx)
            return values, idx
        if action == ReplayAction.REPLAY_FORWARD:
            idx = self.target_topk_idx
            if idx is None:
                raise ReplayConfigError("REPLAY_FORWARD with no target indices set")
        elif action == ReplayAction.REPLAY_BACKWARD:
            if not self.replay_backward_list:
                raise ReplayConfigError("REPLAY_BACKWARD with no queued target indices")
            idx = self.replay_backward_list.pop(0)
        else:
            assert default_compute_topk is not None
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.served += 1
        idx = idx.to(scores.device)
        return scores.gather(1, idx), idx


def topk_function_name(router_module: Any) -> str:
    """The top-k function ``router.py`` of this release calls."""
    for name in _TOPK_NAMES:
        if callable(getattr(router_module, name, None)):
            return name
    raise ReplayConfigError(
        "this megatron-core's router.py calls neither topk_routing_with_score_function nor "
        "topk_softmax_with_capacity: replay supports megatron-core 0.12 to 0.15 here, and 0.16+ "
        "natively"
    )


def _replaying_topk(original: Callable[..., Any], moe_utils: Any) -> Callable[..., Any]:
    """``original`` (the release's top-k function), replaying while a router action is set."""
    sig = inspect.signature(original)
    returns_counts = "capacity_factor" in sig.parameters  # 0.12/0.13: (probs, map, counts)

    @functools.wraps(original)
    def topk(logits: torch.Tensor, topk: int, *args: Any, **kwargs: Any) -> Any:
        rr = _ACTIVE.get()
        if rr is None or rr.router_replay_action is None:
            return original(logits, topk, *args, **kwargs)
        a = sig.bind(logits, topk, *args, **kwargs)
        a.apply_defaults()
        p = a.arguments
        if p.get("fused"):
            raise ReplayConfigError("moe_router_fusion=True: the fused top-k kernel cannot replay")
        if p.get("capacity_factor") is not None:
            raise ReplayConfigError(
                "moe_expert_capacity_factor is set: token dropping discards replayed experts"
            )
        num_tokens, num_experts = logits.shape

        def own_topk(scores: torch.Tensor, k: int, num_groups: Any = None, group_topk: Any = None):  # type: ignore[no-untyped-def]
            # The router's own choice (RECORD and shadow diagnostics), as the release computes it.
            if group_topk:
                return moe_utils.group_limited_topk(
                    scores=scores, topk=k, num_tokens=num_tokens, num_experts=num_experts,
                    num_groups=num_groups, group_topk=group_topk,
                )  # fmt: skip
            return torch.topk(scores, k=k, dim=1)

        def choose(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return rr.get_replay_topk(scores, topk, p["num_groups"], p["group_topk"], own_topk)

        # The release's gate arithmetic, at the chosen experts (the same ops in the same order,
        # so replaying the router's own choice reproduces its outputs bit for bit).
        score_function = p["score_function"]
        if score_function == "softmax":
            if p["use_pre_softmax"]:
                scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
                probs, idx = choose(scores)
            else:
                chosen, idx = choose(logits)
                probs = torch.softmax(chosen, dim=-1, dtype=torch.float32).type_as(logits)
        elif score_function == "sigmoid":
            scores = torch.sigmoid(logits.float()).type_as(logits)
            if p["expert_bias"] is not None:
                _, idx = choose(scores + p["expert_bias"])
                chosen = torch.gather(scores, dim=1, index=idx).type_as(logits)
            else:
                chosen, idx = choose(scores)
            probs = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else chosen
        else:
            raise ValueError(f"Invalid score_function: {score_function}")
        if p["scaling_factor"]:
            probs = probs * p["scaling_factor"]
        routing_probs = torch.zeros_like(logits).scatter(1, idx, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, idx, 1).bool()
        if returns_counts:
            return routing_probs, routing_map, routing_map.sum(dim=0)
        return routing_probs, routing_map

    topk.__routereplay_original__ = original  # type: ignore[attr-defined]
    return topk


def _routing_with_active_replay(routing: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(routing)
    def wrapper(self: Any, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        token = _ACTIVE.set(getattr(self, "router_replay", None))
        try:
            return routing(self, logits, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    wrapper.__routereplay_original__ = routing  # type: ignore[attr-defined]
    return wrapper


def is_installed() -> bool:
    from megatron.core.transformer.moe import router

    return bool(getattr(router, _MARK, False))


def install() -> str:
    """Make this process's megatron-core (0.12-0.15) replay through :class:`LegacyRouterReplay`
    (idempotent). Returns the name of the top-k function it wraps. Routers route as before until
    one has a ``router_replay`` with an action set."""
    from megatron.core.transformer.moe import moe_utils, router

    name = topk_function_name(router)
    if getattr(router, _MARK, False):
        return name
    setattr(router, name, _replaying_topk(getattr(router, name), moe_utils))
    router.TopKRouter.routing = _routing_with_active_replay(router.TopKRouter.routing)
    setattr(router, _MARK, True)
    return name


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    from megatron.core.transformer.moe import router

    if not getattr(router, _MARK, False):
        return
    name = topk_function_name(router)
    setattr(router, name, getattr(router, name).__routereplay_original__)
    router.TopKRouter.routing = router.TopKRouter.routing.__routereplay_original__
    setattr(router, _MARK, False)
