"""Records read from a store stay their chunks until their rows are asked for; gather_targets
copies from the chunks. Read through the store's own read path (plan_put's bytes, plan_read and
finish_read),
without Redis: the layout code is the same one RouteStore runs."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay.client import RouteCorruptError, RouteRecord
from routereplay.client._keys import KeySchema
from routereplay.client._layout import StoredRecord, finish_read, plan_put, plan_read
from routereplay.trainer_adapter import (
    TargetBuffers,
    gather_targets,
    multi_turn_sample,
    padded_position_map,
    sample_from_record,
    shared_prefix_sample,
    thd_position_map,
)

_targets = importlib.import_module("routereplay.trainer_adapter._targets")

E, K, L = 16, 3, 5
MOE = (1, 2, 4)  # layers 0 and 3 dense


def _record(rng, tokens, prompt_len=0) -> RouteRecord:
    T = len(tokens)
    experts = np.argsort(rng.random((T, len(MOE), E)), axis=2)[:, :, :K].astype(np.uint8)
    valid = rng.random(T) > 0.1
    return RouteRecord(token_ids=tokens, experts=experts, valid=valid, moe_layers=MOE,
                       num_layers=L, num_experts=E, prompt_len=prompt_len)  # fmt: skip


def _stored(records, block_size, start=0):
    """``records`` written with ``plan_put`` and read back through ``plan_read``."""
    keys = KeySchema("t")
    ids, manifests, chunks = [], [], {}
    for i, r in enumerate(records):
        plan = plan_put(keys, f"r{i}", r, block_size)
        ids.append(f"r{i}")
        manifests.append(plan.manifest_blob)
        for j, key in enumerate(plan.chunk_keys):
            chunks[bytes.fromhex(key.split("{")[1].rstrip("}"))] = plan.chunk_blob(j)
    return finish_read(plan_read(ids, manifests, start), chunks)


def _plain(s: StoredRecord) -> RouteRecord:
    """The same record with its rows joined, built from its parts (``s`` stays unjoined)."""
    lm = np.concatenate([a for _, a in s.layer_major_parts()], axis=1)
    fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "experts"}
    return RouteRecord(experts=lm.transpose(1, 0, 2), **fields)


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(2, 40), min_size=1, max_size=5),
    block=st.sampled_from([1, 3, 8, 64]),
    cp=st.sampled_from([1, 2]),
    tp=st.sampled_from([1, 2]),
    layers=st.sampled_from([MOE, (2,), (1, 4)]),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 3]),
)
def test_gather_from_chunks_equals_gather_from_joined_rows(
    lens, block, cp, tp, layers, seed, threads
):
    """``threads=3``: the copies split over three threads, as they are for large outputs (the
    ranges cut runs of one record, and chunk boundaries, anywhere)."""
    split = mock.patch.multiple(_targets, _SPLIT_BYTES=0, default_decode_threads=lambda: threads)
    with split:
        _gather_from_chunks_equals_gather_from_joined_rows(lens, block, cp, tp, layers, seed)


def _gather_from_chunks_equals_gather_from_joined_rows(lens, block, cp, tp, layers, seed):
    rng = np.random.default_rng(seed)
    recs = [_record(rng, rng.integers(0, 999, n)) for n in lens]
    stored = _stored(recs, block)
    assert all(isinstance(s, StoredRecord) for s in stored)
    plain = [_plain(s) for s in stored]
    mult = 2 * cp * tp
    real = np.array([r.num_tokens for r in recs])
    cu = np.concatenate([[0], np.cumsum(real)])
    cup = np.concatenate([[0], np.cumsum(-(-(real + 1) // mult) * mult)])
    samples = [sample_from_record(i, r) for i, r in enumerate(recs)]
    pm = thd_position_map(samples, cu, cu_seqlens_padded=cup, records=recs)
    tb = TargetBuffers(keep=1)
    for c in range(cp):
        for t in range(tp):
            loc = pm.local(cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t, cu_seqlens_padded=cup)
            got = gather_targets(loc, stored, layers)
            want = gather_targets(loc, plain, layers)
            np.testing.assert_array_equal(got.experts, want.experts)
            np.testing.assert_array_equal(got.valid, want.valid)
            # Into recycled memory, poisoned after each use: every byte must be written again.
            for _ in range(2):
                pooled = gather_targets(loc, stored, layers, buffers=tb)
                np.testing.assert_array_equal(pooled.experts, want.experts)
                pooled.experts[...] = 0xEE
                del pooled
            # And equal to one thread's copy (both above ran the same split).
            with mock.patch.object(_targets, "_SPLIT_BYTES", 1 << 62):
                one = gather_targets(loc, plain, layers)
            np.testing.assert_array_equal(got.experts, one.experts)
    # The gathers read the chunks: no record was joined.
    for s, r in zip(stored, recs, strict=True):
        assert s._parts is not None and len(s._parts) == -(-r.num_tokens // block)
        assert s == r  # joins them now


def test_padded_shared_prefix_and_multi_turn_layouts_read_chunks() -> None:
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 999, 11)
    group = [_record(rng, np.concatenate([prompt, rng.integers(0, 999, n)]), 11)
             for n in (5, 9, 14)]  # fmt: skip
    turn1 = _record(rng, rng.integers(0, 999, 13), 6)
    turn2 = _record(rng, np.concatenate([turn1.token_ids, rng.integers(0, 999, 7)]), 13)
    recs = [*group, turn1, turn2]
    stored = _stored(recs, 4)
    plain = [_plain(s) for s in stored]
    samples = [
        shared_prefix_sample([0, 1, 2], stored),
        multi_turn_sample([3, 4], stored),
        sample_from_record(1, stored[1]),
    ]
    pm = padded_position_map(samples, 64)
    for shard in range(2):
        sp = pm.sp_shard(2, shard)
        got = gather_targets(sp, stored, (2, 4))
        np.testing.assert_array_equal(got.experts, gather_targets(sp, plain, (2, 4)).experts)
    assert all(s._parts is not None for s in stored)


def test_a_stored_record_behaves_as_a_record() -> None:
    rng = np.random.default_rng(5)
    r = _record(rng, rng.integers(0, 999, 30), 7)
    (s,) = _stored([r], 8)
    tail = _stored([r], 8, start=13)[0]
    parts = s.layer_major_parts()
    assert [p0 for p0, _ in parts] == [0, 8, 16, 24]
    assert [p0 for p0, _ in tail.layer_major_parts()] == [0, 3, 11]  # rows 13.. of 30
    assert tail == r.rows(13)
    assert pickle.loads(pickle.dumps(s)) == r
    assert s.rows(5, 20) == r.rows(5, 20)
    assert s.layer_major().flags.c_contiguous and s.layer_major().shape == (len(MOE), 30, K)
    assert s.experts.flags.writeable  # joined into an array of its own
    s.experts[0, 0, 0] = (s.experts[0, 0, 0] + 1) % E
    assert s != r
    s.experts = r.experts.copy()
    assert s == r and s.layer_major_parts()[0][0] == 0
    assert dataclasses.replace(s, prompt_len=3).prompt_len == 3


def test_a_chunk_with_ids_past_num_experts_is_corrupt() -> None:
    rng = np.random.default_rng(9)
    good = _record(rng, rng.integers(0, 999, 20))
    bad = _record(rng, rng.integers(0, 999, 20))
    bad.experts[17, 1, 0] = E + 3  # past validation, as a writer that skips it would store it
    ok, broken = _stored([good, bad], 8)
    assert ok == good
    assert isinstance(broken, RouteCorruptError)
    assert f"expert id {E + 3} >= num_experts={E}" in str(broken) and "chunk 2" in str(broken)
    # The same id in the rows a read from row 10 skips... is still in its chunk 1: refused too;
    # a read from row 18 does not include it.
    assert isinstance(_stored([bad], 8, start=10)[0], RouteCorruptError)
    assert isinstance(_stored([bad], 8, start=18)[0], StoredRecord)


def test_the_store_decodes_the_same_records_on_a_pool(redis_url) -> None:
    from routereplay.client import RouteStore

    rng = np.random.default_rng(11)
    recs = [_record(rng, rng.integers(0, 999, n)) for n in (40, 3, 70)]
    with RouteStore.from_url(redis_url, prefix="stored", block_size=8, decode_threads=3) as st:
        for i, r in enumerate(recs):
            st.put(f"s{i}", r)
        got = st.get_many(["s0", "s1", "s2"])
    assert got == recs and all(isinstance(g, StoredRecord) for g in got)


@pytest.mark.parametrize("start", [0, 7])
def test_empty_tail_reads(start: int) -> None:
    rng = np.random.default_rng(1)
    r = _record(rng, rng.integers(0, 999, 7))
    (s,) = _stored([r], 4, start=start)
    assert s == r.rows(start) and s.experts.shape == (7 - start, len(MOE), K)


def test_threads_joining_one_record_at_once_all_get_its_rows() -> None:
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(2)
    recs = [_record(rng, rng.integers(0, 999, 300)) for _ in range(20)]
    stored = _stored(recs, 2)
    with ThreadPoolExecutor(8) as pool:
        for s, r in zip(stored, recs, strict=True):
            outs = list(pool.map(lambda _, s=s: s.experts.copy(), range(8)))
            assert all(np.array_equal(o, r.experts) for o in outs)


def test_chunks_stored_in_token_order_gather_the_same_targets() -> None:
    """Chunks in the token order decode to strided layer-major views; the gather copies from
    those views exactly as from contiguous ones."""
    from routereplay.client import _frame, _transforms

    rng = np.random.default_rng(21)
    recs = []
    for n in (300, 170):
        tok = rng.integers(0, 20, n)
        table = np.argsort(rng.random((20, len(MOE), E)), axis=2)[:, :, :2].astype(np.uint8)
        recs.append(RouteRecord(token_ids=tok, experts=table[tok], valid=np.ones(n, bool),
                                moe_layers=MOE, num_layers=L, num_experts=E))  # fmt: skip
    keys = KeySchema("t")
    plan = plan_put(keys, "r0", recs[0], 64)
    payload = _frame.unframe(plan.chunk_blob(0), _frame.KIND_CHUNK, "c")
    assert payload[12] == _transforms.XF_TOKENS  # the chunk header's xf (docs/CONTRACTS.md)
    stored = _stored(recs, 64)
    assert not stored[0].layer_major_parts()[0][1].flags.c_contiguous  # strided views
    plain = [_plain(s) for s in stored]
    cu = np.concatenate([[0], np.cumsum([r.num_tokens for r in recs])])
    cup = np.concatenate([[0], np.cumsum([304, 172])])
    pm = thd_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], cu,
                          cu_seqlens_padded=cup, records=recs)  # fmt: skip
    for c in range(2):
        loc = pm.local(cp_size=2, cp_rank=c, tp_size=1, tp_rank=0, cu_seqlens_padded=cup)
        got = gather_targets(loc, stored, (2, 4))
        np.testing.assert_array_equal(got.experts, gather_targets(loc, plain, (2, 4)).experts)
    assert stored == recs
