"""Alignment of route records to packed batches: pure numpy, no Megatron."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay.client import RouteRecord
from routereplay.trainer_adapter import (
    NO_ROUTE,
    PositionMap,
    ReplayTargets,
    RouteAlignmentError,
    RouteLayerMismatchError,
    TargetShapeError,
    TokenMismatchError,
    cp_zigzag_index,
    filler_experts,
    gather_targets,
    moe_layer_pattern,
    multi_turn_sample,
    padded_position_map,
    sample_from_record,
    shared_prefix_sample,
    thd_cp_index,
    thd_position_map,
)

L = 6
MOE = (1, 2, 4, 5)  # layers 0 and 3 dense
E = 16
K = 4


def make_record(rng, tokens, *, prompt_len=2, num_experts=E, moe=MOE, top_k=K) -> RouteRecord:
    """As vLLM returns it: [T-1, L, K], dense layers zero, the last token unrouted."""
    T = len(tokens)
    arr = np.zeros((T - 1, L, top_k), np.int64)
    for layer in moe:
        arr[:, layer] = np.argsort(rng.random((T - 1, num_experts)), 1)[:, :top_k]
    return RouteRecord.from_engine(
        arr,
        tokens,
        prompt_len=prompt_len,
        num_experts=num_experts,
        moe_layers=moe,
        num_layers=L,
    )


def naive_truth(pm: PositionMap, records, layers, num_experts=E, top_k=K) -> np.ndarray:
    """[M, S*B, K] by a per-position loop, sequence-major: the reference for gather_targets."""
    B, S = pm.shape
    out = np.zeros((len(layers), S * B, top_k), np.int64)
    for s in range(S):
        for b in range(B):
            r, t, p = int(pm.record[b, s]), int(pm.token[b, s]), int(pm.position[b, s])
            if r >= 0 and records[r].valid[t]:
                for i, layer in enumerate(layers):
                    out[i, s * B + b] = records[r].experts[t, records[r].moe_layers.index(layer)]
            else:
                out[:, s * B + b] = filler_experts(np.array([p]), num_experts, top_k)[0]
    return out


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_moe_layer_pattern_maps_global_layers():
    assert moe_layer_pattern(4, [0, 1, 1, 1]) == (1, 2, 3)
    assert moe_layer_pattern(6, 2) == (0, 2, 4)
    assert moe_layer_pattern(6, 1, first_k_dense=2) == (2, 3, 4, 5)
    with pytest.raises(RouteLayerMismatchError, match="lists 3 layers but the model has 4"):
        moe_layer_pattern(4, [0, 1, 1])


def test_thd_pack_rows_fillers_and_padding(rng):
    recs = [make_record(rng, rng.integers(0, 999, n)) for n in (7, 5, 9)]
    samples = [sample_from_record(i, r) for i, r in enumerate(recs)]
    cu = [0, 7, 12, 21]
    cup = [0, 8, 14, 24]
    pm = thd_position_map(samples, cu, cu_seqlens_padded=cup, records=recs)
    assert pm.shape == (1, 24)
    ids = np.zeros((1, 24), np.int64)
    for i, r in enumerate(recs):
        ids[0, cup[i] : cup[i] + r.num_tokens] = r.token_ids
    tg = gather_targets(pm, recs, MOE, input_ids=ids)
    assert tg.experts.shape == (4, 24, K) and tg.experts.dtype == np.uint8
    assert tg.layers == MOE
    np.testing.assert_array_equal(tg.experts, naive_truth(pm, recs, MOE))
    # record 0's rows sit at 0..5; its last token (6) and the padding (7) are fillers
    np.testing.assert_array_equal(tg.layer(2)[:6], recs[0].experts[:6, 1])
    np.testing.assert_array_equal(
        tg.experts[:, 7], np.broadcast_to(filler_experts([7], E, K), (4, K))
    )
    # 3 last tokens + 3 padding rows
    assert tg.filler_rows == 3 + 3


def test_fillers_distinct_deterministic_spread():
    f = filler_experts(np.arange(1000), 128, 8)
    assert f.dtype == np.uint8
    assert all(len(set(row)) == 8 for row in f.tolist())
    np.testing.assert_array_equal(f, filler_experts(np.arange(1000), 128, 8))
    counts = np.bincount(f.ravel(), minlength=128)
    assert counts.max() - counts.min() <= 1  # padding does not pile onto one expert
    f16 = filler_experts(np.arange(10), 300, 6)
    assert f16.dtype == np.uint16 and all(len(set(r)) == 6 for r in f16.tolist())


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_sequence_major(rng, side):
    recs = [make_record(rng, rng.integers(0, 999, n)) for n in (5, 8, 3)]
    pm = padded_position_map(
        [sample_from_record(i, r) for i, r in enumerate(recs)], 10, padding_side=side, records=recs
    )
    tg = gather_targets(pm, recs, MOE)
    truth = naive_truth(pm, recs, MOE)
    np.testing.assert_array_equal(tg.experts, truth)
    B = 3
    # row s * B + b holds sample b's token at s
    s0 = 0 if side == "right" else 10 - 8
    np.testing.assert_array_equal(tg.layer(4)[s0 * B + 1], recs[1].experts[0, 2])


def test_shared_prefix_group(rng):
    prompt = rng.integers(0, 999, 5)
    recs = [
        make_record(rng, np.concatenate([prompt, rng.integers(0, 999, n)]), prompt_len=5)
        for n in (3, 6)
    ]
    sm = shared_prefix_sample([0, 1], recs)
    assert len(sm) == 5 + 3 + 6
    np.testing.assert_array_equal(sm.record, [0] * 5 + [0] * 3 + [1] * 6)
    np.testing.assert_array_equal(sm.token, [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10])
    pm = thd_position_map([sm], [0, 14])
    ids = np.concatenate([prompt, recs[0].token_ids[5:], recs[1].token_ids[5:]])
    tg = gather_targets(pm, recs, MOE, input_ids=ids)
    np.testing.assert_array_equal(tg.experts, naive_truth(pm, recs, MOE))
    # The first request's prompt rows 1..2 were lost (e.g. a prefix-cache hit): take record 1's.
    recs[0].valid[1:3] = False
    sm = shared_prefix_sample([0, 1], recs)
    np.testing.assert_array_equal(sm.record[:5], [0, 1, 1, 0, 0])
    bad = make_record(
        rng, np.concatenate([prompt[:4], [1000], rng.integers(0, 9, 2)]), prompt_len=5
    )
    with pytest.raises(TokenMismatchError, match=r"sample 3 position 4: trainer token id"):
        shared_prefix_sample([0, 1], [*recs[:1], bad], sample=3)


def test_multi_turn_takes_earliest_valid_row(rng):
    t1 = rng.integers(0, 999, 6)
    turn1 = make_record(rng, t1, prompt_len=3)
    turn2 = make_record(rng, np.concatenate([t1, rng.integers(0, 999, 5)]), prompt_len=8)
    sm = multi_turn_sample([0, 1], [turn1, turn2])
    # rows 0..4 from turn 1 (decode-time routes), row 5 (turn 1's last sampled token) from turn 2
    np.testing.assert_array_equal(sm.record, [0] * 5 + [1] * 6)
    np.testing.assert_array_equal(sm.token, np.arange(11))
    pm = thd_position_map([sm], [0, 11], records=[turn1, turn2])
    tg = gather_targets(pm, [turn1, turn2], MOE, input_ids=turn2.token_ids)
    np.testing.assert_array_equal(tg.layer(1)[:5], turn1.experts[:5, 0])
    np.testing.assert_array_equal(tg.layer(1)[5:10], turn2.experts[5:10, 0])
    last = multi_turn_sample([0, 1], [turn1, turn2], prefer="last")
    np.testing.assert_array_equal(last.record, [1] * 11)
    drifted = turn2.token_ids.copy()
    drifted[4] += 1
    turn2b = RouteRecord(drifted, turn2.experts, turn2.valid, MOE, L, E, prompt_len=8)
    with pytest.raises(TokenMismatchError, match="sample 9 position 4"):
        multi_turn_sample([0, 1], [turn1, turn2b], sample=9)


def test_token_mismatch_names_sample_position_and_ids(rng):
    recs = [make_record(rng, np.arange(10, 16)), make_record(rng, np.arange(20, 25))]
    pm = thd_position_map(
        [sample_from_record(0, recs[0]), sample_from_record(1, recs[1])], [0, 6, 11]
    )
    ids = np.concatenate([np.arange(10, 16), np.arange(20, 25)])
    ids[6 + 3] = 99
    with pytest.raises(TokenMismatchError) as ei:
        gather_targets(pm, recs, MOE, input_ids=ids)
    e = ei.value
    assert (e.sample, e.position, e.expected, e.found) == (1, 3, 99, 23)
    assert "sample 1 position 3: trainer token id 99 but the route record has 23" in str(e)


@pytest.mark.parametrize("n_records,length", [(10, 50), (40, 3)])
def test_token_check_run_by_run_and_at_once(rng, n_records, length):
    # 10 long runs: checked run by run (slices); 40 runs of 3 positions: all positions at once.
    # Both name the first mismatching position; rows past a record's end are left to the
    # map's own check (thd_position_map(records=...)), as before.
    recs = [make_record(rng, rng.integers(0, 999, length)) for _ in range(n_records)]
    cu = np.arange(n_records + 1) * length
    pm = thd_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], cu)
    assert len(pm.runs) == n_records
    # The records a map reads, ascending, whichever way they are found (runs or every position).
    rev = thd_position_map(
        [sample_from_record(i, recs[i]).resized(length + 2) for i in range(n_records)][::-1],
        np.arange(n_records + 1) * (length + 2),
    )  # records in reverse order, each with two no-route positions after it
    for m in (pm, rev):
        np.testing.assert_array_equal(m.used_records, np.unique(m.record[m.record >= 0]))
    ids = np.concatenate([r.token_ids for r in recs])
    pm.check_tokens(recs, ids)  # no mismatch
    for k, pos in [(n_records - 1, length - 1), (3, 1)]:
        bad = ids.copy()
        bad[cu[k] + pos] += 1
        bad[cu[-1] - 1] += 7  # a later mismatch too: the first one is named
        with pytest.raises(TokenMismatchError) as ei:
            pm.check_tokens(recs, bad)
        e = ei.value
        assert (e.sample, e.position) == (k, pos)
        assert (e.expected, e.found) == (bad[cu[k] + pos], recs[k].token_ids[pos])


def test_layers_by_global_number_not_offset(rng):
    recs = [make_record(rng, rng.integers(0, 999, 6))]
    pm = thd_position_map([sample_from_record(0, recs[0])], [0, 6])
    # a pipeline stage holding global layers 4 and 5 gets record columns 2 and 3
    tg = gather_targets(pm, recs, (4, 5))
    np.testing.assert_array_equal(tg.experts[0, :5], recs[0].experts[:5, 2])
    np.testing.assert_array_equal(tg.experts[1, :5], recs[0].experts[:5, 3])
    # VPP: non-contiguous chunks (1, 5)
    tg = gather_targets(pm, recs, (1, 5))
    np.testing.assert_array_equal(tg.experts[1, :5], recs[0].experts[:5, 3])
    with pytest.raises(
        RouteLayerMismatchError, match=r"no routes for the model's MoE layers \[3\]"
    ):
        gather_targets(pm, recs, (2, 3))


def test_wide_expert_ids_stay_uint16(rng):
    recs = [make_record(rng, rng.integers(0, 999, 9), num_experts=512, top_k=8)]
    pm = thd_position_map([sample_from_record(0, recs[0])], [0, 9])
    tg = gather_targets(pm, recs, MOE)
    assert tg.experts.dtype == np.uint16
    np.testing.assert_array_equal(tg.experts, naive_truth(pm, recs, MOE, 512, 8))
    t = tg.to_torch()
    assert t.dtype.is_floating_point is False and tuple(t.shape) == (4, 9, 8)


def test_record_rows_and_counts_checked(rng):
    recs = [make_record(rng, rng.integers(0, 999, 4))]
    sm = sample_from_record(0, recs[0]).resized(6)  # trainer appended two tokens
    assert list(sm.record[-2:]) == [NO_ROUTE, NO_ROUTE]
    with pytest.raises(RouteAlignmentError, match="2 samples need cu_seqlens of 3 entries"):
        thd_position_map([sm, sm], [0, 6])
    bad = sample_from_record(0, recs[0])
    bad.token[1] = 50
    with pytest.raises(RouteAlignmentError, match="sample 0 position 1 maps to row 50"):
        thd_position_map([bad], [0, 4], records=recs)


def test_cp_zigzag_and_thd_partition():
    np.testing.assert_array_equal(cp_zigzag_index(16, 2, 0), [0, 1, 2, 3, 12, 13, 14, 15])
    np.testing.assert_array_equal(cp_zigzag_index(16, 2, 1), [4, 5, 6, 7, 8, 9, 10, 11])
    cup = np.array([0, 8, 12, 24])
    r0 = thd_cp_index(cup, 2, 0, total=24)
    r1 = thd_cp_index(cup, 2, 1, total=24)
    np.testing.assert_array_equal(r0, [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23])
    assert sorted(np.concatenate([r0, r1]).tolist()) == list(range(24))
    with pytest.raises(RouteAlignmentError, match="sequence 1's padded length 4"):
        thd_cp_index([0, 8, 12], 4, 0, total=12)


@pytest.mark.parametrize("B", [1, 3])
def test_sp_slices_concatenate_to_the_whole(rng, B):
    recs = [make_record(rng, rng.integers(0, 999, n)) for n in (9, 12, 5)][:B]
    pm = padded_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], 16)
    full = gather_targets(pm, recs, MOE).experts
    parts = [gather_targets(pm.sp_shard(4, r), recs, MOE).experts for r in range(4)]
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), full)
    with pytest.raises(RouteAlignmentError, match="not divisible by TP=3"):
        pm.sp_shard(3, 0)


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    pad=st.integers(0, 3),
    cp=st.sampled_from([1, 2]),
    tp=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_property_local_targets_equal_naive_lookup(lens, pad, cp, tp, seed):
    """Any THD pack, any CP x SP rank: gathered rows == per-position lookup of the sliced map,
    and all ranks together cover every packed position exactly once."""
    rng = np.random.default_rng(seed)
    recs = [make_record(rng, rng.integers(0, 999, n + 1)) for n in lens]
    for r in recs:  # some unroutable rows inside the records too
        r.valid[rng.random(r.num_tokens) < 0.1] = False
    mult = 2 * cp * tp
    real = np.array([r.num_tokens for r in recs])
    plens = -(-(real + pad) // mult) * mult
    cu = np.concatenate([[0], np.cumsum(real)])
    cup = np.concatenate([[0], np.cumsum(plens)])
    pm = thd_position_map(
        [sample_from_record(i, r) for i, r in enumerate(recs)],
        cu,
        cu_seqlens_padded=cup,
        records=recs,
    )
    seen = []
    for c in range(cp):
        for t in range(tp):
            loc = pm.local(cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t, cu_seqlens_padded=cup)
            tg = gather_targets(loc, recs, (2, 5))
            np.testing.assert_array_equal(tg.experts, naive_truth(loc, recs, (2, 5)))
            seen.append(loc.position.ravel())
    assert sorted(np.concatenate(seen).tolist()) == list(range(int(cup[-1])))


def test_pinned_targets_need_cuda_and_must_be_the_arrays_tensor(rng):
    """The page-locked output is refused, by name, where torch has no accelerator (tests/gpu/
    pinned_check.py runs it on one); a ReplayTargets whose ``pinned`` is not the tensor its
    ``experts`` views is refused, since to_torch would copy other rows to the GPU."""
    import torch

    from routereplay.trainer_adapter import ReplayConfigError, ReplayTargets, TargetShapeError

    recs = [make_record(rng, rng.integers(0, 999, n)) for n in (5, 8)]
    pm = padded_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], 8)
    if not torch.cuda.is_available():
        with pytest.raises(ReplayConfigError, match=r"pin_memory=True\) needs an accelerator"):
            gather_targets(pm, recs, MOE, pin_memory=True)
    tg = gather_targets(pm, recs, MOE)
    assert tg.pinned is None
    own = torch.from_numpy(tg.experts)
    ok = ReplayTargets(tg.layers, tg.experts, E, pinned=own)  # the same memory: accepted
    assert ok.pinned is own and torch.equal(ok.to_torch(), own.to(torch.int64))
    with pytest.raises(TargetShapeError, match="pinned must be the tensor"):
        ReplayTargets(tg.layers, tg.experts, E, pinned=own.clone())
    with pytest.raises(TargetShapeError, match="pinned must be the tensor"):
        ReplayTargets(tg.layers, tg.experts[:, :4], E, pinned=own)
    # A rank with no rows: torch gives an empty tensor no address, numpy one; still accepted.
    empty = torch.empty(0, dtype=torch.uint8).view(len(MOE), 0, K)
    assert ReplayTargets(tg.layers, empty.numpy(), E, pinned=empty).num_tokens == 0


@pytest.mark.parametrize("name", ["valid", "replay_mask"])
@pytest.mark.parametrize(
    "mask",
    [np.ones(5, np.uint8), np.ones(4, bool), np.ones((6, 1), bool), np.ones(6, np.int64)],
    ids=["uint8", "short", "2d", "int64"],
)
def test_row_masks_are_checked_where_the_targets_are_made(name: str, mask: np.ndarray) -> None:
    """A wrong ``valid`` or ``replay_mask`` fails here, naming the field, not in a transport."""
    experts = np.zeros((2, 6, 2), np.uint8)
    with pytest.raises(TargetShapeError, match=rf"{name} must be \[N=6\] bool"):
        ReplayTargets((0, 1), experts, 4, **{name: mask})
    ReplayTargets((0, 1), experts, 4, **{name: np.ones(6, bool)})
