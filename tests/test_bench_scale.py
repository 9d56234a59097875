"""``routereplay bench scale`` end to end at a tiny size on its own 3-master Redis Cluster:
writer and reader processes, and redis-benchmark's floor on the same cluster."""

from __future__ import annotations

import pytest

from routereplay.bench.scale import measure, parse_args


@pytest.mark.cluster
def test_bench_scale_tiny() -> None:
    argv = ["--writers", "1,2", "--groups", "2", "--group", "3", "--prompt", "40",
            "--completion", "24", "--block-size", "16", "--step-groups", "2",
            "--verify-every", "2", "--floor-requests", "400", "--floor-clients", "2",
            "--timeout-s", "120"]  # fmt: skip
    res = measure(parse_args(argv))
    assert [s["shape"] for s in res["shapes"]] == ["Qwen3-30B-A3B", "DeepSeek-V3"]
    for shape in res["shapes"]:
        assert [(r["writers"], r["readers"]) for r in shape["rows"]] == [(1, 1), (2, 2)]
        for r in shape["rows"]:
            # Every record written was read back, and the sampled ones (every 2nd of a
            # writer's 6) matched the writers' digests.
            assert r["records"] == 6 * r["writers"]
            assert r["tokens_read"] == r["tokens_written"] > 0
            assert r["verified_records"] == 3 * r["writers"]
            assert r["verified_tokens_read"] == r["verified_tokens_written"] > 0
            for key in ("write_tokens_per_s", "read_tokens_per_s", "stored_bytes_per_token",
                        "write_over_floor", "read_over_floor", "cores_busy",
                        "client_cpu_us_per_token", "redis_cpu_us_per_token"):  # fmt: skip
                assert r[key] > 0, key
            # Records of 52 to 75 tokens span 4 or 5 chunks of 16; a group's 40-token prompt
            # fills 2 of them, stored once for its 3 samples: 4 fewer chunks per group.
            groups = 2 * r["writers"]
            assert 4 * r["records"] - 4 * groups <= r["chunks_written"]
            assert r["chunks_written"] <= 5 * r["records"] - 4 * groups
        floor = shape["floor"]
        assert floor["set_bytes_per_s"] > 0 and floor["get_bytes_per_s"] > 0
        # Some GETs hit the keys the SET phase wrote, and the GET bytes count only those: how
        # many is redis-benchmark's (its cluster mode spreads keys over slots by timing; 0.48
        # to 1.0 seen on the 2-core host), not this code's.
        assert 0 < floor["get_hit_fraction"] <= 1
        assert f"-d {floor['value_bytes']}" in floor["command"]


def test_a_reader_refuses_a_record_other_than_the_one_written(redis_url: str) -> None:
    # What the readers check: a record read back under an id must be the one its writer
    # digested, or the run fails (here the store holds another writer's record under that id).
    from routereplay.bench.scale import Workload, _read_step, make_groups, record_digest, route_pool
    from routereplay.bench.store import SHAPES
    from routereplay.client import RouteStore

    work = Workload(SHAPES[0], groups=1, group=2, prompt=20, completion=10, block_size=16, seed=3)
    pool = route_pool(work)
    (rid, mine), _ = make_groups(work, pool, 0)[0]
    (_, theirs), _ = make_groups(work, pool, 1)[0]
    with RouteStore.from_url(redis_url, prefix="scale-check", block_size=16) as store:
        store.put(rid, theirs)
        out = {"intervals": [], "records": 0, "tokens": 0, "verified_records": 0,
               "verified_tokens_written": 0, "verified_tokens_read": 0}  # fmt: skip
        with pytest.raises(RuntimeError, match=f"record '{rid}' read back differs"):
            _read_step(store, [(rid, mine.num_tokens, record_digest(mine))], out, 0)
        store.put(rid + "-ok", mine)
        _read_step(store, [(rid + "-ok", mine.num_tokens, record_digest(mine))], out, 0)
        assert out["verified_records"] == 1
        assert out["verified_tokens_read"] == mine.num_tokens
