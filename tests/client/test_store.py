"""RouteStore / AsyncRouteStore against real redis-server processes (standalone and cluster)."""

from __future__ import annotations

import dataclasses
import threading
import uuid

import numpy as np
import pytest
import redis

from routereplay.client import (
    AsyncRouteStore,
    RouteConnectionError,
    RouteCorruptError,
    RouteNotFoundError,
    RouteRecord,
    RouteShapeError,
    RouteStore,
    RouteStoreError,
)

E, K, L = 16, 2, 4
MOE = (1, 2, 3)  # layer 0 dense


def make_record(tokens: np.ndarray, seed: int, *, prompt_len: int = 0) -> RouteRecord:
    """Routes that are a pure function of the token prefix, like a real causal model."""
    T = tokens.shape[0]
    experts = np.empty((T, len(MOE), K), np.uint8)
    h = 0
    for t in range(T):
        h = (h * 1_000_003 + int(tokens[t]) + seed) % (2**31)
        rng = np.random.default_rng(h)
        experts[t] = np.argsort(rng.random((len(MOE), E)), axis=1)[:, :K]
    valid = np.ones(T, bool)
    if T:
        valid[-1] = False
        experts[-1] = 0
    return RouteRecord(
        token_ids=tokens,
        experts=experts,
        valid=valid,
        moe_layers=MOE,
        num_layers=L,
        num_experts=E,
        prompt_len=prompt_len,
        model="tiny",
    )


def rid() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def store(redis_url: str) -> RouteStore:
    s = RouteStore.from_url(redis_url, prefix=f"rr{uuid.uuid4().hex[:6]}", block_size=16)
    yield s
    s.close()


