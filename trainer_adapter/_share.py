"""One preparation per tensor-parallel group.

The ranks of a TP group route the same tokens: without sequence parallel every rank needs the
same targets, with it each rank a contiguous slice of the same sequence-major rows. Each rank
fetching and decoding the step's records repeats the costliest host work TP times on a host.
:func:`share_targets` runs the preparation on one rank of the group and hands every rank its
targets: the whole rows by broadcast, or with ``sequence_parallel`` each rank's slice by scatter
(a rank receives only the rows its routers see).

The group is a ``torch.distributed`` group whose backend moves host tensors (gloo): for a TP
group on NCCL, a gloo group of the same ranks, ``torch.distributed.new_group(ranks,
backend="gloo")``, made once beside it. The transfer is a collective: every rank of the group
calls it for every step, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ._targets import ReplayTargets
from .errors import TargetShapeError

if TYPE_CHECKING:
    import torch

__all__ = ["TargetShareError", "share_targets", "sp_slice"]

# What ``prepare`` returns: the targets, or the targets and a small object every rank needs.
Prepared = TypeVar("Prepared", ReplayTargets, tuple[ReplayTargets, Any])

# The arrays of a ReplayTargets that travel, besides the experts (each [..., N, ...] along rows).
_OPTIONAL = ("valid", "replay_mask", "weights")


class TargetShareError(RuntimeError):
    """The group's preparing rank failed; every other rank of the group raises this, with its
    message, instead of waiting for targets that will not come."""


def sp_slice(targets: ReplayTargets, tp_size: int, tp_rank: int) -> ReplayTargets:
    """The rows tensor-parallel rank ``tp_rank`` routes under sequence parallel: the contiguous
    ``N / tp_size`` rows of sequence-major targets (what :meth:`PositionMap.sp_shard` maps),
    copied, so they do not keep the whole group's rows alive."""
    if tp_size == 1:
        return targets
    n = targets.num_tokens
    if targets.order != "sequence" or n % tp_size:
        raise TargetShapeError(
            f"a sequence-parallel slice needs sequence-major rows divisible by TP={tp_size}; "
            f"got {n} rows in {targets.order!r} order"
        )
    lo, hi = tp_rank * n // tp_size, (tp_rank + 1) * n // tp_size
    return _rows(targets, lo, hi, tp_size)


