"""Replay through a real megatron-core GPTModel on CPU (gloo), records stored in a real Redis.

Each case runs tests/gpu/replay_check.py in fresh processes (world size 1, or 2/4 gloo ranks
through torch.distributed.run): Megatron's parallel state and the test-only CPU shims are
process-global. The script proves, with forward hooks on every router and expert, that every
(token, MoE layer) used the replayed experts, in the forward and in the activation recompute, with
the row order derived from Megatron's own sharding functions. The GPU machine runs the same script
(tests/gpu/run_gpu_checks.sh).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

GPU_DIR = Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU_DIR))
from harness import assert_policy, run_check  # noqa: E402


def assert_exact(results: list[dict], *, recompute: bool = True) -> None:
    for r in results:
        assert r["ok"], r
        assert r["targets_equal_truth"] == [True] * r["args"]["micro_batches"], r
        if r["args"]["pp"] == 1:
            assert r["router_layer_numbers"] == [2, 3, 4]  # layer 1 is dense
        assert r["router_grads_nonzero"]
        assert r["expert_count_mismatches"] == []
        for layer, st in r["router_rows"].items():
            assert st["bad"] == 0, (layer, st)
            assert st["fwd"] > 0
            if recompute:
                assert st["rec"] == st["fwd"], (layer, st)


def test_world1_thd_redis_recompute_r2_and_guards(redis_url):
    """THD pack of plain, shared-prefix and multi-turn samples fetched from Redis; full recompute;
    R2 record/replay; a short target raises; bypassing configs are refused; stale global
    RouterReplay instances from an earlier model build do not matter."""
    (r,) = run_check(1, "--extras", "--recompute", "full", redis_url=redis_url)
    assert_exact([r])
    assert r["records_from"] == "redis"
    assert r["r2"] == {"same_loss": True, "routes_match": True}
    assert "router sees 128 tokens but the replay target has 127 rows" in r["short_target_raises"]
    assert r["refused"] == [
        "moe_router_fusion",
        "moe_router_load_balancing_type",
        "moe_expert_capacity_factor",
    ]
    assert r["stale_instances_before_build"] == 3 and r["global_instances"] == 6
    assert r["nograd_forward_in_step_raises"]
    assert r["refused_targets"] == ["top_k", "expert_range", "num_experts", "missing_layer"]


def test_world1_left_padded_selective_recompute(redis_url):
    assert_exact(
        run_check(1, "--layout", "padded-left", "--recompute", "selective", redis_url=redis_url)
    )


def test_tp2_sequence_parallel_thd(redis_url):
    res = run_check(2, "--tp", "2", "--sp", redis_url=redis_url)
    assert_exact(res)
    assert all(st["fwd"] == 128 for r in res for st in r["router_rows"].values())  # 2 x 64 rows


def test_cp2_thd_zigzag(redis_url):
    assert_exact(run_check(2, "--cp", "2", redis_url=redis_url))


def test_cp2_padded_get_batch_on_this_cp_rank(redis_url):
    assert_exact(run_check(2, "--cp", "2", "--layout", "padded", redis_url=redis_url))


def test_ep2_allgather_distinct_data_per_replica(redis_url):
    assert_exact(run_check(2, "--ep", "2", redis_url=redis_url))


def test_tp2_sp_cp2_four_ranks(redis_url):
    assert_exact(run_check(4, "--tp", "2", "--sp", "--cp", "2", redis_url=redis_url))


def test_tp2_pp2_vpp2_sequence_parallel_four_ranks(redis_url):
    """Issue 5's first configuration on CPU (4 gloo ranks): TP2 x PP2 with 2 chunks per stage,
    sequence parallel, selective recompute. Each TP pair replays its SP slice of its stage's
    chunks' layers (stage 0: layer 3; stage 1: layers 2 and 4)."""
    res = run_check(
        4, "--tp", "2", "--sp", "--pp", "2", "--vpp", "2", "--micro-batches", "4",
        "--recompute", "selective", redis_url=redis_url,
    )  # fmt: skip
    assert_exact(res)
    assert sorted(r["router_layer_numbers"] for r in res) == [[2, 4], [2, 4], [3], [3]]


def test_ep4_with_fillers_four_ranks(redis_url):
    """Issue 5's second configuration on CPU: EP4 (allgather; the alltoall dispatcher needs CUDA),
    padded batches whose padding rows get distinct fillers, selective recompute."""
    res = run_check(
        4, "--ep", "4", "--layout", "padded", "--recompute", "selective", redis_url=redis_url
    )
    assert_exact(res)
    assert all(sum(r["filler_rows"]) > 0 for r in res)


def test_pp2_1f1b_schedule_stage_layers(redis_url):
    """Megatron's own 1F1B schedule; forward_step wraps the model call in micro_batch(); each
    stage replays only its routers, matched by global layer number (stage 0: 2, stage 1: 3, 4)."""
    res = run_check(2, "--pp", "2", "--micro-batches", "4", redis_url=redis_url)
    assert_exact(res)
    assert [r["router_layer_numbers"] for r in res] == [[2], [3, 4]]


