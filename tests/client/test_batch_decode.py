"""The compiled batch chunk decoder (client/_cbatch.c) against the Python reference path
(``_layout.decode_chunk``): the same blocks for every chunk it takes, and every chunk it does not
take (an older format, a field it does not know, any corruption) handed to the Python path,
which names the problem. The store's reads go through it (tests/client/test_store.py)."""

from __future__ import annotations

import contextlib
import itertools
import zlib
from unittest import mock

import msgpack
import numpy as np
import pytest
import zstandard

from routereplay.client import RouteCorruptError, RouteRecord, RouteStore, batch_decoder
from routereplay.client import _codec as C
from routereplay.client import _layout as L
from routereplay.client._codec import Block
from routereplay.local_redis import redis_server

_BATCH = L._BATCH


def _chunk(
    rng: np.random.Generator,
    T: int,
    M: int,
    K: int,
    E: int,
    xf: int | None = None,
    *,
    canonical: bool = False,
    sticky: float = 0.0,
    ha: int = L.HASH_BLAKE3_ROWS,
    **extra: object,
) -> tuple[bytes, bytes]:
    """(digest, blob) of one store chunk as ``PutPlan.chunk_blob`` writes it, with row transform
    ``xf`` forced (None: the encoder's choice) and payload fields overridden by ``extra``."""
    dt = C.expert_dtype(E)
    lm = rng.integers(0, E, (M, T, K)).astype(dt)
    if sticky and T > 1:  # rows that keep their experts from one token to the next
        keep = rng.random((M, T, 1)) < sticky
        for t in range(1, T):
            lm[:, t] = np.where(keep[:, t], lm[:, t - 1], lm[:, t])
    if canonical:
        lm = C.canonicalize(lm)
    tok = rng.integers(0, 2**32, T, dtype=np.int64)
    valid = rng.random(T) < 0.8
    pc = rng.bytes(16)
    p = C.encode_body(tok, lm, valid, E, canonical_order=canonical, presorted=True, transform=xf)
    p["pc"] = pc
    p["ha"] = ha
    p.update(extra)
    chain = L._next_chain(pc, tok)
    digest = L._chunk_digest(chain, valid, lm, ha if ha in (1, 2, 3) else 3)
    return digest, C.frame(C.KIND_CHUNK, p)


def _high_layout(name: str) -> contextlib.ExitStack:
    """Force a layout of the high bits of ids of 257 to 512 experts (writers choose by size):
    "grouped" (hp 2), "ordered" (hp 1) or "trits" (hp 3, base-3 digits)."""
    patches = {
        "grouped": {"_GROUPED_GAIN": 100.0, "_TRITS_GAIN": 0.0},
        "ordered": {"_GROUPED_GAIN": 0.0, "_TRITS_GAIN": 0.0},
        "trits": {"_TRITS_GAIN": 100.0},
    }[name]
    stack = contextlib.ExitStack()
    for attr, value in patches.items():
        stack.enter_context(mock.patch.object(C, attr, value))
    return stack


def _same(a: object, b: object) -> None:
    """A batch-decoded result equals the Python path's: the same Block field by field, or an
    error of the same type and message, or None."""
    if isinstance(b, Block):
        assert isinstance(a, Block), a
        assert a.experts.dtype == b.experts.dtype and a.experts.shape == b.experts.shape
        assert np.array_equal(a.experts, b.experts)
        assert a.token_ids.dtype == b.token_ids.dtype == np.int64
        assert np.array_equal(a.token_ids, b.token_ids)
        assert a.valid.dtype == b.valid.dtype == np.bool_
        assert np.array_equal(a.valid, b.valid)
        assert (a.canonical, a.prev_chain, a.address_hash, a.chain, a.max_id) == (
            b.canonical, b.prev_chain, b.address_hash, b.chain, b.max_id,
        )  # fmt: skip
    else:
        assert type(a) is type(b) and str(a) == str(b)


