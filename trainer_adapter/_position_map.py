"""Position maps: where each packed-token position of a training batch takes its route from.

Pure data (numpy only). A trainer packs samples into a batch in its own way (THD/padding-free with
``cu_seqlens``, padded ``[B, S]`` with left or right padding, one shared prompt followed by several
completions, multi-turn trajectories); the builders here describe that packing as a
:class:`PositionMap` of shape ``[B, S]`` (``B = 1`` for THD) whose every position points at
``(record index, token index in that record)`` or at no route. Parallel slicing (context parallel,
sequence parallel) is indexing along ``S`` and happens on the map, before any expert row is copied,
so each rank only ever gathers its own rows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from routereplay.client import RouteRecord

from .errors import RouteAlignmentError, TokenMismatchError

__all__ = [
    "NO_ROUTE",
    "PositionMap",
    "SampleMap",
    "cp_zigzag_index",
    "multi_turn_sample",
    "padded_position_map",
    "sample_from_record",
    "shared_prefix_sample",
    "thd_cp_index",
    "thd_position_map",
]

NO_ROUTE = -1
"""Record index of a position that has no route (padding, a token no engine routed)."""


@dataclass(frozen=True)
class SampleMap:
    """Where each token of one training sample takes its route from.

    Attributes:
        record: ``[L]`` int32 — index into the batch's record list, or ``NO_ROUTE``.
        token: ``[L]`` int32 — row of that record (meaningless where ``record == NO_ROUTE``).
    """

    record: np.ndarray
    token: np.ndarray

    def __post_init__(self) -> None:
        if self.record.shape != self.token.shape or self.record.ndim != 1:
            raise RouteAlignmentError(
                f"SampleMap arrays must be 1-D and equal, got {self.record.shape} and "
                f"{self.token.shape}"
            )

    def __len__(self) -> int:
        return int(self.record.shape[0])

    def resized(self, length: int) -> SampleMap:
        """Truncated to ``length`` tokens, or extended with no-route tokens (a token the trainer
        appended that no engine saw, e.g. an EOS)."""
        n = len(self)
        if length <= n:
            return SampleMap(self.record[:length], self.token[:length])
        pad = length - n
        return SampleMap(
            np.concatenate([self.record, np.full(pad, NO_ROUTE, np.int32)]),
            np.concatenate([self.token, np.zeros(pad, np.int32)]),
        )


def sample_from_record(
    index: int, record: RouteRecord | None, *, length: int | None = None
) -> SampleMap:
    """A sample that is exactly record ``index``'s tokens (prompt + completion), position ``i`` ->
    row ``i``. ``length`` truncates it (or extends it with no-route tokens).

    ``record=None``: the store did not have the record (``get_many(..., missing_ok=True)``);
    ``length`` is then the sample's length, its positions point at record ``index`` and get
    fillers, and a :class:`ReplayPolicy` counts them as missing.
    """
    if record is None:
        if length is None:
            raise RouteAlignmentError(f"record {index} is missing: pass the sample's length=")
        return SampleMap(np.full(length, index, np.int32), np.arange(length, dtype=np.int32))
    T = record.num_tokens
    sm = SampleMap(np.full(T, index, np.int32), np.arange(T, dtype=np.int32))
    return sm if length is None else sm.resized(length)


def shared_prefix_sample(
    indices: Sequence[int],
    records: Sequence[RouteRecord],
    *,
    prompt_len: int | None = None,
    sample: int = -1,
) -> SampleMap:
    """One prompt copy followed by each record's completion (ART's GRPO-group packing).

    Layout: ``[prompt of records[indices[0]]] + [completion of records[i] for i in indices]``;
    each prompt row comes from the first record of the group with a valid row there (a later
    request of the group may have hit the engine's prefix cache and lack prompt rows, or the
    first may), each completion from its own record's rows ``[prompt_len, T_i)``. Every record
    must start with the same ``prompt_len`` tokens; a difference raises
    :class:`TokenMismatchError` (``sample`` only labels that message).
    """
    if not indices:
        raise RouteAlignmentError(f"sample {sample}: shared-prefix sample needs >= 1 record")
    _require_present(sample, indices, records)
    first = records[indices[0]]
    P = first.prompt_len if prompt_len is None else prompt_len
    ref = first.token_ids[:P]
    prompt_rec = np.full(P, indices[0], np.int32)
    prompt_ok = first.valid[:P].copy()
    rec_parts = [prompt_rec]
    tok_parts = [np.arange(P, dtype=np.int32)]
    for i in indices:
        r = records[i]
        if r.num_tokens < P:
            raise RouteAlignmentError(
                f"sample {sample}: record {i} has {r.num_tokens} tokens, fewer than the shared "
                f"prompt's {P}"
            )
        _check_prefix(
            sample, r.token_ids[:P], ref,
            f"record {i}'s prompt differs from record {indices[0]}'s shared prompt",
        )  # fmt: skip
        fill = ~prompt_ok & r.valid[:P]
        prompt_rec[fill] = i
        prompt_ok |= fill
        n = r.num_tokens - P
        rec_parts.append(np.full(n, i, np.int32))
        tok_parts.append(np.arange(P, P + n, dtype=np.int32))
    return SampleMap(np.concatenate(rec_parts), np.concatenate(tok_parts))


def _require_present(
    sample: int, indices: Sequence[int], records: Sequence[RouteRecord | None]
) -> None:
    """Samples built from several records need each one's tokens."""
    gone = [i for i in indices if records[i] is None]
    if gone:
        raise RouteAlignmentError(
            f"sample {sample}: records {gone} are missing; build a sample whose record is "
            "missing with sample_from_record(i, None, length=...)"
        )


