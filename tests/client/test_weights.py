"""The ``weights`` plane: routing weights stored bit-exact beside the expert ids, in records and
in store chunks (shared prefixes once, addresses covering the weights, slot order kept)."""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
import pytest
import redis

from routereplay.client import (
    EngineRoutes,
    RouteCorruptError,
    RouteRecord,
    RouteShapeError,
    RouteStore,
    _codec,
    decode_record,
    encode_record,
)
from routereplay.client._frame import KIND_RECORD, frame_map, unframe_map

E, K, L = 32, 4, 4
MOE = (1, 2, 3)


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    b = np.asarray(x, np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def routed(rng: np.random.Generator, T: int, dtype: str = "bfloat16") -> tuple:
    """(experts, weights) as a Qwen3-MoE router: softmax, top-k by score, renormalised, in the
    engine's slot order (descending score, so never sorted by id)."""
    logits = rng.normal(size=(T, len(MOE), E)).astype(np.float32)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[..., :K]
    w = np.take_along_axis(p, idx, -1)
    w /= w.sum(-1, keepdims=True)
    if dtype == "bfloat16":
        w = bf16(w)
    elif dtype == "float16":
        w = w.astype(np.float16).astype(np.float32)
    return idx.astype(np.uint8), w.astype(np.float32)


def make(
    tokens: np.ndarray, seed: int, dtype: str | None = "bfloat16", invalid_last: bool = True
) -> RouteRecord:
    T = tokens.shape[0]
    ex, w = routed(np.random.default_rng(seed), T, dtype or "bfloat16")
    valid = np.ones(T, bool)
    if T and invalid_last:
        valid[-1] = False
        ex[-1] = 0
        w[-1] = 0
    return RouteRecord(
        token_ids=tokens, experts=ex, valid=valid, moe_layers=MOE, num_layers=L, num_experts=E,
        model="tiny", weights=None if dtype is None else w, weights_dtype=dtype,
    )  # fmt: skip


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture(scope="module")
def store(redis_url: str) -> RouteStore:
    s = RouteStore.from_url(redis_url, prefix=f"rw{uuid.uuid4().hex[:6]}", block_size=16)
    yield s
    s.close()


def rid() -> str:
    return f"w-{uuid.uuid4().hex[:12]}"


# ---------------------------------------------------------------------------------------------
# record
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_record_blob_round_trips_bit_exact(dtype: str) -> None:
    rec = make(np.arange(70), 1, dtype)
    rec.weights[3, 0, 0] = -0.0  # a sign bit the values alone would lose
    got = decode_record(encode_record(rec))
    assert got == rec and got.weights_dtype == dtype
    assert bits_equal(got.weights, rec.weights)
    assert np.array_equal(got.experts, rec.experts)  # slot order, not sorted
    assert not (np.diff(got.experts.astype(int), axis=2) > 0).all()


def test_any_slot_order_and_any_values_round_trip() -> None:
    rec = make(np.arange(40), 14, "float32")
    rng = np.random.default_rng(14)
    order = rng.permuted(np.tile(np.arange(K), (40, len(MOE), 1)), axis=2)
    w = np.take_along_axis(rec.weights, order, 2)  # slots that do not fall (the plain coding)
    w[:5] = rng.normal(size=(5, len(MOE), K)).astype(np.float32) * 1e30  # signs, large values
    w[5, 0] = [np.inf, -np.inf, np.float32(1e-45), -0.0]  # infinities, a subnormal
    ex = np.take_along_axis(rec.experts, order, 2)
    shuffled = dataclasses.replace(rec, experts=ex, weights=w)
    got = decode_record(encode_record(shuffled))
    assert bits_equal(got.weights, w) and np.array_equal(got.experts, ex)


def test_empty_record_with_weights() -> None:
    rec = make(np.arange(0), 15)
    got = decode_record(encode_record(rec))
    assert got == rec and got.weights.shape == (0, len(MOE), K)


def test_slot_order_cannot_be_canonicalised_with_weights(store: RouteStore) -> None:
    rec = make(np.arange(20), 2)
    with pytest.raises(RouteShapeError, match="slot order"):
        encode_record(rec, canonical_order=True)
    with pytest.raises(RouteShapeError, match="slot order"):
        store.put(rid(), rec, canonical_order=True)


def test_record_checks_its_weights() -> None:
    rec = make(np.arange(10), 3)
    with pytest.raises(RouteShapeError, match="not exactly a bfloat16"):
        dataclasses.replace(rec, weights=rec.weights + np.float32(1e-6))
    with pytest.raises(RouteShapeError, match="shape"):
        dataclasses.replace(rec, weights=rec.weights[:, :2])
    with pytest.raises(RouteShapeError, match="weights_dtype"):
        dataclasses.replace(rec, weights_dtype="int8")
    with pytest.raises(RouteShapeError, match="without weights"):
        dataclasses.replace(rec, weights=None)
    w = rec.weights.copy()
    w[-1, 0, 0] = 0.5
    with pytest.raises(RouteShapeError, match="valid is False"):
        dataclasses.replace(rec, weights=w)


def test_from_engine_takes_routed_weights() -> None:
    T = 12
    ex, w = routed(np.random.default_rng(4), T - 1)
    full_ex = np.zeros((T - 1, L, K), np.int64)
    full_w = np.zeros((T - 1, L, K), np.float32)
    full_ex[:, list(MOE)], full_w[:, list(MOE)] = ex, w
    routes = EngineRoutes(full_ex, routed_weights=full_w, weights_dtype="bfloat16")
    rec = RouteRecord.from_engine(routes, np.arange(T), prompt_len=5, num_experts=E, moe_layers=MOE)
    assert bits_equal(rec.weights[: T - 1], w) and not rec.weights[-1].any()
    assert rec.weights_dtype == "bfloat16" and rec.valid[: T - 1].all() and not rec.valid[-1]
    # From row 3 (an engine that skipped a cached prefix): those rows invalid, weights 0 there.
    late = EngineRoutes(full_ex[3:], 3, full_w[3:], "bfloat16")
    rec = RouteRecord.from_engine(late, np.arange(T), prompt_len=5, num_experts=E, moe_layers=MOE)
    assert not rec.valid[:3].any() and not rec.weights[:3].any()
    assert bits_equal(rec.weights[3 : T - 1], w[3:])
    with pytest.raises(RouteShapeError, match=r"routed_weights \(8, 4, 4\) != routed_experts"):
        RouteRecord.from_engine(EngineRoutes(full_ex, routed_weights=full_w[:8]), np.arange(T),
                                prompt_len=5, num_experts=E, moe_layers=MOE)  # fmt: skip


def test_slicing_keeps_weights() -> None:
    rec = make(np.arange(40), 5)
    part = rec.rows(7, 30)
    assert bits_equal(part.weights, rec.weights[7:30]) and part.weights_dtype == "bfloat16"
    assert decode_record(encode_record(part)) == part


def test_a_reader_without_the_weights_plane_reads_the_ids(monkeypatch) -> None:
    rec = make(np.arange(50), 6)
    blob = encode_record(rec)
    # An older reader knows only the ids plane: the optional weights plane is ignored.
    monkeypatch.setattr(_codec, "KNOWN_PLANES", frozenset({"ids"}))
    monkeypatch.setattr(_codec, "weights_plane", lambda p, what: None)
    old = decode_record(blob)
    assert old.weights is None and old.same_routes(rec)


def test_a_required_unknown_plane_is_refused() -> None:
    from routereplay.client import RouteVersionError

    p = unframe_map(encode_record(make(np.arange(8), 7)), KIND_RECORD, "r")
    p["planes"] = [*p["planes"], {"name": "logits", "required": True}]
    with pytest.raises(RouteVersionError, match="logits"):
        decode_record(frame_map(KIND_RECORD, p))


def test_corrupt_record_weights_are_refused() -> None:
    p = unframe_map(encode_record(make(np.arange(30), 8)), KIND_RECORD, "r")
    w = bytearray(p["weights"])
    w[10] ^= 0x40
    p["weights"] = bytes(w)
    with pytest.raises(RouteCorruptError, match="weights"):
        decode_record(frame_map(KIND_RECORD, p))


# ---------------------------------------------------------------------------------------------
# store
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_store_round_trips_bit_exact(store: RouteStore, dtype: str) -> None:
    rec = make(np.arange(50), 9, dtype)
    r = rid()
    store.put(r, rec)
    got = store.get(r)
    assert got == rec and bits_equal(got.weights, rec.weights)
    tail = store.get(r, start=21)
    assert tail == rec.rows(21) and bits_equal(tail.weights, rec.weights[21:])
    (many,) = store.get_many([r], start=3)
    assert many == rec.rows(3)


def test_shared_prefix_stored_once_with_weights(store: RouteStore) -> None:
    prompt = np.arange(48)
    base = make(np.concatenate([prompt, [900, 901, 902]]), 10, invalid_last=False)
    other = dataclasses.replace(
        base,
        token_ids=np.concatenate([prompt, [700, 701, 702]]),
        experts=np.concatenate([base.experts[:48], base.experts[48:][::-1]]),
        weights=np.concatenate([base.weights[:48], base.weights[48:][::-1]]),
    )
    first = store.put(rid(), base)
    second = store.put(rid(), other)
    assert first.chunks_written == 4
    assert second.chunks_reused == 3 and second.chunks_written == 1


def test_equal_ids_with_other_weights_are_not_deduped(store: RouteStore) -> None:
    a = make(np.arange(32), 11, invalid_last=False)
    w = a.weights.copy()
    w[20, 1, :] = w[20, 1, ::-1]  # the same ids, another weight in each slot
    b = dataclasses.replace(a, weights=w)
    ids = a.experts.copy()
    plain = dataclasses.replace(a, weights=None, weights_dtype=None, experts=ids)
    ra, rb, rp = rid(), rid(), rid()
    store.put(ra, a)
    res = store.put(rb, b)
    assert res.chunks_reused == 1 and res.chunks_written == 1  # only the block with row 20
    assert store.put(rp, plain).chunks_written == 2  # ids alone share nothing with weights
    got_a, got_b, got_p = store.get_many([ra, rb, rp])
    assert bits_equal(got_a.weights, a.weights) and bits_equal(got_b.weights, w)
    assert got_p.weights is None and got_p == plain


def test_corrupt_weights_byte_names_the_chunk(store: RouteStore, redis_url: str) -> None:
    rec = make(np.arange(20), 12)
    r = rid()
    store.put(r, rec)
    client = redis.Redis.from_url(redis_url)
    try:
        manifest = client.get(store.keys.manifest(r))
        digests = unframe_map(manifest, 3, "m")["chunks"]
        ck = store.keys.chunk(bytes(digests[0]))
        blob = bytearray(client.get(ck))
        blob[-3] ^= 0x01  # inside the weights section, the chunk's last bytes
        client.set(ck, bytes(blob))
    finally:
        client.close()
    with pytest.raises(RouteCorruptError, match=bytes(digests[0]).hex()):
        store.get(r)


def test_fill_copies_weights_only_with_them(store: RouteStore) -> None:
    tokens = np.arange(100, 140)
    full = make(tokens, 13, invalid_last=False)
    store.put(rid(), full)  # indexes its complete blocks, weights included
    hole = full.valid.copy()
    hole[:20] = False
    w = full.weights.copy()
    w[:20] = 0
    ex = full.experts.copy()
    ex[:20] = 0
    partial = dataclasses.replace(full, valid=hole, weights=w, experts=ex)
    filled, n = store.fill_from_prefix_index(partial)
    assert n == 20
    assert bits_equal(filled.weights, full.weights) and np.array_equal(filled.experts, full.experts)
    # A record without weights takes the ids alone.
    plain = dataclasses.replace(partial, weights=None, weights_dtype=None)
    got, n = store.fill_from_prefix_index(plain)
    assert n == 20 and got.weights is None and np.array_equal(got.experts, full.experts)
    # One in another dtype takes nothing: its filled rows would have no weights of its dtype.
    other = dataclasses.replace(partial, weights=w, weights_dtype="float32")
    assert store.fill_from_prefix_index(other)[1] == 0


def test_empty_and_async_puts_keep_weights(redis_url: str) -> None:
    import asyncio

    from routereplay.client import AsyncRouteStore

    async def run() -> None:
        s = AsyncRouteStore.from_url(redis_url, prefix=f"ra{uuid.uuid4().hex[:6]}", block_size=16)
        try:
            empty, full = make(np.arange(0), 16), make(np.arange(37), 17)
            await s.put("empty", empty)
            await s.put("full", full)
            got_e, got_f = await s.get_many(["empty", "full"])
            assert got_e == empty and got_e.weights.shape == (0, len(MOE), K)
            assert got_f == full and bits_equal(got_f.weights, full.weights)
        finally:
            await s.close()

    asyncio.run(run())


def test_a_chunk_without_the_listed_weights_is_refused(store: RouteStore, redis_url: str) -> None:
    rec = make(np.arange(20), 18)
    r = rid()
    store.put(r, dataclasses.replace(rec, weights=None, weights_dtype=None))
    client = redis.Redis.from_url(redis_url)
    try:  # a manifest that lists a weights plane its chunks do not hold
        key = store.keys.manifest(r)
        p = unframe_map(client.get(key), 3, "m")
        p["planes"] = [*p["planes"], {"name": "weights", "required": False, "dtype": "bfloat16"}]
        client.set(key, frame_map(3, p))
    finally:
        client.close()
    with pytest.raises(RouteCorruptError, match="holds no bfloat16 weights plane"):
        store.get(r)