def _check(items: list[tuple[bytes, bytes | None]], taken: bool | None = None) -> list:
    """Decode ``items`` both ways and compare; ``taken``: whether the batch decoder must have
    accepted every chunk itself (True) or handed every one to the Python path (False)."""
    got = L._decode_chunks(items)
    want = [L._decode_one(d, b) for d, b in items]
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    if taken is not None:
        _, _, results = _BATCH.decode_chunks([d for d, _ in items], [b for _, b in items])
        assert [r is not None for r in results] == [taken] * len(items)
    return got


def test_the_batch_decoder_is_built_and_usable_in_this_install() -> None:
    # setup.sh builds it and this host has libzstd; a silent fallback would leave the tests below
    # comparing the Python path with itself.
    assert _BATCH is not None and batch_decoder() is None
    with mock.patch.object(L, "_BATCH", None):
        assert "not built" in str(batch_decoder())


TRANSFORMS = [C.XF_PLAIN, C.XF_DELTA, C.XF_KEEP, C.XF_TOKENS]


@pytest.mark.parametrize("E", [8, 128, 256, 257, 300, 384, 512, 513, 65536])
@pytest.mark.parametrize("xf", [*TRANSFORMS, None])
def test_every_row_transform_and_id_width_decodes_as_the_python_path(E: int, xf: int | None):
    rng = np.random.default_rng(E * 7 + (xf or 9))
    # (128, 3, 8), (16, 2, 8): top-8 over whole mask bytes, the keep transform's block join.
    shapes = [(128, 4, 2), (1, 1, 1), (3, 2, 1), (9, 1, 3), (77, 3, 8), (128, 1, 1), (0, 2, 2),
              (128, 3, 8), (16, 2, 8)]  # fmt: skip
    items = []
    for T, M, K in shapes:
        if xf in (C.XF_DELTA, C.XF_KEEP, C.XF_TOKENS) and T < 2:
            continue  # the encoder applies these to two or more tokens only
        if T == 0 and xf is not None and xf != C.XF_PLAIN:
            continue
        for sticky in (0.0, 0.9):
            items.append(_chunk(rng, T, M, K, E, xf, sticky=sticky))
            if 256 < E <= 512:  # each layout of the high bits, forced (writers choose by size)
                for layout in ("grouped", "ordered", "trits")[: 3 if E <= 384 else 2]:
                    with _high_layout(layout):
                        items.append(_chunk(rng, T, M, K, E, xf, sticky=sticky))
    blocks = _check(items, taken=True)
    assert all(isinstance(b, Block) for b in blocks)


@pytest.mark.parametrize("E", [64, 1000])
def test_canonical_rows_with_gaps_decode_as_the_python_path(E: int) -> None:
    rng = np.random.default_rng(E)
    items = [_chunk(rng, T, 3, 4, E, C.XF_GAPS, canonical=True) for T in (1, 5, 128)]
    items += [_chunk(rng, 64, 2, 4, E, None, canonical=True)]
    _check(items, taken=True)


def test_chunks_of_a_real_put_decode_as_the_python_path() -> None:
    rng = np.random.default_rng(0)
    T, M, K, E = 1000, 6, 4, 96
    rec = RouteRecord(
        token_ids=rng.integers(0, 50_000, T),
        experts=rng.integers(0, E, (T, M, K)).astype(np.uint8),
        valid=rng.random(T) < 0.9, moe_layers=tuple(range(M)), num_layers=M, num_experts=E,
        prompt_len=100,
    )  # fmt: skip
    plan = L.plan_put(L.KeySchema(), "r", rec, 128)
    digests = [bytes.fromhex(k.split("{")[1].rstrip("}")) for k in plan.chunk_keys]
    items = [(d, plan.chunk_blob(i)) for i, d in enumerate(digests)]
    _check(items, taken=True)
    m = L.parse_manifest("r", plan.manifest_blob)
    rebuilt = L.assemble(m, dict(zip(digests, L._decode_chunks(items), strict=True)))
    assert rebuilt == rec