def test_pp2_vpp2_interleaved_chunks(redis_url):
    """Interleaved schedule, 2 chunks per stage, 1 layer per chunk: stage 0 holds layers 1
    (dense) and 3, stage 1 holds 2 and 4. Targets are installed per chunk; without the chunk the
    installer refuses (installing into every chunk misaligns recompute, measured: ~24% wrong rows).
    """
    res = run_check(2, "--pp", "2", "--vpp", "2", "--micro-batches", "4", redis_url=redis_url)
    assert_exact(res)
    assert [r["router_layer_numbers"] for r in res] == [[3], [2, 4]]
    assert [r["router_chunks"] for r in res] == [[1], [0, 1]]
    assert all(r["vpp_requires_chunk"] for r in res)


def test_own_routing_thd_full_recompute_from_redis(redis_url):
    """ReplayPolicy(on_violation="own_routing") on a THD pack whose first record is stale and
    whose fifth is missing from Redis (get_many(missing_ok=True)): the router chooses those
    samples' experts, and the full recompute repeats its choice although the router weights
    changed before the backward."""
    res = run_check(
        1, "--policy", "own_routing", "--recompute", "full", "--perturb-router",
        redis_url=redis_url,
    )  # fmt: skip
    assert res[0]["records_from"] == "redis"
    assert_exact(res)
    assert_policy(res, "own_routing", perturbed=True)


def test_own_routing_left_padded_selective_recompute(redis_url):
    res = run_check(
        1, "--policy", "own_routing", "--layout", "padded-left", "--recompute", "selective",
        redis_url=redis_url,
    )  # fmt: skip
    assert_exact(res)
    assert_policy(res, "own_routing")


def test_own_routing_tp2_sequence_parallel(redis_url):
    """Each TP rank's SP slice holds part of the router's own rows."""
    res = run_check(
        2, "--tp", "2", "--sp", "--policy", "own_routing", "--recompute", "full",
        "--perturb-router", redis_url=redis_url,
    )  # fmt: skip
    assert_exact(res)
    assert_policy(res, "own_routing", perturbed=True)


def test_drop_repacks_the_kept_samples_thd(redis_url):
    res = run_check(1, "--policy", "drop", "--recompute", "full", redis_url=redis_url)
    assert_exact(res)
    assert_policy(res, "drop")


def test_drop_repacks_the_kept_samples_padded_cp2(redis_url):
    res = run_check(2, "--cp", "2", "--policy", "drop", "--layout", "padded", redis_url=redis_url)
    assert_exact(res)
    assert_policy(res, "drop")


def test_check_replay_config_refuses_bypasses():
    from megatron.core.transformer import TransformerConfig

    from routereplay.trainer_adapter import ReplayConfigError, check_replay_config

    base = dict(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_enable_routing_replay=True,
    )
    check_replay_config(TransformerConfig(**base))
    for extra, match in [
        ({"moe_enable_routing_replay": False}, "moe_enable_routing_replay is False"),
        ({"moe_router_load_balancing_type": "sinkhorn", "moe_router_topk": 1}, "sinkhorn"),
        ({"moe_expert_capacity_factor": 1.0}, "token dropping"),
        ({"moe_router_force_load_balancing": True}, "random logits"),
    ]:
        with pytest.raises(ReplayConfigError, match=match):
            check_replay_config(TransformerConfig(**{**base, **extra}))


def assert_engine_weights(results: list[dict]) -> None:
    """Every replayed router row's gates were the engine's weights, bit for bit, in the forward
    and the recompute; the gathered weights equal a per-position lookup."""
    for r in results:
        assert r["weights_equal_truth"] == [True] * r["args"]["micro_batches"], r
        for layer, st in r["router_rows"].items():
            assert st["w_bad"] == 0 and st["w_rows"] > 0, (layer, st)


def test_engine_weights_tp2_sequence_parallel_full_recompute(redis_url):
    res = run_check(
        2, "--tp", "2", "--sp", "--weights", "engine", "--recompute", "full", redis_url=redis_url
    )
    assert_exact(res)
    assert_engine_weights(res)


def test_engine_weights_cp2_padded(redis_url):
    res = run_check(
        2, "--cp", "2", "--layout", "padded", "--weights", "engine", redis_url=redis_url
    )
    assert_exact(res)
    assert_engine_weights(res)


def test_engine_weights_own_routing_left_padded_selective_recompute(redis_url):
    """The router's own rows keep its probabilities; the others take the engine's weights."""
    res = run_check(
        1, "--policy", "own_routing", "--layout", "padded-left", "--recompute", "selective",
        "--weights", "engine", redis_url=redis_url,
    )  # fmt: skip
    assert_exact(res)
    assert_engine_weights(res)
    assert_policy(res, "own_routing")


def test_engine_weights_pp2_1f1b_selective_recompute(redis_url):
    res = run_check(
        2, "--pp", "2", "--micro-batches", "4", "--weights", "engine", "--recompute", "selective",
        redis_url=redis_url,
    )  # fmt: skip
    assert_exact(res)
    assert_engine_weights(res)


def test_engine_weights_forced_legacy_left_padded_selective_recompute(redis_url):
    res = run_check(
        1, "--weights", "engine", "--replay-path", "legacy", "--layout", "padded-left",
        "--recompute", "selective", redis_url=redis_url,
    )  # fmt: skip
    assert res[0]["replay_path"] == "legacy"
    assert_exact(res)
    assert_engine_weights(res)