def _check_prefix(sample: int, got: np.ndarray, want: np.ndarray, detail: str) -> None:
    """TokenMismatchError at the first position where ``got`` (a record's ids) != ``want``."""
    diff = np.flatnonzero(got != want)
    if diff.size:
        p = int(diff[0])
        raise TokenMismatchError(sample, p, int(want[p]), int(got[p]), detail)


def multi_turn_sample(
    indices: Sequence[int],
    records: Sequence[RouteRecord],
    *,
    prefer: Literal["first", "last"] = "first",
    sample: int = -1,
) -> SampleMap:
    """A multi-turn trajectory assembled from one record per turn.

    Turn ``k``'s record holds the whole conversation so far (earlier turns re-sent as prompt), so
    later records repeat earlier tokens. The sample is the longest record's tokens; each position
    takes its row from the EARLIEST turn with a valid row there: that is the routing under which
    the token's rollout log-prob was computed (a completion token keeps its decode-time route, not
    the later prefill's). The last sampled token of a turn has no row in its own record, so it
    takes the next turn's prefill row. Every record must agree with the longest one on the tokens
    it covers (retokenization drift raises :class:`TokenMismatchError`).

    ``prefer="last"`` takes the LATEST turn with a valid row instead: the final prefill's routes,
    closer to the trainer's single forward over the whole trajectory, but not the routes the
    earlier completions were sampled under.
    """
    if prefer not in ("first", "last"):
        raise RouteAlignmentError(f"prefer must be 'first' or 'last', got {prefer!r}")
    if not indices:
        raise RouteAlignmentError(f"sample {sample}: multi-turn sample needs >= 1 record")
    _require_present(sample, indices, records)
    lens = [records[i].num_tokens for i in indices]
    longest = int(np.argmax(lens))
    L = lens[longest]
    ref = records[indices[longest]].token_ids
    rec = np.full(L, NO_ROUTE, np.int32)
    fallback = np.full(L, NO_ROUTE, np.int32)  # covering record with only invalid rows
    order = list(indices) if prefer == "first" else list(indices)[::-1]
    for i in order:
        r = records[i]
        T = r.num_tokens
        _check_prefix(
            sample, r.token_ids, ref[:T],
            f"turn record {i} disagrees with the final turn's record {indices[longest]}",
        )  # fmt: skip
        take = (rec[:T] == NO_ROUTE) & r.valid
        rec[:T][take] = i
        fallback[:T][fallback[:T] == NO_ROUTE] = i
    # Rows no turn routed still point at a covering record: its token is checked, its row is
    # invalid and gets a filler.
    rec = np.where(rec == NO_ROUTE, fallback, rec)
    return SampleMap(rec, np.arange(L, dtype=np.int32))