def test_put_get_round_trip(store: RouteStore) -> None:
    rng = np.random.default_rng(0)
    for T in (0, 1, 15, 16, 17, 100):
        rec = make_record(rng.integers(0, 1000, T), 1, prompt_len=T // 2)
        r = rid()
        res = store.put(r, rec)
        assert res.num_tokens == T and res.chunks_total == -(-T // 16)
        assert store.exists(r)
        assert store.get(r) == rec


def test_start_offset_returns_tail_rows(store: RouteStore) -> None:
    rec = make_record(np.arange(100), 2, prompt_len=40)
    r = rid()
    store.put(r, rec)
    for start in (0, 1, 16, 39, 40, 57, 99, 100):
        got = store.get(r, start=start)
        want = rec.rows(start)
        assert got.same_routes(want), start
        assert got.prompt_len == max(40 - start, 0)
    with pytest.raises(RouteShapeError, match="start=101"):
        store.get(r, start=101)


def test_grpo_group_shares_prompt_chunks(store: RouteStore, redis_url: str) -> None:
    prompt = np.arange(64)
    group = [
        make_record(np.concatenate([prompt, 1000 + np.arange(32) * (i + 1)]), 3, prompt_len=64)
        for i in range(8)
    ]
    results = [store.put(rid(), r) for r in group]
    # 64-token prompt = 4 full blocks, written by the first sample only.
    assert results[0].chunks_written == results[0].chunks_total
    assert all(r.chunks_reused == 4 for r in results[1:])
    assert sum(r.bytes_written for r in results[1:]) < 0.7 * results[0].bytes_written * 7


def test_get_many_fetches_each_shared_chunk_once(
    closing, store: RouteStore, redis_url: str
) -> None:
    prompt = np.arange(48)
    recs = [make_record(np.concatenate([prompt, [500 + i] * 10]), 4) for i in range(5)]
    ids = [rid() for _ in recs]
    for i, r in zip(ids, recs, strict=True):
        store.put(i, r)
    mon = closing(redis.Redis.from_url(redis_url))

    def reads() -> tuple[int, int]:
        """(keys looked up, MGET commands) so far."""
        stats, cmds = mon.info("stats"), mon.info("commandstats")
        keys = stats["keyspace_hits"] + stats["keyspace_misses"]
        return keys, cmds.get("cmdstat_mget", {}).get("calls", 0)

    before = reads()
    got = store.get_many(ids)
    after = reads()
    assert [g == r for g, r in zip(got, recs, strict=True)] == [True] * 5
    # 5 manifests + 3 shared prompt chunks + 5 distinct tail chunks, in two MGETs (manifests,
    # then one batch of chunks): one round trip per batch on standalone Redis.
    assert after[0] - before[0] == 5 + 3 + 5
    assert after[1] - before[1] == 2


def test_missing_ids(store: RouteStore) -> None:
    r = rid()
    store.put(r, make_record(np.arange(5), 0))
    with pytest.raises(RouteNotFoundError, match="nope"):
        store.get_many([r, "nope"])
    got = store.get_many([r, "nope"], missing_ok=True)
    assert got[1] is None and got[0] is not None
    assert store.delete(r) and not store.delete(r)
    with pytest.raises(RouteNotFoundError):
        store.get(r)
    with pytest.raises(RouteShapeError, match="invalid route id"):
        store.get("has space")


def test_missing_chunk_is_reported_not_half_read(
    closing, store: RouteStore, redis_url: str
) -> None:
    r = rid()
    store.put(r, make_record(np.arange(40) + 7000, 9))
    raw = closing(redis.Redis.from_url(redis_url))
    chunk = next(iter(raw.scan_iter(f"{store.keys.prefix}:c:*")))
    # find a chunk of this record: delete all chunks of a fresh prefix to be sure
    keys = [k for k in raw.scan_iter(f"{store.keys.prefix}:c:*")]
    assert chunk in keys
    for k in keys:
        raw.delete(k)
    with pytest.raises(RouteCorruptError, match="missing"):
        store.get(r)


def test_ttl_on_every_key_and_chunks_outlive_manifests(closing, redis_url: str) -> None:
    p = f"ttl{uuid.uuid4().hex[:6]}"
    s = closing(RouteStore.from_url(redis_url, prefix=p, ttl_s=1000, block_size=8))
    s.put("a", make_record(np.arange(40), 0))
    raw = closing(redis.Redis.from_url(redis_url))
    keys = list(raw.scan_iter(f"{p}:*"))
    assert len(keys) > 3 and all(raw.ttl(k) > 0 for k in keys)
    manifest_ttl = raw.ttl(s.keys.manifest("a"))
    assert 0 < manifest_ttl <= 1000
    chunk_ttls = [raw.ttl(k) for k in raw.scan_iter(f"{p}:c:*")]
    assert min(chunk_ttls) > manifest_ttl  # the margin covers the time a put takes
    # a later put with a longer TTL extends shared chunks so they outlive its manifest
    s.put("b", make_record(np.arange(40), 0), ttl_s=5000)
    assert all(raw.ttl(k) > 5000 for k in raw.scan_iter(f"{p}:c:*"))
    # ...and a shorter one never shortens them
    s.put("c", make_record(np.arange(40), 0), ttl_s=10)
    assert all(raw.ttl(k) > 5000 for k in raw.scan_iter(f"{p}:c:*"))
    with pytest.raises(ValueError, match="ttl_s must be >= 1"):
        s.put("d", make_record(np.arange(4), 0), ttl_s=0)


def test_lost_chunk_with_missing_ok_reports_only_that_record(
    closing, store: RouteStore, redis_url: str
) -> None:
    a, b = rid(), rid()
    store.put(a, make_record(np.arange(30) + 50_000, 1))
    store.put(b, make_record(np.arange(30) + 60_000, 1))
    raw = closing(redis.Redis.from_url(redis_url))
    blob = raw.get(store.keys.manifest(a))
    from routereplay.client._layout import parse_manifest

    m = parse_manifest(a, blob)
    raw.delete(store.keys.chunk(m.digests[1]))  # as an eviction would
    got = store.get_many([a, b], missing_ok=True)
    assert got[0] is None and got[1] is not None
    with pytest.raises(RouteCorruptError, match="missing"):
        store.get_many([a, b])


def test_uint16_records_assemble_with_their_own_dtype(store: RouteStore) -> None:
    def rec(T: int, E: int) -> RouteRecord:
        rng = np.random.default_rng(T + E)
        ex = np.argsort(rng.random((T * 2, E)), axis=1)[:, :2].reshape(T, 2, 2)
        return RouteRecord(
            token_ids=np.arange(T) + E,
            experts=ex.astype(np.uint8 if E <= 256 else np.uint16),
            valid=np.ones(T, bool),
            moe_layers=[0, 1],
            num_layers=2,
            num_experts=E,
        )

    small, wide, empty = rec(16, 8), rec(32, 300), rec(0, 300)
    ids = [rid(), rid(), rid()]
    for i, r in zip(ids, (small, wide, empty), strict=True):
        store.put(i, r)
    assert store.get_many(ids) == [small, wide, empty]
    assert store.get_many(ids[::-1]) == [empty, wide, small]
    assert store.get(ids[1], start=32).experts.dtype == np.uint16  # no rows left


def test_redis_refusals_are_typed_and_short(closing) -> None:
    import tempfile
    from pathlib import Path

    from routereplay.client import RouteStoreError
    from routereplay.local_redis import _start, free_port

    with tempfile.TemporaryDirectory() as d:
        port = free_port()
        proc = _start(port, Path(d), "--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
        try:
            s = closing(RouteStore.from_url(f"redis://127.0.0.1:{port}/0"))
            big = make_record(np.arange(4000) % 1000, 3)
            with pytest.raises(RouteStoreError, match="OutOfMemoryError") as err:
                for i in range(200):
                    s.put(f"oom-{i}", big)
            assert len(str(err.value)) < 400  # never the chunk bytes the server echoes
        finally:
            proc.terminate()
            proc.wait()


def test_prefix_index_fills_rows_an_engine_did_not_return(store: RouteStore) -> None:
    tokens = np.arange(40) + 300
    store.put(rid(), make_record(tokens, 5))  # an earlier, shorter request
    # Same prefix, longer; the engine returned only rows from 40 on (prefix-cache hit).
    longer = make_record(np.concatenate([tokens, np.arange(33)]), 5)
    partial = RouteRecord(
        token_ids=longer.token_ids,
        experts=longer.experts.copy(),
        valid=longer.valid.copy(),
        moe_layers=MOE,
        num_layers=L,
        num_experts=E,
        model="tiny",
    )
    partial.experts[:40] = 0
    partial.valid[:40] = False
    filled, n = store.fill_from_prefix_index(partial)
    assert n == 32  # blocks 0 and 1 (rows 0..31) are complete in the index; 32..39 are not
    assert np.array_equal(filled.experts[:32], longer.experts[:32])
    assert filled.valid[:32].all() and not filled.valid[32:40].any()
    # a different model shape never matches
    other = RouteRecord(
        token_ids=partial.token_ids,
        experts=partial.experts,
        valid=partial.valid,
        moe_layers=MOE,
        num_layers=L,
        num_experts=E,
        model="other",
    )
    assert store.fill_from_prefix_index(other)[1] == 0


def test_concurrent_writers_of_one_prefix(store: RouteStore) -> None:
    prompt = np.arange(64) + 12345
    recs = [make_record(np.concatenate([prompt, [i] * 20]), 6) for i in range(8)]
    ids = [rid() for _ in recs]
    errors: list[BaseException] = []

    def put(i: int) -> None:
        try:
            store.put(ids[i], recs[i])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(g == r for g, r in zip(store.get_many(ids), recs, strict=True))


def test_connection_error_is_typed(closing) -> None:
    s = closing(RouteStore.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5))
    with pytest.raises(RouteConnectionError, match=r"127\.0\.0\.1:1"):
        s.get("x")


async def test_async_store_mirrors_sync(closing, redis_url: str) -> None:
    prefix = f"as{uuid.uuid4().hex[:6]}"
    sync = closing(RouteStore.from_url(redis_url, prefix=prefix, block_size=16))
    async with AsyncRouteStore.from_url(redis_url, prefix=prefix, block_size=16) as store:
        big = make_record(np.arange(3000) % 997, 7)
        recs = [make_record(np.arange(50) + i, 8) for i in range(3)] + [big]
        ids = [rid() for _ in recs]
        for i, r in zip(ids, recs, strict=True):
            await store.put(i, r)
        got = await store.get_many(ids)
        assert all(g == r for g, r in zip(got, recs, strict=True))
        assert sync.get(ids[0]) == recs[0]  # what async wrote, sync reads
        assert (await store.get(ids[1], start=20)).same_routes(recs[1].rows(20))
        assert await store.exists(ids[0])
        assert await store.delete(ids[0])
        with pytest.raises(RouteNotFoundError):
            await store.get(ids[0])
        partial = make_record(np.arange(50) + 1, 8)
        partial.valid[:20] = False
        filled, n = await store.fill_from_prefix_index(partial)
        assert n == 20 and filled.valid[:20].all()
        assert filled.same_routes(make_record(np.arange(50) + 1, 8))
    sync.close()


def test_large_record_through_async_worker_thread(redis_url: str) -> None:
    import asyncio

    rng = np.random.default_rng(0)
    T, M = 4096, 48
    x = np.argsort(rng.random((T * M, 128)), axis=1)[:, :8].reshape(T, M, 8).astype(np.uint8)
    rec = RouteRecord(
        token_ids=rng.integers(0, 150000, T),
        experts=x,
        valid=np.ones(T, bool),
        moe_layers=range(M),
        num_layers=M,
        num_experts=128,
    )

    async def go() -> RouteRecord:
        async with AsyncRouteStore.from_url(redis_url, prefix="big") as s:
            await s.put("big-1", rec)
            return await s.get("big-1")

    assert asyncio.run(go()) == rec


@pytest.mark.cluster
def test_cluster_sync_and_async(closing, redis_cluster_url: str) -> None:
    import asyncio

    url = redis_cluster_url.replace("redis://", "redis+cluster://")
    store = closing(RouteStore.from_url(url, block_size=16))
    prompt = np.arange(64)
    recs = [make_record(np.concatenate([prompt, [i] * 30]), 11) for i in range(6)]
    ids = [rid() for _ in recs]
    results = [store.put(i, r) for i, r in zip(ids, recs, strict=True)]
    assert all(r.chunks_reused == 4 for r in results[1:])
    assert all(g == r for g, r in zip(store.get_many(ids), recs, strict=True))
    assert store.get(ids[2], start=33).same_routes(recs[2].rows(33))
    # keys are spread over the 3 masters, and a manifest lives on its id's slot
    nodes = store.redis.get_primaries()
    assert len(nodes) == 3
    counts = [store.redis.dbsize(target_nodes=n) for n in nodes]
    assert sum(1 for c in counts if c > 0) >= 2
    assert store.delete(ids[0])

    async def go() -> None:
        async with AsyncRouteStore.from_url(url, block_size=16) as s:
            got = await s.get_many(ids[1:])
            assert all(g == r for g, r in zip(got, recs[1:], strict=True))
            await s.put("async-c", recs[0])
            assert await s.get("async-c") == recs[0]

    asyncio.run(go())
    store.close()


def test_chunk_under_another_chunks_key_is_detected(closing, store: RouteStore, redis_url) -> None:
    """Content addressing is checked on read: a chunk value copied under another chunk's key
    (or altered) fails that record alone; the others are served."""
    a, b, c = rid(), rid(), rid()
    ra = make_record(np.arange(40) + 70_000, 1)
    store.put(a, ra)
    store.put(b, make_record(np.arange(40) + 80_000, 2))
    rc = make_record(np.arange(40) + 90_000, 3)
    store.put(c, rc)
    raw = closing(redis.Redis.from_url(redis_url))
    from routereplay.client._layout import parse_manifest

    ma = parse_manifest(a, raw.get(store.keys.manifest(a)))
    mb = parse_manifest(b, raw.get(store.keys.manifest(b)))
    victim = store.keys.chunk(mb.digests[0])
    raw.set(victim, raw.get(store.keys.chunk(ma.digests[0])), keepttl=True)
    with pytest.raises(RouteCorruptError, match="does not match its address"):
        store.get(b)
    got = store.get_many([a, b, c], return_exceptions=True)
    assert got[0] == ra and got[2] == rc
    assert isinstance(got[1], RouteCorruptError) and b in str(got[1])
    # A chunk re-framed with another token chain (its checksum right) fails its address too.
    from routereplay.client._frame import KIND_CHUNK, frame, unframe

    p = bytearray(unframe(raw.get(store.keys.chunk(mb.digests[0])), KIND_CHUNK, "x"))
    p[16:32] = bytes(16)  # the chain before the chunk (docs/CONTRACTS.md, "Chunk")
    raw.set(victim, frame(KIND_CHUNK, bytes(p)), keepttl=True)
    with pytest.raises(RouteCorruptError, match="does not match its address"):
        store.get(b)


def test_prefix_fill_ignores_a_planted_chunk(closing, redis_url) -> None:
    prefix = f"fill{uuid.uuid4().hex[:6]}"
    store = closing(RouteStore.from_url(redis_url, prefix=prefix, block_size=16))
    donor = make_record(np.arange(40) + 5, 4)
    store.put("donor", donor)
    raw = closing(redis.Redis.from_url(redis_url))
    from routereplay.client._layout import parse_manifest

    m = parse_manifest("donor", raw.get(store.keys.manifest("donor")))
    # Plant another record's chunk bytes under the donor's first chunk key.
    store.put("other", make_record(np.arange(40) + 500, 5))
    mo = parse_manifest("other", raw.get(store.keys.manifest("other")))
    raw.set(store.keys.chunk(m.digests[0]), raw.get(store.keys.chunk(mo.digests[0])))
    hole = dataclasses.replace(donor, valid=np.zeros(40, dtype=bool))
    filled, n = store.fill_from_prefix_index(hole)
    # Block 0's chunk is planted: not trusted. Block 1's is the donor's own: filled.
    assert n == 16 and not filled.valid[:16].any() and filled.valid[16:32].all()


@pytest.mark.parametrize("threads", [1, 3])
def test_reads_in_batches_on_decode_threads_give_the_same_results(
    closing, redis_url: str, monkeypatch, threads: int
) -> None:
    """A read spanning several GET batches, decoded on a pool (or inline), gives exactly the
    records, the evicted one and the corrupt one that a one-batch inline read gives."""
    from routereplay.client import _store
    from routereplay.client._layout import parse_manifest

    p = f"par{uuid.uuid4().hex[:6]}"
    s = closing(RouteStore.from_url(redis_url, prefix=p, block_size=4, decode_threads=threads))
    assert s.decode_threads == threads
    prompt = np.arange(20) + 1000
    recs = [make_record(np.concatenate([prompt, np.arange(30) + 100 * i]), 5) for i in range(9)]
    ids = [f"r{i}" for i in range(len(recs))]
    for i, r in zip(ids, recs, strict=True):
        s.put(i, r)
    raw = closing(redis.Redis.from_url(redis_url))
    m3 = parse_manifest("r3", raw.get(s.keys.manifest("r3")))
    m6 = parse_manifest("r6", raw.get(s.keys.manifest("r6")))
    raw.delete(s.keys.chunk(m3.digests[-1]))  # r3 loses its last chunk (evicted)
    m0 = parse_manifest("r0", raw.get(s.keys.manifest("r0")))
    # r6's last chunk holds r0's (a content-address mismatch)
    raw.set(s.keys.chunk(m6.digests[-1]), raw.get(s.keys.chunk(m0.digests[-1])), keepttl=True)

    # Round trips of 2, 4, then 5 chunks, and fewer at the end: many batches, as reads make.
    monkeypatch.setattr(_store, "_FIRST_GET_BATCH", 2)
    monkeypatch.setattr(_store, "_GET_BATCH", 5)
    got = s.get_many(ids, return_exceptions=True, missing_ok=True)
    got_tail = s.get_many(ids, start=22, return_exceptions=True, missing_ok=True)
    if threads > 1:
        assert s._decoder._pool is not None  # the pool really ran
    monkeypatch.setattr(_store, "_GET_BATCH", 1 << 20)  # the reference: one batch
    monkeypatch.setattr(_store, "_FIRST_GET_BATCH", 1 << 20)
    ref = closing(RouteStore.from_url(redis_url, prefix=p, block_size=4, decode_threads=1))
    want = ref.get_many(ids, return_exceptions=True, missing_ok=True)
    want_tail = ref.get_many(ids, start=22, return_exceptions=True, missing_ok=True)
    for g, w in [*zip(got, want, strict=True), *zip(got_tail, want_tail, strict=True)]:
        assert type(g) is type(w) and (g == w if isinstance(w, RouteRecord) else str(g) == str(w))
    assert got[3] is None and isinstance(got[6], RouteCorruptError)
    assert [got[i] == recs[i] for i in (0, 1, 2, 4, 5, 7, 8)] == [True] * 7
    assert got_tail[8].num_tokens == recs[8].num_tokens - 22
    s.close()
    assert s._decoder._pool is None
    with pytest.raises(ValueError, match="decode_threads must be >= 1"):
        RouteStore.from_url(redis_url, decode_threads=0)


def test_read_batches_grow_then_shrink_and_cover_every_chunk() -> None:
    """A read's round trips ask for 64, 128, then 256 chunks, and for about half of what is
    left at the end, so that little is still to decode after the last reply; every chunk is in
    exactly one batch, and no batch is a crumb of a few chunks."""
    from routereplay.client._store import _FIRST_GET_BATCH, _GET_BATCH, _batch_sizes

    assert (_FIRST_GET_BATCH, _GET_BATCH) == (64, 256)
    assert _batch_sizes(0) == []
    assert _batch_sizes(1) == [1] and _batch_sizes(64) == [64] and _batch_sizes(80) == [80]
    assert _batch_sizes(100) == [64, 36]
    # A 256k-token training step of bench trainer reads 1503 distinct chunks.
    assert _batch_sizes(1503) == [64, 128, 256, 256, 256, 256, 143, 72, 72]
    for n in range(1, 6000, 7):
        sizes = _batch_sizes(n)
        assert sum(sizes) == n and max(sizes) <= _GET_BATCH, n
        # (a batch may take the few chunks after it along: 71 chunks are one round trip)
        assert all(k < min(64 << i, 256) + 32 for i, k in enumerate(sizes)), (n, sizes)
        if n >= 1024:
            assert sizes[:3] == [64, 128, 256], (n, sizes)
        assert min(sizes) >= min(n, _FIRST_GET_BATCH // 2), (n, sizes)
        if n > 2 * _GET_BATCH:
            assert sizes[-1] <= _GET_BATCH // 2, (n, sizes)


def test_a_forked_child_reads_with_its_own_decode_threads(closing, redis_url: str) -> None:
    """A store whose decode pool exists before a fork (DataLoader workers fork the trainer)
    still reads in the child: the child's inherited pool has no threads, so it makes its own."""
    import multiprocessing as mp

    p = f"fork{uuid.uuid4().hex[:6]}"
    s = closing(RouteStore.from_url(redis_url, prefix=p, block_size=4, decode_threads=2))
    recs = [make_record(np.arange(30) + 1000 * i, 2) for i in range(3)]
    for i, r in enumerate(recs):
        s.put(f"f{i}", r)
    assert s.get_many(["f0", "f1", "f2"]) == recs and s._decoder._pool is not None
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(s, q))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung reading through the inherited decode pool")
    assert q.get(timeout=5) == [r.num_tokens for r in recs]


def _read_in_child(s: RouteStore, q) -> None:
    s.redis.connection_pool.reset()  # sockets are not shared with the parent
    q.put([r.num_tokens for r in s.get_many(["f0", "f1", "f2"])])


def test_manifest_scan_finds_exactly_the_manifests(closing, redis_url: str) -> None:
    # KeySchema names the manifests' SCAN pattern and reads ids back: chunks, index entries,
    # claims and another prefix's keys (a tenant's, one with glob characters) do not match.
    raw = closing(redis.Redis.from_url(redis_url))
    base = f"scan{uuid.uuid4().hex[:6]}"
    rec = make_record(np.arange(40) + 3, seed=0)
    for prefix, ids in ((base, ["a", "b.1", "c:2"]), (f"{base}:t:alice", ["d"]),
                        (f"{base}*", ["e"])):  # fmt: skip
        with RouteStore.from_url(redis_url, prefix=prefix, block_size=16) as s:
            for rid in ids:
                s.put(rid, rec)
            raw.set(s.keys.claim("a"), b"x")
    for prefix, want in ((base, {"a", "b.1", "c:2"}), (f"{base}*", {"e"})):
        with RouteStore.from_url(redis_url, prefix=prefix) as s:
            keys = s.keys
        found = {keys.route_id(k) for k in raw.scan_iter(match=keys.manifest_pattern())}
        assert found == want
        assert keys.route_id(keys.manifest("x-0")) == "x-0"
        with pytest.raises(ValueError, match="not a manifest key"):
            keys.route_id(keys.claim("a"))


def test_a_closed_store_raises_instead_of_reopening(redis_url: str) -> None:
    # redis-py opens new connections for a closed client's next command: a store used after
    # close() would silently reconnect (and restart its decode threads). It raises instead.
    import asyncio

    rec = make_record(np.arange(20), 0)
    store = RouteStore.from_url(redis_url, prefix=f"closed-{uuid.uuid4().hex}")
    store.put("r-0", rec)
    store.close()
    store.close()  # twice is harmless
    for call in (lambda: store.get("r-0"), lambda: store.put("r-1", rec), store.ping,
                 lambda: store.exists("r-0"), store.check_server):  # fmt: skip
        with pytest.raises(RouteStoreError, match="the store is closed"):
            call()

    async def main() -> None:
        st = AsyncRouteStore.from_url(redis_url, prefix=f"closed-{uuid.uuid4().hex}")
        await st.put("r-0", rec)
        await st.close()
        with pytest.raises(RouteStoreError, match="the store is closed"):
            await st.get("r-0")
        with pytest.raises(RouteStoreError, match="the store is closed"):
            await st.ping()

    asyncio.run(main())


def _windowed_record(T: int = 45) -> RouteRecord:
    """A record with weights, three weight-version spans and a prompt that ends inside a chunk
    (in blocks of 8: six chunks, the last one partial)."""
    rec = make_record(np.arange(T) + 90_000, 11, prompt_len=20)
    w = np.random.default_rng(T).random((T, len(MOE), K)).astype(np.float32)
    w[~rec.valid] = 0
    return dataclasses.replace(
        rec, weights=w, weights_dtype="float32", num_cached_tokens=10,
        metadata={"request_id": "w", "choice": 0},
        weight_versions=(("v1", 0, 13), ("v2", 13, 30), ("v3", 30, T)),
    )  # fmt: skip


# Windows of a 45-row record in blocks of 8: chunk boundaries, rows inside a chunk, the last
# row, the end, past the end, and one row.
_POINTS = (0, 1, 7, 8, 9, 13, 16, 20, 29, 30, 40, 44, 45, 46, 100)
_WINDOWS = sorted({(s, e) for s in _POINTS if s <= 45 for e in (*_POINTS, s + 1) if e > s})


def _same_window(got: RouteRecord, whole: RouteRecord, s: int, e: int) -> None:
    """``got`` (rows ``s..e`` read with a stop) is ``whole`` (rows ``s..`` read without one)
    cut at ``e`` (clipped to the end), field by field."""
    want = whole.rows(0, min(e, s + whole.num_tokens) - s)
    where = (s, e)
    assert got.num_tokens == want.num_tokens, where
    assert np.array_equal(got.token_ids, want.token_ids), where
    assert np.array_equal(got.valid, want.valid), where
    assert np.array_equal(got.experts, want.experts), where
    assert got.same_weights(want) and got.weights_dtype == want.weights_dtype, where
    assert (got.prompt_len, got.num_cached_tokens) == (want.prompt_len, want.num_cached_tokens)
    assert got.weight_versions == want.weight_versions, where
    assert got.metadata == want.metadata, where
    assert got == want, where


def test_a_stop_reads_the_rows_a_cut_of_the_tail_gives(closing, redis_url: str) -> None:
    s = closing(RouteStore.from_url(redis_url, prefix=f"st{uuid.uuid4().hex[:6]}", block_size=8))
    rec = _windowed_record()
    s.put("w-0", rec)
    full = s.get("w-0")
    assert full == rec and s.put("w-0", rec).chunks_total == 6
    for start, stop in _WINDOWS:
        got = s.get("w-0", start=start, stop=stop)
        _same_window(got, s.get("w-0", start=start), start, stop)
        assert got == full.rows(start, min(stop, 45)), (start, stop)
    (a, b) = s.get_many(["w-0", "w-0"], start=9, stop=30)
    assert a == b == full.rows(9, 30)
    assert full.rows(9, 30).weight_versions == (("v1", 0, 4), ("v2", 4, 21))
    for start, stop in ((5, 5), (5, 4), (0, 0)):
        with pytest.raises(RouteShapeError, match=f"stop={stop} must be greater than start"):
            s.get("w-0", start=start, stop=stop)
    with pytest.raises(RouteShapeError, match="start=46"):
        s.get("w-0", start=46, stop=50)


async def test_an_async_stop_reads_the_rows_a_cut_of_the_tail_gives(redis_url: str) -> None:
    prefix = f"sa{uuid.uuid4().hex[:6]}"
    async with AsyncRouteStore.from_url(redis_url, prefix=prefix, block_size=8) as s:
        rec = _windowed_record()
        await s.put("w-0", rec)
        for start, stop in _WINDOWS:
            got = await s.get("w-0", start=start, stop=stop)
            _same_window(got, await s.get("w-0", start=start), start, stop)
        got = await s.get_many(["w-0", "nope"], start=9, stop=30, missing_ok=True)
        assert got[0] == rec.rows(9, 30) and got[1] is None
        with pytest.raises(RouteShapeError, match="stop=3 must be greater than start=3"):
            await s.get("w-0", start=3, stop=3)


def test_a_windowed_read_reads_only_the_chunks_of_its_rows(closing, redis_url: str) -> None:
    """With chunk 4 (rows 32..40) gone, as an eviction leaves a record, the windows that need
    no row of it still read; those that do, and the whole record, are evicted."""
    from routereplay.client import RouteEvictedError
    from routereplay.client._layout import parse_manifest

    s = closing(RouteStore.from_url(redis_url, prefix=f"sc{uuid.uuid4().hex[:6]}", block_size=8))
    rec = _windowed_record()
    s.put("w-0", rec)
    raw = closing(redis.Redis.from_url(redis_url))
    m = parse_manifest("w-0", raw.get(s.keys.manifest("w-0")))
    assert raw.delete(s.keys.chunk(m.digests[4])) == 1
    for start, stop in ((0, 32), (8, 30), (31, 32), (40, 45), (40, None), (44, 100)):
        want = rec.rows(start, 45 if stop is None else min(stop, 45))
        assert s.get("w-0", start=start, stop=stop) == want, (start, stop)
    for start, stop in ((0, None), (0, 33), (31, 41), (32, 40), (39, 40)):
        with pytest.raises(RouteEvictedError):
            s.get("w-0", start=start, stop=stop)
    assert s.get_many(["w-0"], missing_ok=True) == [None]
    assert s.get_many(["w-0"], stop=32, missing_ok=True) == [rec.rows(0, 32)]
