"""``routereplay bench trainer`` runs end to end on a small shape (real redis-server)."""

from __future__ import annotations

import pytest
import redis

from routereplay.bench.trainer import main, measure, parse_args


@pytest.mark.parametrize("routes", ["skewed", "uniform", "progression"])
def test_bench_trainer_small(redis_url, routes):
    argv = ["--routes", routes, "--tokens", "4096", "--layers", "4", "--experts", "64",
            "--topk", "4", "--prompt-len", "64", "--completion-len", "256", "--repeat", "1",
            "--redis-url", redis_url, "--json", "--step-s", "0.2", "--steps", "2",
            "--decode-threads", "2", "--block-size", "64"]  # fmt: skip
    res = measure(parse_args(argv))
    # The peer path was checked to gather the same targets (an assert inside the benchmark);
    # here: every baseline and the prefetch numbers were measured, not left out.
    for key in ("peer_over_ours", "ours_over_floor", "end_to_end_tokens_per_s",
                "peer_over_ours_one_thread", "ours_one_thread_over_floor",
                "end_to_end_fresh_targets_s"):  # fmt: skip
        assert res[key] > 0, key
    assert res["decode_threads"] == 2 and res["routes"] == routes and res["top_k"] == 4
    # CPU per step, measured for both paths on this machine's loopback server, and the bound is
    # that CPU over the cores (no comparison of the two: CPU times move with the machine's load).
    assert res["cpu_ours_process_s"] > 0 and res["cpu_floor_process_s"] > 0
    assert res["cpu_ours_redis_s"] > 0 and res["cpu_floor_redis_s"] > 0
    assert res["cpus"] >= 1
    bound = (res["cpu_ours_process_s"] + res["cpu_ours_redis_s"]) / res["cpus"]
    assert res["cpu_bound_s"] == pytest.approx(bound)
    assert res["cpu_bound_over_floor"] == pytest.approx(bound / res["floor_redis_get_copy_s"])
    # Written in blocks of 64: records of 192 to 447 tokens span 3 to 7 chunks each, and the
    # 64-token prompt is one chunk shared by its group of 8 (at 128 they would span 2 to 4).
    assert res["block_size"] == 64
    assert res["chunks_read"] >= 3 * res["records"] - 7 * res["groups"], res["chunks_read"]
    assert res["step_prefetch_s"] > 0 and "added_serial_pct" in res, sorted(res)
    # On a CPU nothing is installed: the step's part is the preparation alone.
    assert res["step_device"] == "cpu" and res["install_on_gpu_s"] is None


def test_bench_trainer_refuses_a_device_it_cannot_use(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--step-device", "tpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--step-device 'tpu': expected cpu or an available CUDA device" in err
    with pytest.raises(SystemExit):
        main(["--block-size", "0"])
    assert "--block-size must be >= 1, got 0" in capsys.readouterr().err


def test_the_skewed_workload_keeps_its_model() -> None:
    # bench store's skewed model, generated for many sequences at once: ids distinct within each
    # row, about half the slots keep the previous token's expert, popularity skewed per layer,
    # and the same seed gives the same routes.
    import numpy as np

    from routereplay.bench.trainer import ROUTES

    lengths = [1, 40, 300]
    gen = ROUTES["skewed"]
    out = gen(np.random.default_rng(7), lengths, 6, 64, 4)
    assert [x.shape for x in out] == [(n, 6, 4) for n in lengths] and out[0].dtype == np.uint8
    rows = np.concatenate(out).reshape(-1, 4)
    assert all(len(set(r.tolist())) == 4 for r in rows)
    kept = np.mean(out[2][1:] == out[2][:-1])
    assert 0.4 < kept < 0.6, kept
    counts = np.bincount(out[2][:, 0].reshape(-1), minlength=64)
    assert counts.max() > 4 * counts.mean()  # a uniform draw would be within ~2x
    again = gen(np.random.default_rng(7), lengths, 6, 64, 4)
    assert all(np.array_equal(a, b) for a, b in zip(out, again, strict=True))
    for name in ("uniform", "progression"):
        rows = np.concatenate(ROUTES[name](np.random.default_rng(1), lengths, 6, 64, 4))
        assert all(len(set(r.tolist())) == 4 for r in rows.reshape(-1, 4)), name


def test_redis_cpu_counts_every_server(redis_url, redis_cluster_url) -> None:
    # The bench's CPU line reads the redis-server's CPU from INFO: a number that grows as the
    # server works, and for a cluster every node's (a cluster client's INFO asks one node).
    from routereplay.bench.trainer import redis_cpu_s
    from routereplay.client import RouteStore

    store = RouteStore.from_url(redis_url, prefix="cpu-info")
    a = redis_cpu_s(store.redis)
    for _ in range(200):
        store.exists("nothing-here")
    b = redis_cpu_s(store.redis)
    assert a is not None and b is not None and b > a
    store.close()
    cluster = RouteStore.from_url(redis_cluster_url, prefix="cpu-info", cluster=True)
    total = redis_cpu_s(cluster.redis)
    nodes = cluster.redis.get_nodes()
    singles = [redis.Redis(host=n.host, port=n.port) for n in nodes]
    one = max(redis_cpu_s(r) or 0.0 for r in singles)
    for r in singles:
        r.close()
    assert len(nodes) == 3 and total is not None and total > one > 0
    cluster.close()
