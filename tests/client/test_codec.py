"""Route record codec: lossless round trips (property-based) and specific decode errors."""

from __future__ import annotations

import struct
import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routereplay.client import (
    FORMAT_VERSION,
    RouteCorruptError,
    RouteForeignFormatError,
    RouteRecord,
    RouteShapeError,
    RouteTruncatedError,
    RouteVersionError,
    decode_record,
    encode_record,
    expert_dtype,
)


@st.composite
def records(draw: st.DrawFn) -> RouteRecord:
    num_experts = draw(st.sampled_from([1, 2, 8, 128, 255, 256, 257, 300, 1024, 65536]))
    top_k = draw(st.integers(1, min(num_experts, 9)))
    num_layers = draw(st.integers(1, 6))
    moe = sorted(draw(st.sets(st.integers(0, num_layers - 1), min_size=1)))
    T = draw(st.sampled_from([0, 1, 2, 3, 7, 64, 129]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    style = draw(st.sampled_from(["distinct", "repeat", "zeros", "max"]))
    shape = (T, len(moe), top_k)
    dt = expert_dtype(num_experts)
    if style == "distinct":
        experts = np.argsort(rng.random((T * len(moe), num_experts)), axis=1)[:, :top_k]
    elif style == "repeat":  # neighbouring tokens share experts: exercises the delta transform
        base = rng.integers(0, num_experts, (1, len(moe), top_k))
        experts = np.repeat(base, T, axis=0)
        flip = rng.random(shape) < 0.2
        experts = np.where(flip, rng.integers(0, num_experts, shape), experts)
    elif style == "zeros":
        experts = np.zeros(shape)
    else:
        experts = np.full(shape, num_experts - 1)
    prompt_len = draw(st.integers(0, T))
    return RouteRecord(
        token_ids=rng.integers(0, 2**32, T, dtype=np.int64),
        experts=np.asarray(experts).reshape(shape).astype(dt),
        valid=rng.random(T) < draw(st.sampled_from([0.0, 0.5, 1.0])),
        moe_layers=moe,
        num_layers=num_layers,
        num_experts=num_experts,
        prompt_len=prompt_len,
        num_cached_tokens=draw(st.integers(0, prompt_len)),
        model=draw(st.text(max_size=12)),
        metadata=draw(st.dictionaries(st.text(max_size=5), st.integers(-5, 5), max_size=3)),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records())
def test_round_trip_is_exact(record: RouteRecord) -> None:
    out = decode_record(encode_record(record))
    assert out == record
    assert out.experts.flags.writeable
    assert out.experts.dtype == record.experts.dtype
    assert out.experts.shape == record.experts.shape


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records())
def test_canonical_order_keeps_each_row_as_a_set(record: RouteRecord) -> None:
    out = decode_record(encode_record(record, canonical_order=True))
    assert np.array_equal(out.experts, np.sort(record.experts, axis=-1))
    assert np.array_equal(out.token_ids, record.token_ids)
    assert np.array_equal(out.valid, record.valid)


def _record(T: int = 40, E: int = 128) -> RouteRecord:
    rng = np.random.default_rng(1)
    x = np.argsort(rng.random((T * 3, E)), axis=1)[:, :4].reshape(T, 3, 4)
    return RouteRecord(
        token_ids=np.arange(T),
        experts=x.astype(expert_dtype(E)),
        valid=np.ones(T, bool),
        moe_layers=[1, 2, 3],
        num_layers=4,
        num_experts=E,
        prompt_len=10,
    )


def test_truncated_blob_names_truncation() -> None:
    blob = encode_record(_record())
    for cut in (3, 10, len(blob) // 2, len(blob) - 1):
        with pytest.raises(RouteTruncatedError, match="truncated"):
            decode_record(blob[:cut])


def test_corrupted_byte_fails_checksum() -> None:
    blob = bytearray(encode_record(_record()))
    blob[-5] ^= 0x40
    with pytest.raises(RouteCorruptError, match="checksum"):
        decode_record(bytes(blob))


def test_foreign_bytes_are_named_foreign() -> None:
    with pytest.raises(RouteForeignFormatError, match="magic"):
        decode_record(b"\x93NUMPY\x01\x00" + b"\x00" * 40)
    with pytest.raises(RouteForeignFormatError):
        decode_record(b"{}")


def test_newer_version_is_refused_with_version_error() -> None:
    blob = bytearray(encode_record(_record()))
    blob[4] = FORMAT_VERSION + 1
    with pytest.raises(RouteVersionError, match=f"version {FORMAT_VERSION + 1}"):
        decode_record(bytes(blob))


def test_well_framed_but_inconsistent_payload_is_corrupt() -> None:
    # A valid frame and checksum around a body that lies about its shape.
    blob = encode_record(_record())
    payload = msgpack.unpackb(blob[16:], raw=False)
    payload["T"] += 1
    body = msgpack.packb(payload, use_bin_type=True)
    forged = struct.pack("<4sBBHII", b"RRTE", 1, 1, 0, len(body), zlib.crc32(body)) + body
    with pytest.raises(RouteCorruptError, match="cannot hold T=41"):
        decode_record(forged)


def test_uniform_routes_compress_near_information_bound() -> None:
    import math

    rng = np.random.default_rng(0)
    T, M, K, E = 2048, 8, 8, 128
    x = np.argsort(rng.random((T * M, E)), axis=1)[:, :K].reshape(T, M, K).astype(np.uint8)
    rec = RouteRecord(
        token_ids=np.zeros(T, np.int64),
        experts=x,
        valid=np.ones(T, bool),
        moe_layers=range(M),
        num_layers=M,
        num_experts=E,
    )
    ordered = sum(math.log2(E - i) for i in range(K)) * T * M / 8
    unordered = math.log2(math.comb(E, K)) * T * M / 8
    assert len(encode_record(rec)) < 1.10 * ordered
    assert len(encode_record(rec, canonical_order=True)) < 1.10 * unordered


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 20),
    st.integers(0, 50),
    st.sampled_from([np.uint8, np.uint16]),
    st.integers(0, 2**32 - 1),
)
def test_sorting_network_sorts_like_numpy(k: int, n: int, dtype: type, seed: int) -> None:
    from routereplay.client._transforms import sort_rows

    a = np.random.default_rng(seed).integers(0, 6 if seed % 2 else 60000, (n, 3, k)).astype(dtype)
    assert np.array_equal(sort_rows(a), np.sort(a, axis=-1))


