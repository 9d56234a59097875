"""The route record: what one completion routed, token by token and MoE layer by MoE layer."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ._errors import RouteShapeError
from ._weights import check_weights

_U32_MAX = (1 << 32) - 1  # token ids are stored as uint32

__all__ = ["EngineRoutes", "RouteRecord", "WeightSpan", "expert_dtype"]


class WeightSpan(NamedTuple):
    """Rows ``[start, stop)`` of a record were routed by the weights labelled ``version``."""

    version: str
    start: int
    stop: int


def _clip_spans(spans: Sequence[WeightSpan], start: int, stop: int) -> tuple[WeightSpan, ...]:
    """``spans`` restricted to rows ``[start, stop)`` and renumbered from 0."""
    out = []
    for v, a, b in spans:
        a, b = max(a, start), min(b, stop)
        if b > a:
            out.append(WeightSpan(v, a - start, b - start))
    return tuple(out)


def expert_dtype(num_experts: int) -> np.dtype:
    """The narrowest unsigned dtype for expert ids of a model with ``num_experts`` experts."""
    if num_experts < 1:
        raise RouteShapeError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    raise RouteShapeError(f"num_experts={num_experts} exceeds 65536, the widest supported id")


@dataclass(frozen=True)
class EngineRoutes:
    """One completion's routes as an engine returns them.

    ``routed_experts`` is vLLM's ``CompletionOutput.routed_experts``: ``[R, num_layers, K]``
    covering token rows ``row_start .. row_start + R`` (vLLM returns ``T - 1`` rows: the last
    sampled token is never routed), dense layers all zero. ``routed_weights``: ``[R, num_layers,
    K]`` float32 (or float16) routing weights in the same rows, layers and slots, each exactly a
    ``weights_dtype`` value.
    """

    routed_experts: np.ndarray
    row_start: int = 0
    routed_weights: np.ndarray | None = None
    weights_dtype: str | None = None

    def __post_init__(self) -> None:
        # Nested lists too, as the engine's JSON gives them.
        object.__setattr__(self, "routed_experts", np.asarray(self.routed_experts))

    def rows(
        self, T: int, moe: tuple[int, ...], num_layers: int | None, num_experts: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(experts [T, M, K], valid [T], weights [T, M, K] or None)`` of a record of ``T``
        tokens whose MoE layers are ``moe``; :class:`RouteShapeError` for what does not fit."""
        arr, row_start = self.routed_experts, self.row_start
        if arr.ndim != 3:
            raise RouteShapeError(f"routed_experts must be [rows, layers, top_k], got {arr.shape}")
        L = arr.shape[1] if num_layers is None else num_layers
        if arr.shape[1] != L:
            raise RouteShapeError(f"routed_experts has {arr.shape[1]} layers, model has {L}")
        R = arr.shape[0]
        if row_start < 0 or row_start + R > T:
            raise RouteShapeError(
                f"routed_experts rows [{row_start}, {row_start + R}) exceed the {T} tokens"
            )
        if any(not 0 <= x < L for x in moe):
            raise RouteShapeError(f"moe_layers {list(moe)} out of range for {L} layers")
        dense = sorted(set(range(L)) - set(moe))
        if dense and R and np.any(arr[:, dense, :]):
            raise RouteShapeError(
                f"layers {dense} are marked dense but the engine returned non-zero experts there"
            )
        routed = arr[:, list(moe), :]
        _check_engine_ids(routed, num_experts)
        experts = np.zeros((T, len(moe), arr.shape[2]), dtype=expert_dtype(num_experts))
        experts[row_start : row_start + R] = routed
        valid = np.zeros(T, dtype=bool)
        valid[row_start : row_start + R] = True
        return experts, valid, self._weights(arr.shape, experts.shape, moe)

    def _weights(
        self, shape: tuple[int, ...], out: tuple[int, ...], moe: tuple[int, ...]
    ) -> np.ndarray | None:
        if self.routed_weights is None:
            return None
        rw = np.asarray(self.routed_weights)
        if rw.shape != shape:
            raise RouteShapeError(f"routed_weights {rw.shape} != routed_experts {shape}")
        weights = np.zeros(out, dtype=np.float32)
        weights[self.row_start : self.row_start + shape[0]] = rw[:, list(moe), :]
        return weights