def test_a_chunk_decoder_waits_for_every_part() -> None:
    """``ChunkDecoder.wait`` returns once every part on the pool is decoded (a store read
    assembles its records after it), and the blocks are the ones decoded inline."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(1)
    T, M, K, E = 600, 4, 2, 64
    rec = RouteRecord(
        token_ids=rng.integers(0, 50_000, T),
        experts=rng.integers(0, E, (T, M, K)).astype(np.uint8),
        valid=np.ones(T, bool), moe_layers=tuple(range(M)), num_layers=M, num_experts=E,
        prompt_len=10,
    )  # fmt: skip
    plan = L.plan_put(L.KeySchema(), "r", rec, 64)
    digests = [bytes.fromhex(k.split("{")[1].rstrip("}")) for k in plan.chunk_keys]
    blobs = [plan.chunk_blob(i) for i in range(len(digests))]
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(gate.wait)  # the one worker is busy: every part queues behind it
        dec = L.ChunkDecoder(pool, 4)
        dec.add(digests, blobs)
        parts = list(dec._members)
        assert len(parts) == 4 and not any(f.done() for f in parts)
        threading.Timer(0.2, gate.set).start()
        dec.wait()
        assert held.done() and all(f.done() for f in parts)
    inline = L._decode_chunks(list(zip(digests, blobs, strict=True)))
    for a, b in zip(dec.take(digests), inline, strict=True):
        _same(a, b)
    L.ChunkDecoder().wait()  # nothing added, nothing to wait for


def _reframe(blob: bytes, payload: dict | bytes, version: int | None = None) -> bytes:
    body = payload if isinstance(payload, bytes) else msgpack.packb(payload, use_bin_type=True)
    magic, v, kind, res, _, _ = C._HEADER.unpack_from(blob)
    head = C._HEADER.pack(magic, v if version is None else version, kind, res, len(body),
                          zlib.crc32(body))  # fmt: skip
    return head + body


def test_what_the_batch_decoder_does_not_take_goes_to_the_python_path() -> None:
    rng = np.random.default_rng(1)
    d, blob = _chunk(rng, 40, 2, 3, 64)
    p = C.unframe(blob, C.KIND_CHUNK, "x")
    other = C.unframe(_chunk(rng, 40, 2, 3, 64)[1], C.KIND_CHUNK, "y")
    variants: dict[str, tuple[bytes, bytes]] = {
        "older address hash (format 2)": _chunk(rng, 40, 2, 3, 64, ha=L.HASH_BLAKE3),
        "blake2b address (format 1)": _chunk(rng, 40, 2, 3, 64, ha=L.HASH_BLAKE2B),
        "no address hash field": (d, _reframe(blob, {k: v for k, v in p.items() if k != "ha"})),
        "no chain": (d, _reframe(blob, {k: v for k, v in p.items() if k != "pc"})),
        "nil chain": (d, _reframe(blob, {**p, "pc": None})),
        "chain of another type": (d, _reframe(blob, {**p, "pc": "x" * 16})),
        "an unknown field": (d, _reframe(blob, {**p, "new": 1})),
        "a size as bool": (d, _reframe(blob, {**p, "K": True})),
        "a negative size": (d, _reframe(blob, {**p, "T": -1})),
        "a huge size": (d, _reframe(blob, {**p, "T": 2**40})),
        "E = 0": (d, _reframe(blob, {**p, "E": 0})),
        "E > 65536": (d, _reframe(blob, {**p, "E": 70_000})),
        "unknown transform": (d, _reframe(blob, {**p, "xf": 9})),
        "body as str": (d, _reframe(blob, {**p, "body": "abc"})),
        "canon as int": (d, _reframe(blob, {**p, "canon": 1})),
        "raw size off by one": (d, _reframe(blob, {**p, "raw": p["raw"] + 1})),
        "newer format": (d, _reframe(blob, p, version=C.FORMAT_VERSION + 1)),
        "format 0": (d, _reframe(blob, p, version=0)),
        "payload not a map": (d, _reframe(blob, msgpack.packb([1, 2]))),
        "trailing byte": (d, blob + b"\0"),
        "truncated": (d, blob[:-1]),
        "header only": (d, blob[:16]),
        "empty": (d, b""),
        "wrong digest": (bytes(16), blob),
        "short digest": (d[:8], blob),
        "a record, not a chunk": (d, blob[:5] + bytes([C.KIND_RECORD]) + blob[6:]),
        "two zstd frames": (d, _reframe(blob, {**p, "body": p["body"] + p["body"]})),
        "body of another chunk": (d, _reframe(blob, {**p, "body": other["body"]})),
    }
    for name, item in variants.items():
        got = _check([item, (d, blob)])  # next to a good chunk: the batch goes on
        _, _, results = _BATCH.decode_chunks([item[0], d], [item[1], blob])
        assert results[0] is None, name
        assert results[1] is not None, name
        assert isinstance(got[1], Block), name


def test_keep_change_bits_that_do_not_add_up_go_to_the_python_path() -> None:
    rng = np.random.default_rng(2)
    d, blob = _chunk(rng, 13, 2, 3, 300, C.XF_KEEP, sticky=0.8)  # 78 bits: 2 bytes of padding
    p = C.unframe(blob, C.KIND_CHUNK, "x")
    raw = bytearray(C._zd().decompress(p["body"]))
    T, vb = 13, 2
    n = 2 * 13 * 3

    def with_raw(r: bytes) -> tuple[bytes, bytes]:
        body = C._zc().compress(bytes(r))
        return d, _reframe(blob, {**p, "body": body, "raw": len(r)})

    padded = bytearray(raw)
    padded[4 * T + vb + n // 8] |= 1  # a change bit past the last row
    first = bytearray(raw)
    first[4 * T + vb] &= 0x7F  # the first stream starts without its id
    extra = bytearray(raw)
    extra[4 * T + vb + 1] ^= 0x10  # one change bit more (or less) than ids
    for r in (padded, first, extra):
        item = with_raw(r)
        got = _check([item])
        assert not isinstance(got[0], Block)
    assert isinstance(_check([with_raw(raw)], taken=True)[0], Block)


def test_every_single_byte_corruption_decodes_as_the_python_path() -> None:
    # A flipped byte anywhere in a chunk: the batch decoder either leaves the chunk to the Python
    # path, or takes it, and then its rows, tokens and validity are exactly the chunk's as
    # written (its content address is checked). It takes a flip in the unchecked frame checksum,
    # the reserved bytes and the ``canon`` flag (not part of the address: both paths take it),
    # as the Python path does, and rarely one inside the zstd body that the
    # system's libzstd (1.5.4 here) decodes to the same bytes where python-zstandard's newer
    # zstd calls it corrupted: the rows are intact, so it returns them.
    rng = np.random.default_rng(3)
    lenient = 0
    for E, xf in [(64, C.XF_PLAIN), (300, C.XF_KEEP), (40, C.XF_TOKENS)]:
        d, blob = _chunk(rng, 24, 2, 2, E, xf, sticky=0.5)
        good = L._decode_one(d, blob)
        body = C.unframe(blob, C.KIND_CHUNK, "x")["body"]
        lo = blob.index(body)
        items, where = [], []
        for i, x in itertools.product(range(len(blob)), (0x01, 0x80, 0xFF)):
            b = bytearray(blob)
            b[i] ^= x
            items.append((d, bytes(b)))
            where.append(i)
        got = L._decode_chunks(items)
        for (dd, b), g, i in zip(items, got, where, strict=True):
            want = L._decode_one(dd, b)
            if isinstance(g, Block) and not isinstance(want, Block):
                assert lo <= i < lo + len(body), (E, xf, i, want)
                assert isinstance(want, RouteCorruptError)
                _same(g, good)
                lenient += 1
            else:
                _same(g, want)
                if isinstance(g, Block):  # both took it: its rows are the chunk's as written
                    g.canonical = good.canonical  # the flip may land on the canonical flag
                    _same(g, good)
    assert lenient <= 6  # a handful of 3 x 3 x ~200 flips, not a pattern


def test_inputs_that_are_not_bytes_and_missing_chunks() -> None:
    rng = np.random.default_rng(4)
    d, blob = _chunk(rng, 30, 2, 2, 16)
    items = [(d, None), (d, bytearray(blob)), (d, memoryview(blob)), (d, blob)]
    got = _check(items)  # type: ignore[arg-type]
    assert got[0] is None and all(isinstance(g, Block) for g in got[1:])
    with pytest.raises(ValueError, match="as many digests as blobs"):
        _BATCH.decode_chunks([d], [blob, blob])
    with pytest.raises(TypeError):
        _BATCH.decode_chunks(None, [blob])
    assert _BATCH.decode_chunks([], []) == (b"", b"", [])


def test_a_store_read_is_the_same_with_and_without_the_batch_decoder() -> None:
    rng = np.random.default_rng(5)
    recs = []
    for i in range(6):
        T = int(rng.integers(70, 700))
        E = (64, 300)[i % 2]
        recs.append(RouteRecord(
            token_ids=rng.integers(0, 2**31, T),
            experts=rng.integers(0, E, (T, 3, 2)).astype(C.expert_dtype(E)),
            valid=rng.random(T) < 0.9, moe_layers=(0, 2, 3), num_layers=4, num_experts=E,
            prompt_len=min(T, 10),
        ))  # fmt: skip
    ids = [f"r{i}" for i in range(len(recs))]
    with redis_server() as url:
        for threads in (1, 3):
            store = RouteStore.from_url(url, prefix="bd", decode_threads=threads, block_size=64)
            for i, r in zip(ids, recs, strict=True):
                store.put(i, r)
            fast = store.get_many(ids)
            with mock.patch.object(L, "_BATCH", None):
                slow = store.get_many(ids)
            assert fast == slow == recs
            # From the middle of a chunk: the first chunk's tail, the rest whole.
            fast = store.get_many(ids, start=70)
            with mock.patch.object(L, "_BATCH", None):
                slow = store.get_many(ids, start=70)
            assert fast == slow
            assert [r.num_tokens for r in fast] == [r.num_tokens - 70 for r in recs]
            store.close()


def _huge_frame(size: int) -> bytes:
    """A zstd frame whose header claims ``size`` bytes and that holds 3 (a raw block)."""
    head = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + size.to_bytes(8, "little")  # single segment
    return head + ((3 << 3) | 1).to_bytes(3, "little") + b"abc"


@pytest.mark.parametrize("claim", [1 << 40, 32768 * 19 + 1, 600_000])
def test_a_chunk_that_claims_a_huge_body_is_corrupt_not_an_allocation(claim: int) -> None:
    # python-zstandard allocates what a frame header claims: a hostile chunk claiming 1 TiB
    # made reads raise MemoryError (failing the whole batch). Now it is that chunk's
    # RouteCorruptError, on both paths, next to a good chunk that is still served.
    rng = np.random.default_rng(6)
    d, blob = _chunk(rng, 40, 2, 3, 64)
    p = C.unframe(blob, C.KIND_CHUNK, "x")
    T = 1 << 20  # a shape that agrees with the claim, so only the size is wrong
    bad = {**p, "T": T, "M": 1, "K": 1, "xf": C.XF_PLAIN, "body": _huge_frame(claim)}
    bad["raw"] = claim
    item = (d, _reframe(blob, bad))
    got = _check([item, (d, blob)])
    assert isinstance(got[0], RouteCorruptError) and isinstance(got[1], Block)
    # Beyond 32768x the 19-byte frame: refused unallocated; within it: zstd finds 3 bytes.
    why = "cannot hold" if claim > 32768 * 19 else "compressed body is corrupted"
    assert why in str(got[0])
    with pytest.raises(RouteCorruptError, match=why):
        C.decode_body(bad, "record")


def test_random_multi_byte_damage_decodes_as_the_python_path() -> None:
    # Overwritten runs, truncations and insertions anywhere in chunks of every transform: the
    # batch decoder returns a block only where the Python path does (or, for damage inside the
    # zstd body that libzstd decodes to the same bytes, the chunk's rows exactly as written).
    rng = np.random.default_rng(7)
    for E, xf in [(64, C.XF_PLAIN), (300, C.XF_PLAIN), (100, C.XF_DELTA), (300, C.XF_KEEP),
                  (40, C.XF_TOKENS), (64, None)]:  # fmt: skip
        d, blob = _chunk(rng, int(rng.integers(1, 200)), 3, 2, E, xf, sticky=0.6)
        good = L._decode_one(d, blob)
        items = []
        for _ in range(300):
            b = bytearray(blob)
            i = int(rng.integers(0, len(b)))
            kind = int(rng.integers(0, 3))
            if kind == 0:
                n = int(rng.integers(1, 9))
                b[i : i + n] = rng.bytes(len(b[i : i + n]))
            elif kind == 1:
                del b[i:]
            else:
                b[i:i] = rng.bytes(int(rng.integers(1, 5)))
            items.append((d, bytes(b)))
        got = L._decode_chunks(items)
        for (dd, b), g in zip(items, got, strict=True):
            want = L._decode_one(dd, b)
            if isinstance(g, Block) and not isinstance(want, Block):
                assert isinstance(want, RouteCorruptError), want
                _same(g, good)
            else:
                _same(g, want)


@pytest.mark.parametrize(("layout", "hp"), [("grouped", 2), ("ordered", 1), ("trits", 3)])
@pytest.mark.parametrize("xf", [C.XF_PLAIN, C.XF_KEEP, C.XF_TOKENS])
def test_malformed_packed_high_bits_go_to_the_python_path(xf: int, layout: str, hp: int) -> None:
    """Formats 5 and 6 (ids of 257 to 512 experts): every way their high bits or digits can
    disagree with their low bytes is refused by the batch decoder and named by the Python path."""
    rng = np.random.default_rng(4 + xf)
    with _high_layout(layout):
        d, blob = _chunk(rng, 13, 2, 3, 384, xf, sticky=0.5)
    p = C.unframe(blob, C.KIND_CHUNK, "x")
    assert (p["hp"], blob[4]) == (hp, 5 if hp == 1 else 6)
    raw = zstandard.ZstdDecompressor().decompress(p["body"], max_output_size=p["raw"])

    def with_raw(r: bytes) -> bytes:
        body = zstandard.ZstdCompressor().compress(r)
        return _reframe(blob, {**p, "raw": len(r), "body": body})

    flipped = bytearray(raw)
    flipped[-1] ^= 1  # a padding bit, or the last stored bit (then the address disagrees)
    variants = {
        "one byte of high bits more": with_raw(raw + b"\0"),
        "one byte of high bits less": with_raw(raw[:-1]),
        "last bit flipped": with_raw(bytes(flipped)),
        "hp on 256 experts": _reframe(blob, {**p, "E": 256}),
        "hp on 513 experts": _reframe(blob, {**p, "E": 513}),
        "hp = 4": _reframe(blob, {**p, "hp": 4}),
        "hp read another way": _reframe(blob, {**p, "hp": {1: 2, 2: 1, 3: 1}[p["hp"]]}),
        "hp 3 on 385 experts": _reframe(blob, {**p, "E": 385, "hp": 3}),
        "hp with delta": _reframe(blob, {**p, "xf": C.XF_DELTA}),
        "hp with gaps": _reframe(blob, {**p, "xf": C.XF_GAPS}),
        "no hp": _reframe(blob, {k: v for k, v in p.items() if k != "hp"}),
    }
    if hp == 3:  # a low byte of 128 or more; a digit byte of 243 or more
        top = bytearray(raw)
        # Before the digits of plain and tokens rows (78 ids: 16 bytes), a low byte; keep rows
        # hold fewer ids, and there it may be a digit byte instead: refused either way.
        top[-((13 * 2 * 3 + 4) // 5) - 2] |= 0x80
        big = bytearray(raw)
        big[-1] = 250
        variants["a low byte's top bit"] = with_raw(bytes(top))
        variants["a digit byte of 250"] = with_raw(bytes(big))
    for name, bad in variants.items():
        got = _check([(d, bad), (d, blob)])
        _, _, results = _BATCH.decode_chunks([d, d], [bad, blob])
        assert results[0] is None, name
        assert results[1] is not None and isinstance(got[1], Block), name
        assert isinstance(got[0], RouteCorruptError), (name, got[0])
