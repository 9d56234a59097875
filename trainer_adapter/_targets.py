"""Replay targets: per MoE layer ``[tokens, top_k]`` expert ids for one rank's router inputs.

Pure data. Expert ids stay in the records' compact dtype (uint8 for <= 256 experts, else uint16)
until the installer moves them to the device and widens them there: a 256k-token, 48-layer, top-8
batch is 100 MB as uint8 and 800 MB as int64.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from routereplay.client import RouteRecord, default_decode_threads, expert_dtype

from ._coverage import _route_name
from ._position_map import PositionMap
from .errors import (
    MissingWeightsError,
    ReplayConfigError,
    RouteLayerMismatchError,
    TargetShapeError,
)

if TYPE_CHECKING:
    import torch

__all__ = ["ReplayTargets", "TargetBuffers", "filler_experts", "gather_targets"]


def filler_experts(
    position: np.ndarray, num_experts: int, top_k: int, dtype: np.dtype | None = None
) -> np.ndarray:
    """Filler rows for positions without a route: ``[N, top_k]``.

    Row of position ``p`` is ``(p * top_k + j) % num_experts`` for ``j < top_k``: ``top_k`` DISTINCT
    experts (duplicates collapse in Megatron's routing_map and break the all-to-all split sizes at
    EP > 1), deterministic in the unsliced position, and spread evenly over the experts so padding
    does not pile onto expert 0.
    """
    if top_k > num_experts:
        raise TargetShapeError(f"top_k={top_k} exceeds num_experts={num_experts}")
    dt = expert_dtype(num_experts) if dtype is None else np.dtype(dtype)
    p = np.asarray(position, dtype=np.int64).reshape(-1, 1)
    return ((p * top_k + np.arange(top_k, dtype=np.int64)) % num_experts).astype(dt)


# The order of a micro-batch's rows in targets: Megatron's routers see [S, B] flattened
# (sequence-major), transformers' [B, S] (batch-major).
RowOrder = Literal["sequence", "batch"]


def _check_row_mask(name: str, m: np.ndarray | None, n: int) -> None:
    if m is not None and (m.dtype != np.bool_ or m.shape != (n,)):
        raise TargetShapeError(f"{name} must be [N={n}] bool, got {m.shape} {m.dtype}")


@dataclass(frozen=True)
class ReplayTargets:
    """Replay targets of one micro-batch on one rank.

    Attributes:
        layers: global 0-based indices of the MoE layers, ascending (Megatron's
            ``router.layer_number - 1``).
        experts: ``[M, N, K]`` uint8/uint16, layer-major; row ``n`` is the ``n``-th row the router
            sees (sequence-major ``s * B + b`` of this rank's ``[S, B]`` slice).
        num_experts: ``E``; every id is ``< E``.
        filler_rows: how many of the ``N`` rows are fillers (no route).
        valid: ``[N]`` bool, the rows that carry a real route (not fillers), in the same order;
            None when unknown (all rows count).
        pinned: the page-locked host tensor that ``experts`` views (``gather_targets(...,
            pin_memory=True)``), or None. :meth:`to_torch` then copies it to the GPU as it is,
            without first staging the rows in page-locked memory on the calling thread.
        replay_mask: ``[N]`` bool in the same order, False at the rows whose experts the
            trainer's router chooses (``gather_targets(..., own_routing=...)``); None when every
            row replays. :class:`RouterReplayer` installs it with the targets.
        weights: ``[M, N, K]`` float32, the engine's routing (combine) weights, slot ``k``
            belonging to expert ``experts[..., k]``; 0 at filler rows
            (``gather_targets(..., weights=True)``); None when not gathered.
        batch_shape: ``(B, S)`` of the micro-batch the rows come from (``B * S = N``); None
            when unknown (targets built by hand).
        order: the order of the ``N`` rows: ``"sequence"`` (``s * B + b``: Megatron's router,
            which flattens ``[S, B]``) or ``"batch"`` (``b * S + s``: a transformers router,
            which flattens ``[B, S]``).
    """

    layers: tuple[int, ...]
    experts: np.ndarray
    num_experts: int
    filler_rows: int = 0
    valid: np.ndarray | None = None
    pinned: torch.Tensor | None = field(default=None, repr=False, compare=False)
    replay_mask: np.ndarray | None = None
    weights: np.ndarray | None = None
    batch_shape: tuple[int, int] | None = None
    order: RowOrder = "sequence"

    def __post_init__(self) -> None:
        if self.order not in ("sequence", "batch"):
            raise ValueError(f"order must be 'sequence' or 'batch', not {self.order!r}")
        bs = self.batch_shape
        if bs is not None and bs[0] * bs[1] != self.experts.shape[1]:
            raise TargetShapeError(
                f"batch_shape {tuple(bs)} is {bs[0] * bs[1]} rows, the targets have "
                f"{self.experts.shape[1]}"
            )
        if self.experts.ndim != 3 or self.experts.shape[0] != len(self.layers):
            raise TargetShapeError(
                f"experts must be [M={len(self.layers)}, N, K], got {self.experts.shape}"
            )
        p = self.pinned
        # Checked here, not where a transport or installer first meets a wrong one (gloo, for
        # one, fails far from the cause).
        _check_row_mask("valid", self.valid, self.experts.shape[1])
        _check_row_mask("replay_mask", self.replay_mask, self.experts.shape[1])
        w = self.weights
        if w is not None and (w.shape != self.experts.shape or w.dtype != np.float32):
            raise TargetShapeError(
                f"weights must be {list(self.experts.shape)} float32, got {list(w.shape)} {w.dtype}"
            )
        if p is not None and (
            tuple(p.shape) != self.experts.shape
            # (empty arrays have no address to compare)
            or (self.experts.size and p.data_ptr() != self.experts.ctypes.data)
        ):
            raise TargetShapeError("pinned must be the tensor that experts is a view of")

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    def layer(self, layer: int) -> np.ndarray:
        """``[N, K]`` targets of global 0-based MoE layer ``layer``."""
        try:
            return self.experts[self.layers.index(layer)]
        except ValueError:
            raise RouteLayerMismatchError(
                f"no targets for layer {layer}; targets cover layers {list(self.layers)}"
            ) from None

    def select(self, layers: Sequence[int]) -> ReplayTargets:
        """Targets restricted to ``layers`` (a pipeline stage's or VPP chunk's MoE layers)."""
        if tuple(layers) == self.layers:
            return self  # no copy in the common case
        idx = [self.layers.index(x) for x in layers if x in self.layers]
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise RouteLayerMismatchError(
                f"no targets for layers {missing}; targets cover layers {list(self.layers)}"
            )
        return ReplayTargets(
            tuple(layers),
            self.experts[idx],
            self.num_experts,
            self.filler_rows,
            self.valid,
            replay_mask=self.replay_mask,
            weights=None if self.weights is None else self.weights[idx],
            batch_shape=self.batch_shape,
            order=self.order,
        )

    def replayed_rows(self) -> np.ndarray:
        """``[N]`` bool: the rows that replay a record's route (not fillers, not rows the
        trainer's router chooses)."""
        rows = np.ones(self.num_tokens, bool)
        if self.valid is not None:
            rows &= self.valid
        if self.replay_mask is not None:
            rows &= self.replay_mask
        return rows

    def engine_weights(self) -> np.ndarray:
        """:attr:`weights`, or :class:`ReplayConfigError` saying how to gather them."""
        if self.weights is None:
            raise ReplayConfigError(
                "weights='engine' but the targets carry no engine weights: gather them with "
                "gather_targets(..., weights=True)"
            )
        return self.weights

    @property
    def own_rows(self) -> int:
        """Rows whose experts the trainer's router chooses."""
        return 0 if self.replay_mask is None else int((~self.replay_mask).sum())

    def to_torch(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``[M, N, K]`` tensor on ``device``. Copied in the compact dtype, widened there
        (default int64, what RouterReplay's gather needs). To a GPU the copy goes through
        page-locked memory: :attr:`pinned` when there is one (no work on this thread), else a
        page-locked copy made here (~17 ms for 103 MB with one torch thread)."""
        import torch

        t = torch.from_numpy(self.experts)
        if device is not None and torch.device(device).type != "cpu":
            # From the pinned tensor itself, not a view made from the numpy array: the copy is
            # asynchronous, and only a copy from the allocator's own tensor keeps its page-locked
            # block from being reused before the copy has read it.
            src = self.pinned if self.pinned is not None else t.pin_memory()
            t = src.to(device, non_blocking=True)
        return t.to(torch.int64 if dtype is None else dtype)

    def weights_torch(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[M, N, K]`` float32 engine weights on ``device`` (:meth:`engine_weights`)."""
        import torch

        return torch.from_numpy(self.engine_weights()).to(device)


# Outputs of at least this many bytes are copied by several threads: numpy's copies release the
# GIL, and one thread neither fills the memory bandwidth nor faults the new pages in as fast
# (a 100 MB step's targets: 19 ms on one thread, ~12 ms on two, bench trainer).
_SPLIT_BYTES = 16 << 20
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _run_split(fn: Callable[[int, int], None], n: int, nbytes: int) -> None:
    """``fn(lo, hi)`` over ``0..n``: at once, or in even ranges on a few threads when the output
    is large (the ranges write disjoint rows)."""
    global _pool, _pool_pid
    # As many threads as a store decodes on: the step's copy follows its decoding on that host.
    parts = default_decode_threads() if nbytes >= _SPLIT_BYTES else 1
    if parts < 2 or n < 2 * parts:
        fn(0, n)
        return
    with _pool_lock:
        # A forked child (a DataLoader worker) inherits the pool but none of its threads.
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(parts - 1, thread_name_prefix="routereplay-gather")
            _pool_pid = os.getpid()
        pool = _pool
    bounds = [n * i // parts for i in range(parts + 1)]
    futs = [pool.submit(fn, a, b) for a, b in itertools.pairwise(bounds[1:])]
    try:
        fn(bounds[0], bounds[1])
    finally:
        for f in futs:
            f.result()


def _col_runs(cols: list[int]) -> list[tuple[int, int, int]]:
    """Group (output layer i -> record column cols[i]) into contiguous (out0, col0, n) ranges."""
    runs: list[tuple[int, int, int]] = []
    for i, c in enumerate(cols):
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == c:
            o, c0, n = runs[-1]
            runs[-1] = (o, c0, n + 1)
        else:
            runs.append((i, c, 1))
    return runs


class TargetBuffers:
    """Output memory for :func:`gather_targets`, recycled from step to step (opt-in).

    A step's targets are one large array (103 MB for 256k tokens of a 48-layer top-8 model).
    Allocated afresh each step, its pages are new to the process: the kernel faults them in
    and zeroes them (5.9% of the CPU samples of a profiled step on 2 cores; docs/trainer.md).
    ``gather_targets(..., buffers=tb)`` writes into a buffer of ``tb`` instead, once it is free.

    Each buffer is lent as a new array over its memory, and numpy makes every view of that
    array refer to it (its base is not an ndarray, so views stop there). A buffer is free again
    only once that array is gone, with every :class:`ReplayTargets`, numpy view, ``memoryview``
    or ``torch.from_numpy`` tensor made from it: the pool holds a weak reference to it, so it
    never decides from reference counts. Targets still referenced are therefore never
    overwritten; while all ``keep`` buffers are lent the gather gets fresh memory, as without a
    pool. A weak reference or a raw address (``experts.ctypes.data``, an
    ``__array_interface__`` wrapper) does not keep the memory, as it would not keep any numpy
    array alive. Use one pool per stream of steps, from any threads (it locks). Page-locked
    targets (``pin_memory=True``) come from torch's caching host allocator, which recycles
    them already; the two do not combine.

    Args:
        keep: buffers the pool holds at most. A :class:`Prefetcher` of ``depth=1`` can have
            three steps' targets alive (the one trained, the one queued, the one being
            prepared) and a ``B > 1`` map a batch-major scratch besides. The pool allocates
            only as many as are in use at once, up to ``keep``.
    """

    def __init__(self, keep: int = 4) -> None:
        if keep < 1:
            raise ReplayConfigError(f"TargetBuffers(keep={keep}): keep must be >= 1")
        self.keep = keep
        self._bufs: list[np.ndarray] = []
        # A weak reference to the array each buffer last lent (None once it is gone).
        self._lent: list[Callable[[], np.ndarray | None]] = []
        self._lock = threading.Lock()
        self.reused = 0  # buffers lent again
        self.allocated = 0  # buffers allocated (kept or not)

    def take(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of ``nbytes``, over memory nothing else refers to: recycled where
        a buffer is free, else fresh.

        A recycled buffer holds an earlier step's bytes: the gather overwrites every byte it
        returns."""
        if nbytes <= 0:
            return np.empty(0, np.uint8)
        with self._lock:
            free = [i for i, w in enumerate(self._lent) if w() is None]
            fits = [i for i in free if self._bufs[i].size >= nbytes]
            if fits:
                self.reused += 1
                return self._lend(min(fits, key=lambda j: self._bufs[j].size), nbytes)
            if free:
                # Free but all too small (the batches vary): replace the largest, with room
                # for the next steps.
                i = max(free, key=lambda j: self._bufs[j].size)
                self._bufs[i] = self._alloc(nbytes + nbytes // 8)
                return self._lend(i, nbytes)
            if len(self._bufs) < self.keep:
                self._bufs.append(self._alloc(nbytes))
                self._lent.append(_never_lent)
                return self._lend(len(self._bufs) - 1, nbytes)
            return self._alloc(nbytes)  # all lent: fresh memory, not kept

    def _alloc(self, nbytes: int) -> np.ndarray:
        self.allocated += 1
        return np.empty(nbytes, np.uint8)

    def _lend(self, i: int, nbytes: int) -> np.ndarray:
        # Over a memoryview, not the buffer itself: numpy gives every view of a view of an
        # ndarray that ndarray as its base, so a weak reference to a plain view would die with
        # it while views made from it still used the memory.
        lent = np.frombuffer(memoryview(self._bufs[i])[:nbytes], np.uint8)
        self._lent[i] = weakref.ref(lent)
        return lent

    def __repr__(self) -> str:
        return (
            f"TargetBuffers(keep={self.keep}, held={len(self._bufs)}, "
            f"reused={self.reused}, allocated={self.allocated})"
        )


def _never_lent() -> None:
    """Stands in for the weak reference of a buffer not lent yet: it is free."""
    return None


def gather_targets(
    pmap: PositionMap,
    records: Sequence[RouteRecord | None],
    layers: Sequence[int],
    *,
    num_experts: int | None = None,
    top_k: int | None = None,
    input_ids: np.ndarray | None = None,
    pin_memory: bool = False,
    buffers: TargetBuffers | None = None,
    own_routing: Collection[int] = (),
    weights: bool = False,
    order: RowOrder = "sequence",
) -> ReplayTargets:
    """Copy each mapped position's expert rows out of ``records`` for the MoE ``layers``.

    Args:
        pmap: this rank's position map ``[B, S]`` (already CP/SP-sliced).
        records: the records the map's indices point into; ``None`` for a record the store did
            not have (its positions get fillers).
        layers: global 0-based MoE layer indices of this rank's routers (pipeline stage / VPP
            chunks); each must be among every used record's ``moe_layers``.
        num_experts, top_k: the model's; default the records'. Needed when no record is used.
        input_ids: the trainer's ``[B, S]`` token ids for this map; when given they are checked
            against the records (:class:`TokenMismatchError`).
        pin_memory: write the targets into page-locked memory from torch's caching host
            allocator (needs an accelerator torch can pin for, such as CUDA), so that installing
            them on the GPU is an asynchronous copy with nothing left for the training thread
            to do (:attr:`ReplayTargets.pinned`). Use it where the targets are prepared ahead
            (:class:`Prefetcher`); docs/benchmarks.md has the install's cost with and without
            it. The allocator also reuses its blocks from step to step, so the output's pages
            are not faulted in afresh.
        buffers: write the targets into memory recycled from earlier steps
            (:class:`TargetBuffers`), which is never memory that earlier targets still in use
            refer to. Without it (and without ``pin_memory``) the targets are fresh memory.
        own_routing: samples (:attr:`PositionMap.sample`) whose experts the trainer's router
            chooses, :attr:`ReplayReport.own_routing`: their rows are False in
            :attr:`ReplayTargets.replay_mask`.
        weights: also copy the records' engine routing weights (:attr:`ReplayTargets.weights`,
            the same rows as the ids; 0 at fillers). A used record without them raises
            :class:`MissingWeightsError` naming its route.
        order: the row order to write: ``"sequence"`` (``s * B + b``, what Megatron-Core's
            routers see) or ``"batch"`` (``b * S + s``, what a transformers router sees);
            written once, never re-ordered afterwards.

    Returns:
        :class:`ReplayTargets` with ``[M, B*S, K]`` rows in ``order``, ``batch_shape = (B, S)``,
        fillers at no-route positions, at the records' invalid rows and at missing records.

    Copies are memcpy runs: consecutive positions reading consecutive rows of one record are one
    strided copy of all layers at once per part of the record (a record read from a store is
    its chunks, :meth:`RouteRecord.layer_major_parts`), so the cost is one pass over the output
    bytes.
    """
    if pin_memory and buffers is not None:
        raise ReplayConfigError(
            "gather_targets: pass pin_memory=True or buffers, not both (page-locked targets "
            "are recycled by torch's caching host allocator already)"
        )
    layers = tuple(int(x) for x in layers)
    used = np.array([ri for ri in pmap.used_records.tolist() if records[ri] is not None], np.int32)
    num_experts, top_k = _model_shape(records, used, num_experts, top_k)
    sources = _record_sources(records, used, layers, num_experts, top_k)
    if input_ids is not None:
        pmap.check_tokens(records, input_ids)
    # The batch-major rows are the output itself where no reorder follows: pinned there.
    pin_here = pin_memory and (pmap.shape[0] == 1 or order == "batch")
    shape = _Shape(len(layers), num_experts, top_k)
    rows = _gather_batch_major(pmap, records, sources, shape, _Memory(pin_here, buffers))
    rows.replay = _replay_mask(pmap, own_routing)
    if weights:
        rows.weights = _gather_weights(pmap, records, used, layers, rows)
    rows = rows.in_order(order, pmap.shape, _Memory(pin_memory, buffers))
    return ReplayTargets(
        layers, rows.experts, num_experts, rows.fillers, rows.valid, rows.pinned, rows.replay,
        weights=rows.weights, batch_shape=pmap.shape, order=order,
    )  # fmt: skip


class _Source(NamedTuple):
    """A used record's rows to copy: the ``(output layer, record column, count)`` runs of the
    gathered layers, and its layer-major parts (copied from as they are) with the first row of
    each."""

    cols: list[tuple[int, int, int]]
    firsts: tuple[int, ...]
    parts: tuple[np.ndarray, ...]


class _Shape(NamedTuple):
    """The gathered ids' model shape: MoE layers gathered, experts, ids per row."""

    layers: int
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class _Memory:
    """Where gathered ids are written: page-locked (``pinned``), else recycled from
    ``buffers`` where given, else fresh."""

    pinned: bool
    buffers: TargetBuffers | None

    def ids(self, shape: tuple[int, int, int], dt: np.dtype) -> tuple[np.ndarray, Any]:
        """An ``shape`` array of ``dt`` ids, and the page-locked tensor it is (None if not)."""
        n = shape[0] * shape[1] * shape[2]
        t = _empty(n, dt, self.pinned)
        flat = t.numpy() if t is not None else _host_empty(n, dt, self.buffers)
        return flat.reshape(shape), None if t is None else t.view(*shape)


@dataclass
class _Rows:
    """The gathered rows of a ``(B, S)`` map, batch-major until :meth:`in_order`: ids
    ``[M, B*S, K]`` and the page-locked tensor they are in (None unless pinned), ``[B*S]`` the
    rows a record routed, the replay mask, the engine weights, and how many rows are fillers."""

    experts: np.ndarray
    pinned: torch.Tensor | None
    valid: np.ndarray
    fillers: int
    replay: np.ndarray | None = None
    weights: np.ndarray | None = None

    def in_order(self, order: RowOrder, shape: tuple[int, int], memory: _Memory) -> _Rows:
        """These rows in ``order``: as they are, or copied sequence-major into ``memory``."""
        if order not in ("sequence", "batch"):
            raise ValueError(f"order must be 'sequence' or 'batch', not {order!r}")
        B, S = shape
        if B == 1 or order == "batch":
            return self
        M, N, K = self.experts.shape
        # [M, B, S, K] -> [M, S, B, K]: Megatron's router flattens [S, B] sequence-major. Into a
        # second buffer (from the pool, the scratch's going back to it with ``by_seq``).
        by_seq = self.experts.reshape(M, B, S, K).transpose(0, 2, 1, 3)
        out, pinned = memory.ids((M, N, K), self.experts.dtype)
        np.copyto(out.reshape(M, S, B, K), by_seq)

        def seq_major(rows: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(rows.reshape(B, S).T).reshape(N)

        weights = self.weights
        if weights is not None:
            weights = np.ascontiguousarray(weights.reshape(M, B, S, K).transpose(0, 2, 1, 3))
            weights = weights.reshape(M, N, K)
        replay = None if self.replay is None else seq_major(self.replay)
        return _Rows(out, pinned, seq_major(self.valid), self.fillers, replay, weights)


def _model_shape(
    records: Sequence[RouteRecord | None],
    used: np.ndarray,
    num_experts: int | None,
    top_k: int | None,
) -> tuple[int, int]:
    """``(num_experts, top_k)``: as given, else the first used record's (any record's when
    none is used)."""
    if num_experts is not None and top_k is not None:
        return num_experts, top_k
    # From any record, used or not: a rank's slice may be all padding.
    present = [r for r in records if r is not None]
    if not present:
        raise RouteLayerMismatchError("no records given: pass num_experts and top_k")
    r0 = records[int(used[0])] if used.size else present[0]
    return (
        r0.num_experts if num_experts is None else num_experts,
        r0.top_k if top_k is None else top_k,
    )


def _record_sources(
    records: Sequence[RouteRecord | None],
    used: np.ndarray,
    layers: tuple[int, ...],
    num_experts: int,
    top_k: int,
) -> dict[int, _Source]:
    """Each used record's :data:`_Source`, checked against the model's shape and ``layers``."""
    sources: dict[int, _Source] = {}
    runs_of_layout: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}  # records share one
    for ri in used.tolist():
        r = records[ri]
        if r.num_experts != num_experts or r.top_k != top_k:
            raise RouteLayerMismatchError(
                f"record {ri} has num_experts={r.num_experts}, top_k={r.top_k}; the model has "
                f"num_experts={num_experts}, top_k={top_k}"
            )
        runs = runs_of_layout.get(r.moe_layers)
        if runs is None:
            missing = sorted(set(layers) - set(r.moe_layers))
            if missing:
                raise RouteLayerMismatchError(
                    f"record {ri} has no routes for the model's MoE layers {missing} (global "
                    f"0-based); it covers {list(r.moe_layers)} of {r.num_layers} layers"
                )
            runs = runs_of_layout[r.moe_layers] = _col_runs([r.moe_layers.index(x) for x in layers])
        # A record read from a store is its chunks: copied from them straight into the output.
        # (layer_major_parts: consecutive from row 0, what the kernel's cuts rely on)
        parts = r.layer_major_parts()
        firsts, arrs = tuple(zip(*parts, strict=True)) if parts else ((), ())
        sources[ri] = _Source(runs, firsts, arrs)
    return sources


def _gather_batch_major(
    pmap: PositionMap,
    records: Sequence[RouteRecord | None],
    sources: dict[int, _Source],
    shape: _Shape,
    memory: _Memory,
) -> _Rows:
    """The batch-major ids of the mapped positions, fillers where no valid row of a record is."""
    B, S = pmap.shape
    N = B * S
    dt = expert_dtype(shape.num_experts)
    # Batch-major output first: runs of consecutive rows are long there; reordered at the end
    # into the page-locked output where the order asks for it (this one is then only scratch).
    out, pinned = memory.ids((shape.layers, N, shape.top_k), dt)
    routed = _copy_routes(out, pmap, records, sources)
    # Fillers: no route, or a row the record marks invalid (zeros there would pass for expert 0).
    fill_idx = np.flatnonzero(~routed)
    if fill_idx.size:
        out[:, fill_idx] = filler_experts(
            pmap.position.reshape(-1)[fill_idx], shape.num_experts, shape.top_k, dt
        )[None]
    return _Rows(out, pinned, routed, int(fill_idx.size))


def _copy_routes(
    out: np.ndarray,
    pmap: PositionMap,
    records: Sequence[RouteRecord | None],
    sources: dict[int, _Source],
) -> np.ndarray:
    """Copy the records' rows of the mapped positions into batch-major ``out`` ``[M, B*S, K]``;
    returns ``[B*S]`` bool, the positions given a valid row of a record."""
    N = out.shape[1]
    rec = pmap.record.reshape(-1)
    tok = pmap.token.reshape(-1)
    routed = np.zeros(N, bool)  # set as they are copied
    if not N:
        return routed
    spans = pmap.runs

    def copy(lo: int, hi: int) -> None:
        """Copy the rows of output positions ``lo..hi`` (cutting the runs there)."""
        i = bisect.bisect_right(spans, (lo, N)) - 1
        for s, e in spans[max(i, 0) :]:
            s, e = max(s, lo), min(e, hi)
            if s >= hi:
                break
            if s >= e:
                continue
            ri = int(rec[s])
            if ri not in sources:
                continue  # a missing record: fillers
            src = sources[ri]
            t0, t1 = int(tok[s]), int(tok[s]) + (e - s)
            routed[s:e] = records[ri].valid[t0:t1]
            _copy_cuts(out, src.cols, _cuts(src.firsts, src.parts, t0, t1), s, e)

    _run_split(copy, N, out.nbytes)
    return routed


def _gather_weights(
    pmap: PositionMap,
    records: Sequence[RouteRecord | None],
    used: np.ndarray,
    layers: tuple[int, ...],
    rows: _Rows,
) -> np.ndarray:
    """``[M, B*S, K]`` float32 batch-major engine weights of the mapped positions; 0 where
    ``rows`` (batch-major) is not valid or not replayed. Raises :class:`MissingWeightsError`
    for a record without them that such rows read."""
    valid, replay, top_k = rows.valid, rows.replay, rows.experts.shape[2]
    # Own-routing rows keep the router's probabilities: their records need no weights.
    valid = valid if replay is None else valid & replay
    rec = pmap.record.reshape(-1)
    tok = pmap.token.reshape(-1)
    out = np.zeros((len(layers), rec.size, top_k), np.float32)
    for ri in used.tolist():
        r = records[ri]
        w = getattr(r, "weights", None)
        name = _route_name(ri, r, None)
        pos = np.flatnonzero((rec == ri) & valid)
        if not pos.size:
            continue
        if w is None:
            raise MissingWeightsError(name, ri)
        want = (r.num_tokens, len(r.moe_layers), r.top_k)
        if w.shape != want:
            raise TargetShapeError(
                f"route {name}: weights have shape {list(w.shape)}, its experts {list(want)}"
            )
        cols = [r.moe_layers.index(x) for x in layers]
        # [P, M, K] rows of the record -> [M, P, K]; fancy indexing copies, casting to float32
        out[:, pos] = w[tok[pos]][:, cols].transpose(1, 0, 2)
    return out


def _replay_mask(pmap: PositionMap, own_routing: Collection[int]) -> np.ndarray | None:
    """``[B*S]`` batch-major, False at the positions of the ``own_routing`` samples; None when
    this rank holds none of them (nothing to install)."""
    if not len(own_routing):
        return None
    own = np.isin(pmap.sample.reshape(-1), np.fromiter(own_routing, np.int64))
    return ~own if own.any() else None


def _cuts(
    firsts: Sequence[int], arrs: Sequence[np.ndarray], t0: int, t1: int
) -> list[tuple[np.ndarray, int, int]]:
    """The parts holding a record's rows ``t0..t1`` (``arrs``, starting at rows ``firsts``),
    each cut to them: ``(part, first, stop)``."""
    j = bisect.bisect_right(firsts, t0) - 1
    cuts = []
    while t0 < t1:
        a, p0 = arrs[j], firsts[j]
        stop = min(t1, p0 + a.shape[1])
        cuts.append((a, t0 - p0, stop - p0))
        t0, j = stop, j + 1
    return cuts


def _copy_cuts(
    out: np.ndarray,
    cols: Sequence[tuple[int, int, int]],
    cuts: Sequence[tuple[np.ndarray, int, int]],
    s: int,
    e: int,
) -> None:
    """numpy's copy of ``cuts`` into ``out[:, s:e]``: one concatenate per layer range (a call
    per part cost more than the copies on 128-row chunks)."""
    for o, c0, n in cols:
        if len(cuts) == 1:
            a, x, y = cuts[0]
            out[o : o + n, s:e] = a[c0 : c0 + n, x:y]
        else:
            np.concatenate(
                [a[c0 : c0 + n, x:y] for a, x, y in cuts], axis=1, out=out[o : o + n, s:e]
            )


def _host_empty(n: int, dt: np.dtype, buffers: TargetBuffers | None) -> np.ndarray:
    """``n`` ids of pageable memory: recycled from ``buffers`` where given, else fresh."""
    if buffers is None:
        return np.empty(n, dt)
    return buffers.take(n * np.dtype(dt).itemsize).view(dt)


def _empty(n: int, dt: np.dtype, pin_memory: bool) -> torch.Tensor | None:
    """A flat page-locked tensor of ``n`` ids (None when not asked for)."""
    if not pin_memory:
        return None
    import torch

    tdt = torch.uint8 if dt == np.uint8 else torch.uint16
    try:  # torch pins for whichever accelerator it has (no torch.cuda here: NPU stacks)
        return torch.empty(n, dtype=tdt, pin_memory=True)
    except RuntimeError as exc:
        raise ReplayConfigError(
            "gather_targets(pin_memory=True) needs an accelerator (page-locked memory is for "
            f"copies to a GPU): {exc}"
        ) from exc