@dataclass(eq=False)
class RouteRecord:
    """Routed experts of one sequence (prompt + completion) as the engine computed them.

    Attributes:
        token_ids: ``[T]`` int64 — prompt then completion token ids, exactly as the engine saw them.
        experts: ``[T, M, K]`` uint8 (``num_experts <= 256``) or uint16 — row ``t`` holds the top-k
            experts token ``t`` was routed to in each of the ``M`` MoE layers. The slot order within
            a row is the engine's (by score); it is kept unless a canonical order was asked for.
            May be a non-contiguous view (records decoded from storage are layer-major underneath,
            see :meth:`layer_major`).
        valid: ``[T]`` bool — rows that carry a real route. False for the final sampled token (an
            engine never routes it), for rows an engine could not return, and for filler rows.
        moe_layers: global 0-based indices of the MoE layers among all ``num_layers`` transformer
            layers, ascending; ``experts[:, i]`` belongs to layer ``moe_layers[i]``. Dense layers
            are simply absent: they are never stored as zeros that could pass for expert 0.
        num_layers: the model's total number of transformer layers (dense ones included).
        num_experts: routed experts per MoE layer (E).
        prompt_len: number of prompt tokens at the start of ``token_ids``.
        num_cached_tokens: prompt tokens the engine served from its prefix cache.
        model: model name the routes were computed with.
        metadata: small free-form str/int/float/bool annotations (request id, engine, ...).
        weight_versions: which weights routed which rows: contiguous :class:`WeightSpan` s in row
            order (one span, unless the request crossed a weight update). Empty: unknown.
        weights: ``[T, M, K]`` float32 or None — the routing (combine) weights the engine applied
            to ``experts[t, m, k]``, same slot order, each exactly a ``weights_dtype`` value;
            rows where ``valid`` is False hold 0. None: not captured.
        weights_dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``: the dtype the engine
            applied the weights in, which the store keeps them in bit-exact. Set with ``weights``.
    """

    token_ids: np.ndarray
    experts: np.ndarray
    valid: np.ndarray
    moe_layers: tuple[int, ...]
    num_layers: int
    num_experts: int
    prompt_len: int = 0
    num_cached_tokens: int = 0
    model: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_versions: tuple[WeightSpan, ...] = ()
    weights: np.ndarray | None = None
    weights_dtype: str | None = None

    def __post_init__(self) -> None:
        self.weight_versions = tuple(WeightSpan(str(v), int(a), int(b))
                                     for v, a, b in self.weight_versions)  # fmt: skip
        self.token_ids = np.asarray(self.token_ids)
        if self.token_ids.dtype != np.int64:
            self.token_ids = self.token_ids.astype(np.int64)
        self.valid = np.asarray(self.valid, dtype=bool)
        self.moe_layers = tuple(map(int, self.moe_layers))  # map: ~3x a genexpr, per record read
        self.metadata = dict(self.metadata)
        if self.weights is not None:
            w = np.asarray(self.weights)
            if w.dtype == np.float16:  # exact in float32
                w = w.astype(np.float32)
            self.weights = w
        self.validate()

    # -- shape ------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """T: tokens (and rows) in the record."""
        return int(self.token_ids.shape[0])

    @property
    def num_moe_layers(self) -> int:
        """M: MoE layers in the record."""
        return len(self.moe_layers)

    @property
    def top_k(self) -> int:
        """K: experts per token per layer."""
        return int(self.experts.shape[2])

    @property
    def completion_len(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def weight_version(self) -> str | None:
        """The one weight version that routed every row; None if mixed or unknown."""
        versions = {s.version for s in self.weight_versions}
        return versions.pop() if len(versions) == 1 else None

    @property
    def prefix_version(self) -> str | None:
        """The version of the record's first rows (its prompt's): what keys its token chain, so
        prefix-index fills never cross weight versions. None when unknown."""
        return self.weight_versions[0].version if self.weight_versions else None

    def version_stop(self) -> int:
        """Rows ``[0, version_stop())`` share the prefix version (all rows when unknown)."""
        return self.weight_versions[0].stop if self.weight_versions else self.num_tokens

    def layer_major(self) -> np.ndarray:
        """``[M, T, K]`` view (a copy only if the storage is token-major), the trainer's layout."""
        return np.ascontiguousarray(self.experts.transpose(1, 0, 2))

    def layer_major_parts(self) -> list[tuple[int, np.ndarray]]:
        """The rows as consecutive layer-major parts ``(first_row, [M, n, K])``, never copied.

        One part for a record built in memory. A record read from a store is its chunks (its
        ``experts`` are joined only when first asked for), so a trainer can copy each chunk
        straight into its targets: :func:`routereplay.trainer_adapter.gather_targets` does.
        """
        return [(0, self.experts.transpose(1, 0, 2))]

    def _experts_to_validate(self) -> np.ndarray:
        return self.experts

    def _max_expert_id(self) -> int:
        return int(self.experts.max())

    def validate(self) -> None:
        """Raise :class:`RouteShapeError` naming the first inconsistency."""
        t = self.token_ids
        if t.ndim != 1:
            raise RouteShapeError(f"token_ids must be 1-D [T], got shape {t.shape}")
        if t.size and (t.min() < 0 or t.max() > _U32_MAX):
            raise RouteShapeError("token_ids must lie in [0, 2**32)")
        e = self._experts_to_validate()
        if not isinstance(e, np.ndarray) or e.ndim != 3:
            raise RouteShapeError(
                f"experts must be a 3-D array [T, M, K], got {getattr(e, 'shape', type(e))}"
            )
        want = expert_dtype(self.num_experts)
        if e.dtype != want:
            raise RouteShapeError(
                f"experts dtype must be {want} for num_experts={self.num_experts}, got {e.dtype}"
            )
        T = t.shape[0]
        if e.shape[0] != T:
            raise RouteShapeError(f"experts has {e.shape[0]} rows but token_ids has {T} tokens")
        if e.shape[1] != len(self.moe_layers):
            raise RouteShapeError(
                f"experts has {e.shape[1]} layers but moe_layers lists {len(self.moe_layers)}"
            )
        if e.shape[2] < 1 or e.shape[2] > self.num_experts:
            raise RouteShapeError(
                f"top_k={e.shape[2]} must be in [1, num_experts={self.num_experts}]"
            )
        if self.valid.shape != (T,):
            raise RouteShapeError(f"valid must have shape ({T},), got {self.valid.shape}")
        ml = self.moe_layers
        if not all(map(operator.lt, ml, ml[1:])):
            raise RouteShapeError(f"moe_layers must be strictly ascending, got {list(ml)}")
        if ml and (ml[0] < 0 or ml[-1] >= self.num_layers):
            raise RouteShapeError(
                f"moe_layers {list(ml)} out of range for num_layers={self.num_layers}"
            )
        if not 0 <= self.prompt_len <= T:
            raise RouteShapeError(f"prompt_len={self.prompt_len} out of range [0, {T}]")
        if not 0 <= self.num_cached_tokens <= self.prompt_len:
            raise RouteShapeError(
                f"num_cached_tokens={self.num_cached_tokens} out of range [0, {self.prompt_len}]"
            )
        prev = 0
        for i, (v, a, b) in enumerate(self.weight_versions):
            if not v or a != prev or b <= a or b > T:
                raise RouteShapeError(
                    f"weight_versions[{i}]={(v, a, b)}: spans must be non-empty, named, "
                    f"contiguous from row 0 and within {T} rows"
                )
            prev = b
        self._validate_weights()
        # Every stored id (invalid rows too) must be a real expert: one vectorised max, no copy.
        # (1 << bits: np.iinfo costs ~3 us a call, and every record read is validated.)
        if e.size and self.num_experts < 1 << (8 * e.dtype.itemsize):
            top = self._max_expert_id()
            if top >= self.num_experts:
                raise RouteShapeError(f"expert id {top} >= num_experts={self.num_experts}")

    def _validate_weights(self) -> None:
        w = self.weights
        if w is None:
            if self.weights_dtype is not None:
                raise RouteShapeError(f"weights_dtype={self.weights_dtype!r} given without weights")
            return
        if not isinstance(w, np.ndarray) or w.dtype != np.float32:
            raise RouteShapeError(f"weights must be a float32 array, got {getattr(w, 'dtype', w)}")
        want = (self.num_tokens, self.num_moe_layers, self.top_k)
        if w.shape != want:
            raise RouteShapeError(f"weights have shape {w.shape}, experts {want}")
        check_weights(w, self.weights_dtype)
        if not self.valid.all() and w[~self.valid].view(np.uint32).any():
            raise RouteShapeError("weights of rows where valid is False must be 0")

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_engine(
        cls,
        routes: EngineRoutes | np.ndarray,
        token_ids: Sequence[int] | np.ndarray,
        *,
        prompt_len: int,
        num_experts: int,
        moe_layers: Sequence[int],
        num_layers: int | None = None,
        num_cached_tokens: int = 0,
        model: str = "",
        metadata: Mapping[str, Any] | None = None,
        weight_versions: Sequence[tuple[str, int, int]] = (),
    ) -> RouteRecord:
        """Build a record of ``token_ids`` from what an engine returned for them
        (:class:`EngineRoutes`, or its ``routed_experts`` array alone: rows from 0, no weights).

        Dense layers come back as all-zero rows; they are dropped by ``moe_layers`` (global
        indices), never by an offset. Rows the engine did not return are marked invalid.
        ``weight_versions``: row spans (see :class:`WeightSpan`).
        """
        if not isinstance(routes, EngineRoutes):
            routes = EngineRoutes(routes)
        tok = np.asarray(token_ids, dtype=np.int64)
        moe = tuple(int(x) for x in moe_layers)
        experts, valid, weights = routes.rows(tok.shape[0], moe, num_layers, num_experts)
        return cls(
            token_ids=tok,
            experts=experts,
            valid=valid,
            moe_layers=moe,
            num_layers=routes.routed_experts.shape[1] if num_layers is None else num_layers,
            num_experts=num_experts,
            prompt_len=prompt_len,
            num_cached_tokens=num_cached_tokens,
            model=model,
            metadata=dict(metadata or {}),
            weight_versions=tuple(weight_versions),
            weights=weights,
            weights_dtype=routes.weights_dtype,
        )

    # -- slicing and comparison -------------------------------------------------------------------
    def rows(self, start: int = 0, stop: int | None = None) -> RouteRecord:
        """The record restricted to token positions ``[start, stop)`` (prompt_len clipped)."""
        T = self.num_tokens
        stop = T if stop is None else stop
        if not 0 <= start <= stop <= T:
            raise RouteShapeError(f"row range [{start}, {stop}) out of range for {T} tokens")
        pl = min(max(self.prompt_len - start, 0), stop - start)
        return dataclasses.replace(
            self,
            token_ids=self.token_ids[start:stop],
            experts=self.experts[start:stop],
            valid=self.valid[start:stop],
            prompt_len=pl,
            num_cached_tokens=min(self.num_cached_tokens, pl),
            metadata={**self.metadata, "row_start": start} if start else self.metadata,
            weight_versions=_clip_spans(self.weight_versions, start, stop),
            weights=None if self.weights is None else self.weights[start:stop],
        )

    def same_routes(self, other: RouteRecord) -> bool:
        """True if token ids, validity, layers and every expert id are equal."""
        return (
            self.moe_layers == other.moe_layers
            and self.num_experts == other.num_experts
            and np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.valid, other.valid)
            and self.experts.shape == other.experts.shape
            and np.array_equal(self.experts, other.experts)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouteRecord):
            return NotImplemented
        return (
            self.same_routes(other)
            and self.num_layers == other.num_layers
            and self.prompt_len == other.prompt_len
            and self.num_cached_tokens == other.num_cached_tokens
            and self.model == other.model
            and self.metadata == other.metadata
            and self.weight_versions == other.weight_versions
            and self.same_weights(other)
        )

    def same_weights(self, other: RouteRecord) -> bool:
        """True if both carry no weights, or the same dtype and bit-identical weights."""
        a, b = self.weights, other.weights
        if a is None or b is None:
            return a is None and b is None
        return (
            self.weights_dtype == other.weights_dtype
            and a.shape == b.shape
            and np.array_equal(a.view(np.uint32), b.view(np.uint32))
        )

    def __repr__(self) -> str:
        return (
            f"RouteRecord(T={self.num_tokens}, M={self.num_moe_layers}, K={self.top_k}, "
            f"E={self.num_experts}, prompt_len={self.prompt_len}, "
            f"valid={int(self.valid.sum())}/{self.num_tokens}, model={self.model!r})"
        )


def _check_engine_ids(routed: np.ndarray, num_experts: int) -> None:
    """Every id of an engine's ``[R, M, K]`` rows is an expert, each row's ``K`` distinct."""
    # Checked before the cast to the record's dtype: a narrowing cast would wrap -1 to 255 and
    # 300 to 44 silently.
    if routed.size and (routed.min() < 0 or routed.max() >= num_experts):
        bad = routed.min() if routed.min() < 0 else routed.max()
        raise RouteShapeError(
            f"routed_experts holds expert id {int(bad)}, outside [0, {num_experts})"
        )
    _check_distinct(routed)


def _check_distinct(routed: np.ndarray) -> None:
    """Every engine row picks ``K`` different experts: a repeated id is a capture that went
    wrong (zeros, a shifted layout), never a router's choice, and replayed it would collapse in
    the routing map."""
    K = routed.shape[-1]
    for i in range(K):
        for j in range(i + 1, K):
            same = routed[..., i] == routed[..., j]
            if same.any():
                r, m = (int(x[0]) for x in np.nonzero(same))
                raise RouteShapeError(
                    f"routed_experts row {r}, MoE layer {m}: expert {int(routed[r, m, i])} twice "
                    f"(slots {i} and {j}); a router picks {K} different experts"
                )