def _rows(t: ReplayTargets, lo: int, hi: int, tp_size: int) -> ReplayTargets:
    valid = None if t.valid is None else t.valid[lo:hi].copy()
    bs = t.batch_shape
    return ReplayTargets(
        t.layers, np.ascontiguousarray(t.experts[:, lo:hi]), t.num_experts,
        filler_rows=0 if valid is None else int((~valid).sum()), valid=valid,
        replay_mask=None if t.replay_mask is None else t.replay_mask[lo:hi].copy(),
        weights=None if t.weights is None else np.ascontiguousarray(t.weights[:, lo:hi]),
        batch_shape=None if bs is None else (bs[0], bs[1] // tp_size), order=t.order,
    )  # fmt: skip


@dataclass(frozen=True)
class _Header:
    """What the preparing rank announces before the arrays travel (pickled by
    ``broadcast_object_list``): the targets' fields, the shape and dtype of their experts, which
    of the optional arrays follow (``sent``, in :data:`_OPTIONAL`'s order) and ``prepare``'s extra
    object; or only ``error``, why it has nothing to send."""

    layers: tuple[int, ...] = ()
    shape: tuple[int, int, int] = (0, 0, 0)
    dtype: str = ""
    num_experts: int = 0
    filler_rows: int = 0
    batch_shape: tuple[int, int] | None = None
    order: str = "sequence"
    sent: tuple[str, ...] = ()
    extra: tuple[Any, ...] = ()  # (extra,) when prepare returned one
    error: str | None = None

    @classmethod
    def of(cls, t: ReplayTargets, extra: tuple[Any, ...] = ()) -> _Header:
        sent = tuple(k for k in _OPTIONAL if getattr(t, k) is not None)
        return cls(t.layers, t.experts.shape, t.experts.dtype.str, t.num_experts, t.filler_rows,
                   t.batch_shape, t.order, sent, extra)  # fmt: skip

    def empty(self, rows: int) -> list[np.ndarray]:
        """Arrays to receive ``rows`` rows of the experts and of each optional array sent."""
        M, _, K = self.shape
        out = [np.empty((M, rows, K), np.dtype(self.dtype))]
        for k in self.sent:  # weights are [M, rows, K]; the masks one bool per row
            shape = (M, rows, K) if k == "weights" else (rows,)
            out.append(np.empty(shape, np.float32 if k == "weights" else bool))
        return out

    def build(self, arrays: list[np.ndarray], batch_shape: tuple[int, int] | None) -> ReplayTargets:
        """The targets of received ``arrays`` (:meth:`empty`'s, filled); fillers are counted
        from the rows' validity where it was sent."""
        opt = dict(zip(self.sent, arrays[1:], strict=True))
        valid = opt.get("valid")
        fillers = self.filler_rows if valid is None else int((~valid).sum())
        return ReplayTargets(self.layers, arrays[0], self.num_experts, fillers,
                             batch_shape=batch_shape, order=self.order, **opt)  # fmt: skip


def _arrays(t: ReplayTargets) -> list[np.ndarray]:
    return [t.experts] + [getattr(t, k) for k in _OPTIONAL if getattr(t, k) is not None]


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A flat torch view of contiguous ``a``'s bytes: every dtype travels as bytes (gloo moves
    no uint16), and a receiver's array is then filled in place."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def share_targets(
    prepare: Callable[[], Prepared] | None,
    *,
    group: Any = None,
    src: int = 0,
    sequence_parallel: bool = False,
) -> Prepared:
    """This rank's targets, prepared once for the whole TP ``group``.

    ``src`` (a global rank of ``group``) calls ``prepare()``, which returns the targets of every
    row the group routes (its position map CP-sharded but not SP-sliced:
    ``pm.local(..., sequence_parallel=False)``); the other ranks pass ``None``. Without
    ``sequence_parallel`` every rank returns those rows; with it, rank ``r`` of the group its
    :func:`sp_slice`. Receivers hold their own host copy. ``group=None``: the default group.

    ``prepare`` may return ``(targets, extra)``, ``extra`` a small picklable object every rank
    needs too (the micro-batch's :class:`ReplayReport`, whose loss mask each rank applies);
    every rank then returns ``(its targets, extra)``. If ``prepare`` raises, the source
    re-raises it and every other rank raises :class:`TargetShareError` naming it.
    """
    import torch.distributed as dist

    group = dist.group.WORLD if group is None else group
    me = dist.get_rank()
    tp_size, tp_rank = dist.get_world_size(group), dist.get_group_rank(group, me)
    targets, header = None, [None]
    failure: BaseException | None = None
    if me == src:
        try:
            # Inside the try: the group hears of a missing prepare too, instead of waiting for
            # a broadcast that never comes.
            if prepare is None:
                raise ValueError("share_targets: the source rank must pass prepare")
            targets, header = _prepared(prepare())
        except BaseException as e:  # the group hears of it, then it is raised here
            failure, header = e, [_Header(error=f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(header, src=src, group=group)
    h: _Header = header[0]
    if failure is not None:
        raise failure
    if h.error is not None:
        raise TargetShareError(f"rank {src} failed to prepare this step's targets: {h.error}")
    if not sequence_parallel:
        mine = _broadcast(targets, h, group, src)
    else:
        mine = _scatter(targets, h, group, src, tp_size, tp_rank)
    return (mine, *h.extra) if h.extra else mine  # type: ignore[return-value]


def _prepared(result: Prepared) -> tuple[ReplayTargets, list[_Header]]:
    """(the targets, the header that announces them) of what ``prepare`` returned."""
    if isinstance(result, tuple):
        targets, extra = result
        return targets, [_Header.of(targets, (extra,))]
    return result, [_Header.of(result)]


def _broadcast(targets: ReplayTargets | None, h: _Header, group: Any, src: int) -> ReplayTargets:
    import torch.distributed as dist

    if targets is not None:
        for a in _arrays(targets):
            dist.broadcast(_tensor(a), src=src, group=group)
        return targets
    arrays = h.empty(h.shape[1])
    for a in arrays:
        dist.broadcast(_tensor(a), src=src, group=group)
    return h.build(arrays, h.batch_shape)


def _scatter(
    targets: ReplayTargets | None, h: _Header, group: Any, src: int, tp_size: int, tp_rank: int
) -> ReplayTargets:
    import torch.distributed as dist

    n = h.shape[1]
    if h.order != "sequence" or n % tp_size:
        raise TargetShapeError(
            f"share_targets(sequence_parallel=True) needs sequence-major rows divisible by "
            f"TP={tp_size}; rank {src} prepared {n} rows in {h.order!r} order"
        )
    mine = h.empty(n // tp_size)
    parts = None
    if targets is not None:
        slices = [sp_slice(targets, tp_size, r) for r in range(tp_size)]
        parts = [_arrays(s) for s in slices]
    for i, a in enumerate(mine):
        sends = None if parts is None else [_tensor(p[i]) for p in parts]
        dist.scatter(_tensor(a), sends, src=src, group=group)
    bs = h.batch_shape
    return h.build(mine, None if bs is None else (bs[0], bs[1] // tp_size))