@dataclass(frozen=True)
class PositionMap:
    """Route source of every position of a packed batch, shaped like the trainer's ``input_ids``.

    All arrays are ``[B, S]`` (``B = 1`` for THD packing). Megatron's router sees the batch as
    ``[S, B]`` flattened sequence-major (row ``s * B + b``); :func:`gather_targets` emits rows in
    that order.

    Attributes:
        record: int32 — index into the record list, or ``NO_ROUTE``.
        token: int32 — row in that record.
        sample: int32 — sample index (for error messages), ``-1`` for padding.
        offset: int32 — position within its sample, ``-1`` for padding.
        position: int64 — position in the UNSLICED batch (``b * S_full + s``); fillers are a
            function of it, so a token gets the same filler experts whatever the parallel layout.
    """

    record: np.ndarray
    token: np.ndarray
    sample: np.ndarray
    offset: np.ndarray
    position: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.record.shape[0]), int(self.record.shape[1]))

    @functools.cached_property
    def runs(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each run of flat positions (``b * S + s``) that read consecutive
        rows of one record, in order; positions without a route are in none. A packed batch has
        a few per sample, so the token check and the gather work per run, not per position.
        Computed once per map (the arrays are not to be changed in place)."""
        rec, tok = self.record.reshape(-1), self.token.reshape(-1)
        n = rec.shape[0]
        if not n:
            return []
        brk = np.flatnonzero((rec[1:] != rec[:-1]) | (tok[1:] != tok[:-1] + 1)) + 1
        starts = [0, *brk.tolist()]
        ends = [*brk.tolist(), n]
        return [(a, b) for a, b in zip(starts, ends, strict=True) if rec[a] >= 0]

    @functools.cached_property
    def used_records(self) -> np.ndarray:
        """The record indices the map reads from, ascending (from its runs where they are
        few, as in a packed batch; a sort of every position's otherwise)."""
        rec = self.record.reshape(-1)
        if self._few_runs():
            return np.array(sorted({int(rec[a]) for a, _ in self.runs}), dtype=np.int32)
        return np.unique(rec[rec >= 0])

    def _few_runs(self) -> bool:
        """Runs long enough (64 positions on average, or at most 16 runs) that a Python step per
        run costs less than a numpy pass over every position."""
        return len(self.runs) <= max(16, self.record.size // 64)

    @property
    def num_tokens(self) -> int:
        """Rows the router sees: ``B * S``."""
        return int(self.record.size)

    def _take_s(self, index: np.ndarray | slice) -> PositionMap:
        return PositionMap(
            self.record[:, index],
            self.token[:, index],
            self.sample[:, index],
            self.offset[:, index],
            self.position[:, index],
        )

    # -- parallel slicing -------------------------------------------------------------------------
    def cp_shard(
        self, cp_size: int, cp_rank: int, *, cu_seqlens_padded: np.ndarray | None = None
    ) -> PositionMap:
        """This context-parallel rank's positions, exactly as Megatron shards ``input_ids``.

        Without ``cu_seqlens_padded`` (BSHD): ``get_batch_on_this_cp_rank`` — ``S`` is cut into
        ``2 * cp_size`` chunks and the rank keeps chunks ``r`` and ``2 * cp_size - 1 - r``. With it
        (THD, ``B = 1``): the same zigzag per sequence (Transformer Engine's
        ``thd_get_partitioned_indices``), sequences concatenated in order.
        """
        if cp_size == 1:
            return self
        if cu_seqlens_padded is None:
            return self._take_s(cp_zigzag_index(self.shape[1], cp_size, cp_rank))
        if self.shape[0] != 1:
            raise RouteAlignmentError(f"THD context parallel needs B == 1, got shape {self.shape}")
        return self._take_s(thd_cp_index(cu_seqlens_padded, cp_size, cp_rank, total=self.shape[1]))

    def sp_shard(self, tp_size: int, tp_rank: int) -> PositionMap:
        """This tensor-parallel rank's rows under sequence parallel.

        Megatron scatters the ``[S, B, H]`` hidden states along ``S``: rank ``r`` holds the
        contiguous rows ``[r * S/TP * B, (r+1) * S/TP * B)`` of the sequence-major flattening, i.e.
        ``s`` in ``[r * S/TP, (r+1) * S/TP)`` for every ``b``. (THD: a contiguous piece of the
        packed stream; a sequence may be cut at the boundary.)
        """
        if tp_size == 1:
            return self
        S = self.shape[1]
        if S % tp_size:
            raise RouteAlignmentError(
                f"sequence length {S} (after context parallel) is not divisible by TP={tp_size}; "
                "Megatron's sequence parallel needs it"
            )
        n = S // tp_size
        return self._take_s(slice(tp_rank * n, (tp_rank + 1) * n))

    def local(
        self,
        *,
        cp_size: int = 1,
        cp_rank: int = 0,
        tp_size: int = 1,
        tp_rank: int = 0,
        sequence_parallel: bool = True,
        cu_seqlens_padded: np.ndarray | None = None,
    ) -> PositionMap:
        """The rows this rank's routers see: context-parallel shard, then the sequence-parallel
        slice (``sequence_parallel=False`` with TP > 1: every TP rank routes all rows)."""
        pm = self.cp_shard(cp_size, cp_rank, cu_seqlens_padded=cu_seqlens_padded)
        return pm.sp_shard(tp_size, tp_rank) if sequence_parallel else pm

    # -- checks -----------------------------------------------------------------------------------
    def check_tokens(self, records: Sequence[RouteRecord | None], input_ids: np.ndarray) -> None:
        """Raise :class:`TokenMismatchError` at the first position whose record token id differs
        from the trainer's ``input_ids`` (``[B, S]`` int, same shape as the map, or ``[S]`` when
        ``B = 1``). Positions of missing records (``None``) have no token to compare."""
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None, :]
        if ids.shape != self.shape:
            raise RouteAlignmentError(
                f"input_ids shape {ids.shape} differs from the position map's {self.shape}"
            )
        # Run by run (a slice compare each) where runs are long, as in a packed batch: a quarter
        # of the cost of gathering every position's token (bench trainer); else at once.
        rec, tok, want = self.record.reshape(-1), self.token.reshape(-1), ids.reshape(-1)
        if self._few_runs():
            for a, b in self.runs:
                ri, t0 = int(rec[a]), int(tok[a])
                if records[ri] is None:
                    continue
                got = records[ri].token_ids[t0 : t0 + b - a]
                if got.shape[0] != b - a:
                    break  # rows past the record's end: left to the check below, as before
                if not np.array_equal(got, want[a:b]):
                    j = a + int(np.flatnonzero(got != want[a:b])[0])
                    bb, ss = divmod(j, self.shape[1])
                    raise self._token_mismatch(bb, ss, int(want[j]), int(got[j - a]))
            else:
                return
        all_tok, offs = _concat_tokens(records)
        present = np.array([r is not None for r in records] + [False])
        mapped = present[np.where(self.record >= 0, self.record, len(records))]
        got = all_tok[offs[self.record[mapped]] + self.token[mapped]]
        want = ids[mapped]
        bad = np.flatnonzero(got != want)
        if bad.size:
            j = int(bad[0])
            b, s = (int(x[j]) for x in np.nonzero(mapped))
            raise self._token_mismatch(b, s, int(want[j]), int(got[j]))

    def _token_mismatch(self, b: int, s: int, expected: int, found: int) -> TokenMismatchError:
        """The error for position ``[b, s]``: the trainer's token ``expected``, the record's
        ``found``."""
        return TokenMismatchError(
            int(self.sample[b, s]),
            int(self.offset[b, s]),
            expected,
            found,
            f"batch row {b}, packed position {s}, record {int(self.record[b, s])} "
            f"token {int(self.token[b, s])}",
        )


def _concat_tokens(records: Sequence[RouteRecord | None]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.array([0 if r is None else r.num_tokens for r in records], dtype=np.int64)
    offs = np.zeros(len(records) + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    toks = [r.token_ids for r in records if r is not None]
    all_tok = np.concatenate(toks) if toks else np.zeros(0, np.int64)
    return all_tok, offs


def _check_rows(samples: Sequence[SampleMap], records: Sequence[RouteRecord | None]) -> None:
    """Every mapped row must exist in its record (an out-of-range row would read garbage; a
    missing record has no rows to read)."""
    unbounded = np.iinfo(np.int64).max
    lens = np.array(
        [unbounded if r is None else r.num_tokens for r in records] + [0], dtype=np.int64
    )
    for i, sm in enumerate(samples):
        m = sm.record >= 0
        if not m.any():
            continue
        if int(sm.record[m].max()) >= len(records):
            raise RouteAlignmentError(
                f"sample {i} names record {int(sm.record[m].max())} but only {len(records)} "
                "records were given"
            )
        over = np.flatnonzero(m & (sm.token >= lens[np.where(m, sm.record, len(records))]))
        if over.size:
            p = int(over[0])
            raise RouteAlignmentError(
                f"sample {i} position {p} maps to row {int(sm.token[p])} of record "
                f"{int(sm.record[p])}, which has {records[int(sm.record[p])].num_tokens} rows"
            )


def _empty(B: int, S: int) -> tuple[np.ndarray, ...]:
    return (
        np.full((B, S), NO_ROUTE, np.int32),
        np.zeros((B, S), np.int32),
        np.full((B, S), -1, np.int32),
        np.full((B, S), -1, np.int32),
        np.arange(B * S, dtype=np.int64).reshape(B, S),
    )


def thd_position_map(
    samples: Sequence[SampleMap],
    cu_seqlens: np.ndarray | Sequence[int],
    *,
    cu_seqlens_padded: np.ndarray | Sequence[int] | None = None,
    records: Sequence[RouteRecord | None] | None = None,
) -> PositionMap:
    """Position map of a THD (padding-free) pack: ``[1, T]``.

    ``cu_seqlens`` (``[n + 1]``) gives each sample's real length; ``cu_seqlens_padded`` (Megatron's
    per-sequence padding to a multiple of ``2 * CP * TP``) where each starts, default
    ``cu_seqlens``. ``T = cu_seqlens_padded[-1]``. A sample longer than its map is extended with
    no-route tokens, a shorter one truncated. Padding positions have no route. With ``records``,
    rows are bounds-checked against them.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    cup = cu if cu_seqlens_padded is None else np.asarray(cu_seqlens_padded, dtype=np.int64)
    n = len(samples)
    if cu.shape != (n + 1,) or cup.shape != (n + 1,):
        raise RouteAlignmentError(
            f"{n} samples need cu_seqlens of {n + 1} entries, got {cu.shape} and {cup.shape}"
        )
    lens = np.diff(cu)
    plens = np.diff(cup)
    if (lens < 0).any() or (lens > plens).any() or cu[0] != 0 or cup[0] != 0:
        raise RouteAlignmentError(
            f"cu_seqlens {cu.tolist()} / cu_seqlens_padded {cup.tolist()} are inconsistent"
        )
    T = int(cup[-1])
    rec, tok, smp, off, pos = _empty(1, T)
    for i, sm in enumerate(samples):
        L = int(lens[i])
        s0 = int(cup[i])
        sm = sm.resized(L)
        rec[0, s0 : s0 + L] = sm.record
        tok[0, s0 : s0 + L] = sm.token
        smp[0, s0 : s0 + L] = i
        off[0, s0 : s0 + L] = np.arange(L, dtype=np.int32)
    if records is not None:
        _check_rows([SampleMap(rec[0], tok[0])], records)
    return PositionMap(rec, tok, smp, off, pos)


def padded_position_map(
    samples: Sequence[SampleMap],
    seq_len: int,
    *,
    padding_side: Literal["right", "left"] = "right",
    lengths: Sequence[int] | None = None,
    records: Sequence[RouteRecord | None] | None = None,
) -> PositionMap:
    """Position map of a padded batch ``[B = len(samples), S = seq_len]``.

    Sample ``b`` occupies ``[0, L_b)`` (right padding) or ``[S - L_b, S)`` (left padding);
    ``lengths`` overrides ``L_b`` (truncating or extending with no-route tokens). Padding
    positions have no route (Megatron routes them too, so they get fillers).
    """
    B = len(samples)
    S = int(seq_len)
    rec, tok, smp, off, pos = _empty(B, S)
    for b, sm in enumerate(samples):
        L = len(sm) if lengths is None else int(lengths[b])
        if L > S:
            raise RouteAlignmentError(f"sample {b} has {L} tokens, more than seq_len={S}")
        sm = sm.resized(L)
        s0 = 0 if padding_side == "right" else S - L
        rec[b, s0 : s0 + L] = sm.record
        tok[b, s0 : s0 + L] = sm.token
        smp[b, s0 : s0 + L] = b
        off[b, s0 : s0 + L] = np.arange(L, dtype=np.int32)
    if padding_side not in ("right", "left"):
        raise RouteAlignmentError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    if records is not None:
        _check_rows([SampleMap(rec[b], tok[b]) for b in range(B)], records)
    return PositionMap(rec, tok, smp, off, pos)


def cp_zigzag_index(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Indices along ``S`` that ``megatron.core.utils.get_batch_on_this_cp_rank`` keeps on
    ``cp_rank``: chunks ``r`` and ``2 * cp_size - 1 - r`` of ``2 * cp_size`` equal chunks
    (int64)."""
    if not 0 <= cp_rank < cp_size:
        raise RouteAlignmentError(f"cp_rank={cp_rank} out of range for CP={cp_size}")
    if seq_len % (2 * cp_size):
        raise RouteAlignmentError(
            f"sequence length {seq_len} is not divisible by 2*CP={2 * cp_size}"
        )
    c = seq_len // (2 * cp_size)
    a = cp_rank * c
    b = (2 * cp_size - 1 - cp_rank) * c
    return np.concatenate([np.arange(a, a + c), np.arange(b, b + c)])


def thd_cp_index(
    cu_seqlens_padded: np.ndarray | Sequence[int], cp_size: int, cp_rank: int, *, total: int
) -> np.ndarray:
    """Indices of a THD pack kept on ``cp_rank`` (Transformer Engine's
    ``thd_get_partitioned_indices``): each sequence's padded span is cut into ``2 * cp_size``
    chunks, the rank keeps chunks ``r`` and ``2 * cp_size - 1 - r`` of every sequence (int64)."""
    cup = np.asarray(cu_seqlens_padded, dtype=np.int64)
    if not 0 <= cp_rank < cp_size:
        raise RouteAlignmentError(f"cp_rank={cp_rank} out of range for CP={cp_size}")
    if int(cup[-1]) != total:
        raise RouteAlignmentError(
            f"cu_seqlens_padded ends at {int(cup[-1])} but the pack has {total} tokens"
        )
    plens = np.diff(cup)
    bad = np.flatnonzero(plens % (2 * cp_size))
    if bad.size:
        i = int(bad[0])
        raise RouteAlignmentError(
            f"sequence {i}'s padded length {int(plens[i])} is not divisible by 2*CP={2 * cp_size}"
        )
    c = plens // (2 * cp_size)
    parts = []
    for i in range(len(plens)):
        s0, ci = int(cup[i]), int(c[i])
        a = s0 + cp_rank * ci
        b = s0 + (2 * cp_size - 1 - cp_rank) * ci
        parts.append(np.arange(a, a + ci))
        parts.append(np.arange(b, b + ci))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