def test_record_validation_names_the_problem() -> None:
    with pytest.raises(RouteShapeError, match="dtype must be uint16"):
        RouteRecord(
            token_ids=[1],
            experts=np.zeros((1, 1, 1), np.uint8),
            valid=[True],
            moe_layers=[0],
            num_layers=1,
            num_experts=257,
        )
    with pytest.raises(RouteShapeError, match="expert id 9 >= num_experts=8"):
        RouteRecord(
            token_ids=[1],
            experts=np.full((1, 1, 1), 9, np.uint8),
            valid=[True],
            moe_layers=[0],
            num_layers=1,
            num_experts=8,
        )
    with pytest.raises(RouteShapeError, match="2 rows but token_ids has 1"):
        RouteRecord(
            token_ids=[1],
            experts=np.zeros((2, 1, 1), np.uint8),
            valid=[True],
            moe_layers=[0],
            num_layers=1,
            num_experts=8,
        )


def test_from_engine_refuses_ids_that_do_not_fit() -> None:
    arr = np.zeros((3, 2, 2), np.int64)
    arr[1, 1, 0] = 300
    with pytest.raises(RouteShapeError, match="300"):
        RouteRecord.from_engine(arr, np.arange(4), prompt_len=2, num_experts=256, moe_layers=[0, 1])
    arr[1, 1, 0] = -1
    with pytest.raises(RouteShapeError, match="-1"):
        RouteRecord.from_engine(arr, np.arange(4), prompt_len=2, num_experts=256, moe_layers=[0, 1])
    with pytest.raises(RouteShapeError, match="moe_layers"):
        RouteRecord.from_engine(
            np.zeros((3, 2, 2), np.uint8),
            np.arange(4),
            prompt_len=2,
            num_experts=8,
            moe_layers=[0, 2],
        )


def test_from_engine_refuses_a_row_with_a_repeated_expert() -> None:
    # A router picks K different experts; a repeated id is a capture gone wrong (zero rows, a
    # shifted layout) and would collapse in the trainer's routing map.
    arr = np.tile(np.array([3, 5], np.uint8), (4, 2, 1))
    RouteRecord.from_engine(arr, np.arange(5), prompt_len=2, num_experts=8, moe_layers=[0, 1])
    arr[2, 1] = [6, 6]
    with pytest.raises(RouteShapeError, match=r"row 2, MoE layer 1: expert 6 twice"):
        RouteRecord.from_engine(arr, np.arange(5), prompt_len=2, num_experts=8, moe_layers=[0, 1])


def test_crafted_payloads_with_valid_checksums_are_corrupt_errors() -> None:
    blob = encode_record(_record())
    base = msgpack.unpackb(blob[16:], raw=False)
    for field, value in (("E", 70000), ("body", 5), ("moe", ["a"]), ("E", 4.5)):
        payload = {**base, field: value}
        body = msgpack.packb(payload, use_bin_type=True)
        forged = struct.pack("<4sBBHII", b"RRTE", 1, 1, 0, len(body), zlib.crc32(body)) + body
        with pytest.raises(RouteCorruptError):
            decode_record(forged)


def test_from_engine_drops_dense_layers_by_global_index_and_marks_last_row() -> None:
    T, L, K = 6, 4, 2
    rng = np.random.default_rng(3)
    arr = (np.argsort(rng.random((T - 1, L, 7)), axis=-1)[..., :K] + 1).astype(np.uint8)
    arr[:, 0] = 0  # vLLM returns dense layers as zero rows
    rec = RouteRecord.from_engine(
        arr, np.arange(T), prompt_len=3, num_experts=8, moe_layers=[1, 2, 3]
    )
    assert rec.moe_layers == (1, 2, 3)
    assert np.array_equal(rec.experts[: T - 1], arr[:, 1:])
    assert rec.valid.tolist() == [True] * (T - 1) + [False]
    arr[2, 0, 1] = 5
    with pytest.raises(RouteShapeError, match=r"layers \[0\] are marked dense"):
        RouteRecord.from_engine(
            arr, np.arange(T), prompt_len=3, num_experts=8, moe_layers=[1, 2, 3]
        )
