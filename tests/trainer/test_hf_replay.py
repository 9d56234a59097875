"""Routing replay into transformers MoE models (routereplay.trainer_adapter.hf), on CPU, for
every supported family built small from its config: the replayed experts reach the experts
module exactly, the router's own choice replayed changes nothing bit for bit, the router still
gets a gradient, activation checkpointing and torch.compile replay the same rows, the engine's
weights reach the experts exactly, and what cannot replay (another model, a call outside
micro_batch, a forward that skips the routers) is refused."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM

from routereplay.trainer_adapter import ReplayTargets
from routereplay.trainer_adapter.errors import (
    ReplayConfigError,
    RouteLayerMismatchError,
    TargetShapeError,
)
from routereplay.trainer_adapter.hf import (
    SUPPORTED_MODEL_TYPES,
    HFRouterReplayer,
    find_hf_routers,
    packed_inputs,
)

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               max_position_embeddings=256)  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        norm_topk_prob=False,
    ),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        num_key_value_heads=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    "gpt_oss": dict(
        num_local_experts=8, num_experts_per_tok=2, layer_types=None, sliding_window=64
    ),
}


def _model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **CONFIGS[model_type]})
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _experts_seen(model: Any) -> tuple[dict[int, list], list]:
    """Pre-hooks on each MoE block's experts: the (indices, weights) they were handed."""
    seen: dict[int, list] = {}
    hooks = []
    for r in find_hf_routers(model):
        block = model.get_submodule(r.name.rsplit(".", 1)[0])
        seen[r.layer] = []
        hooks.append(block.experts.register_forward_pre_hook(
            lambda m, a, layer=r.layer: seen[layer].append((a[1].clone(), a[2].detach().clone()))
        ))  # fmt: skip
    return seen, hooks


def _targets(model: Any, n: int, rng: np.random.Generator, weights: bool = False) -> Any:
    routers = find_hf_routers(model)
    E, K = routers[0].num_experts, routers[0].top_k
    ex = np.stack([[rng.permutation(E)[:K] for _ in range(n)] for _ in routers]).astype(np.uint8)
    w = rng.random(ex.shape).astype(np.float32) if weights else None
    # One sequence of n tokens: a [1, n] batch.
    return ReplayTargets(tuple(r.layer for r in routers), ex, E, weights=w, batch_shape=(1, n))


def _record(rng: np.random.Generator, layers: tuple[int, ...], T: int, **kw: Any) -> Any:
    """A record of ``T`` random tokens routed top-2 of 8 on ``layers``; its final sampled token
    has no route."""
    from routereplay.client import RouteRecord

    ex = np.stack([[rng.permutation(8)[:2] for _ in layers] for _ in range(T)])
    valid = np.ones(T, bool)
    valid[-1] = False
    return RouteRecord(rng.integers(3, 96, T), ex.astype(np.uint8), valid, layers, 3, 8, **kw)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_replayed_experts_reach_the_experts(model_type: str) -> None:
    model = _model(model_type)
    rep = HFRouterReplayer(model, shadow=True)
    assert rep.layers == tuple(sorted(rep.layers)) and len(rep.layers) >= 2
    ids = torch.randint(3, 96, (1, 24))
    t = _targets(model, 24, np.random.default_rng(1))
    seen, hooks = _experts_seen(model)
    with rep.micro_batch(t):
        out = model(ids).logits
        out.float().pow(2).mean().backward()
    for k, layer in enumerate(rep.layers):
        got_idx, got_w = seen[layer][0]
        assert np.array_equal(got_idx.numpy(), t.experts[k].astype(np.int64))
        assert torch.isfinite(got_w).all()
        grad = find_hf_routers(model)[k].module.weight.grad
        assert grad is not None and grad.abs().sum() > 0  # the router still learns
    assert 0.0 < rep.shadow_report().token_mismatch() <= 1.0
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_replaying_the_routers_own_choice_changes_nothing(model_type: str) -> None:
    model = _model(model_type, torch.bfloat16).eval()
    ids = torch.randint(3, 96, (2, 16))
    own: dict[int, torch.Tensor] = {}
    routers = find_hf_routers(model)
    hooks = [
        r.module.register_forward_hook(
            lambda m, a, o, layer=r.layer: own.__setitem__(layer, o[2].clone())
        )
        for r in routers
    ]
    with torch.no_grad():
        plain = model(ids).logits
    for h in hooks:
        h.remove()
    # The routers saw batch-major rows; the targets are sequence-major (as gather_targets writes).
    seqmajor = [own[r.layer].reshape(2, 16, -1).transpose(0, 1).reshape(32, -1) for r in routers]
    t = ReplayTargets(tuple(r.layer for r in routers), torch.stack(seqmajor).numpy().astype(
        np.uint8), routers[0].num_experts)  # fmt: skip
    rep = HFRouterReplayer(model, shadow=True)
    with torch.no_grad(), rep.micro_batch(t, batch_size=2):
        replayed = model(ids).logits
    assert torch.equal(plain, replayed)
    assert rep.shadow_report().token_mismatch() == 0.0


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_activation_checkpointing_replays_the_same_rows(model_type: str) -> None:
    ids = torch.randint(3, 96, (1, 20))
    t = _targets(_model(model_type), 20, np.random.default_rng(2))
    grads = []
    for ckpt in (False, True):
        model = _model(model_type).train()
        if ckpt:
            model.gradient_checkpointing_enable()
        rep = HFRouterReplayer(model)
        seen, hooks = _experts_seen(model)
        with rep.micro_batch(t):
            model(ids).logits.float().pow(2).mean().backward()
        calls = {layer: len(v) for layer, v in seen.items()}
        assert set(calls.values()) == {2 if ckpt else 1}  # the recompute ran the routers again
        for layer, v in seen.items():
            for idx, _ in v:
                assert np.array_equal(idx.numpy(), t.experts[rep.layers.index(layer)])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        for h in hooks:
            h.remove()
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_uses_each_micro_batchs_targets() -> None:
    model = _model("qwen3_moe")
    rep = HFRouterReplayer(model)
    seen, _ = _experts_seen(model)
    ts = [_targets(model, 12, np.random.default_rng(s)) for s in (3, 4)]
    for t in ts:
        with rep.micro_batch(t):
            model(torch.randint(3, 96, (1, 12))).logits.sum().backward()
    layer = rep.layers[0]
    for i, t in enumerate(ts):
        assert np.array_equal(seen[layer][i][0].numpy(), t.experts[0])


def test_engine_weights_reach_the_experts_with_a_straight_through_gradient() -> None:
    model = _model("qwen3_moe")
    t = _targets(model, 16, np.random.default_rng(5), weights=True)
    seen, _ = _experts_seen(model)
    rep = HFRouterReplayer(model, weights="engine")
    with rep.micro_batch(t):
        model(torch.randint(3, 96, (1, 16))).logits.float().pow(2).mean().backward()
    for k, layer in enumerate(rep.layers):
        assert torch.equal(seen[layer][0][1], torch.from_numpy(t.weights[k]))
        assert find_hf_routers(model)[k].module.weight.grad.abs().sum() > 0
    with pytest.raises(ReplayConfigError, match="no engine weights"):
        with rep.micro_batch(_targets(model, 16, np.random.default_rng(5))):
            pass


def test_rows_without_a_route_keep_the_routers_choice() -> None:
    model = _model("mixtral")
    t = _targets(model, 10, np.random.default_rng(6))
    valid = np.array([True] * 6 + [False] * 4)
    t = ReplayTargets(t.layers, t.experts, t.num_experts, valid=valid,
                      replay_mask=np.array([True, False] + [True] * 8),
                      batch_shape=(1, 10))  # fmt: skip
    own: dict[int, torch.Tensor] = {}
    for r in find_hf_routers(model):
        r.module.register_forward_hook(
            lambda m, a, o, layer=r.layer: own.__setitem__(layer, o[2].clone())
        )
    seen, _ = _experts_seen(model)
    rep = HFRouterReplayer(model)
    with torch.no_grad(), rep.micro_batch(t):
        model(torch.randint(3, 96, (1, 10)))
    replay = valid & t.replay_mask
    for k, layer in enumerate(rep.layers):
        idx = seen[layer][0][0].numpy()
        assert np.array_equal(idx[replay], t.experts[k][replay])
        assert np.array_equal(idx[~replay], own[layer].numpy()[~replay])


def test_packed_inputs_isolate_their_sequences() -> None:
    model = _model("olmoe").eval()
    a, b = torch.randint(3, 96, (9,)).tolist(), torch.randint(3, 96, (7,)).tolist()
    ids, pos, mask = packed_inputs([a, b])
    with torch.no_grad():
        packed = model(ids, position_ids=pos, attention_mask=mask).logits[0]
        alone = [model(torch.tensor([s])).logits[0] for s in (a, b)]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-5)


def test_what_cannot_replay_is_refused() -> None:
    cfg = AutoConfig.for_model("llama", **_COMMON)
    with pytest.raises(ReplayConfigError, match="LlamaForCausalLM"):
        HFRouterReplayer(AutoModelForCausalLM.from_config(cfg))
    model = _model("qwen3_moe")
    rep = HFRouterReplayer(model)
    ids = torch.randint(3, 96, (1, 8))
    with pytest.raises(ReplayConfigError, match="outside micro_batch"):
        model(ids)
    with pytest.raises(TargetShapeError, match="8 rows"):
        with rep.micro_batch(_targets(model, 9, np.random.default_rng(0))):
            model(ids)
    t = _targets(model, 8, np.random.default_rng(0))
    with pytest.raises(RouteLayerMismatchError):
        with rep.micro_batch(ReplayTargets(t.layers[:1], t.experts[:1], t.num_experts)):
            pass
    with pytest.raises(ReplayConfigError, match="never ran inside micro_batch"):
        with rep.micro_batch(t):
            pass  # no forward: nothing consumed the targets


def test_older_router_layouts_are_refused() -> None:
    """The router layouts of transformers releases before MIN_TRANSFORMERS, reproduced on the
    installed one: refused by name, never replayed with the wrong weights."""
    # Before 5.6 the Qwen routers' first output is the softmax, not the logits.
    model = _model("qwen3_moe")
    for r in find_hf_routers(model):
        r.module.register_forward_hook(lambda m, a, out: (out[0].softmax(-1), *out[1:]))
    rep = HFRouterReplayer(model)
    with pytest.raises(ReplayConfigError, match=r"differently .*transformers >= 5\.13"):
        with rep.micro_batch(_targets(model, 8, np.random.default_rng(0))):
            model(torch.randint(3, 96, (1, 8)))
    # Before 5.13 DeepSeek-V3's router has no top_k and returns its logits alone.
    model = _model("deepseek_v3")
    router = find_hf_routers(model)[0].module
    router.register_forward_hook(lambda m, a, out: out[0])
    rep = HFRouterReplayer(model)
    with pytest.raises(ReplayConfigError, match="does not return a 3-tuple"):
        with rep.micro_batch(_targets(model, 8, np.random.default_rng(0))):
            model(torch.randint(3, 96, (1, 8)))
    del router.top_k
    with pytest.raises(ReplayConfigError, match=r"has no top_k.*transformers >= 5\.13"):
        HFRouterReplayer(model)


@pytest.mark.slow  # compiles the model: 15-25 s each
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_replays(backend: str) -> None:
    # The hooks run eagerly between the compiled graphs: every call replays its own targets.
    model = _model("qwen3_moe")
    rep = HFRouterReplayer(model)
    seen, _ = _experts_seen(model)
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(3, 96, (1, 8))
    for seed in (0, 1):
        t = _targets(model, 8, np.random.default_rng(seed))
        with rep.micro_batch(t):
            compiled(ids).logits.sum().backward()
        for k, layer in enumerate(rep.layers):
            assert np.array_equal(seen[layer][-1][0].numpy(), t.experts[k])


def _padded_batch(rep: HFRouterReplayer, padding_side: str, S: int = 12) -> tuple:
    from routereplay.trainer_adapter import padded_position_map, sample_from_record

    rng = np.random.default_rng(7)
    records = []
    for T in (9, 12, 5):
        r = _record(rng, rep.layers, T, prompt_len=2)
        w = rng.random(r.experts.shape).astype(np.float32) * r.valid[:, None, None]
        records.append(dataclasses.replace(r, weights=w, weights_dtype="float32"))
    samples = [sample_from_record(i, r) for i, r in enumerate(records)]
    pmap = padded_position_map(samples, S, padding_side=padding_side)
    ids = np.zeros((3, S), np.int64)
    for b, r in enumerate(records):
        T = r.num_tokens
        ids[b, slice(0, T) if padding_side == "right" else slice(S - T, S)] = r.token_ids
    return records, pmap, ids


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize(
    "order,batch_size", [("sequence", None), ("sequence", 3), ("batch", None), ("batch", 3)]
)
def test_padded_batch_from_records(padding_side: str, order: str, batch_size: int | None) -> None:
    # Each (b, s) of a [B=3, S] padded batch gets its own record's row, ids and engine weights,
    # whichever order gather_targets wrote and whether or not batch_size is passed (the targets
    # carry their batch shape); padding keeps the router's own choice.
    from routereplay.trainer_adapter import gather_targets

    model = _model("qwen3_moe")
    rep = HFRouterReplayer(model, weights="engine")
    records, pmap, ids = _padded_batch(rep, padding_side)
    S, K = ids.shape[1], 2
    targets = gather_targets(pmap, records, rep.layers, input_ids=ids, weights=True, order=order)
    assert targets.batch_shape == (3, S) and targets.order == order
    seen, _ = _experts_seen(model)
    with torch.no_grad(), rep.micro_batch(targets, batch_size=batch_size):
        model(torch.from_numpy(ids))
    for k, layer in enumerate(rep.layers):
        got = seen[layer][0][0].numpy().reshape(3, S, K)
        got_w = seen[layer][0][1].numpy().reshape(3, S, K)
        for b, r in enumerate(records):
            T = r.num_tokens
            s0 = 0 if padding_side == "right" else S - T
            want = r.experts[: T - 1, k].astype(np.int64)  # the valid rows
            assert np.array_equal(got[b, s0 : s0 + T - 1], want), (layer, b)
            assert np.array_equal(got_w[b, s0 : s0 + T - 1], r.weights[: T - 1, k]), (layer, b)


def test_a_batch_layout_that_disagrees_is_refused() -> None:
    from routereplay.trainer_adapter import gather_targets

    model = _model("qwen3_moe")
    rep = HFRouterReplayer(model)
    records, pmap, _ = _padded_batch(rep, "right")
    targets = gather_targets(pmap, records, rep.layers)
    with pytest.raises(TargetShapeError, match=r"batch_size=1, but .*\[B=3, S=12\]"):
        with rep.micro_batch(targets, batch_size=1):
            pass
    by_hand = ReplayTargets(targets.layers, targets.experts, targets.num_experts)
    with pytest.raises(ReplayConfigError, match="carry no batch shape"):
        with rep.micro_batch(by_hand):
            pass
    with pytest.raises(TargetShapeError, match="batch_shape"):
        ReplayTargets(targets.layers, targets.experts, 8, batch_shape=(2, 12))


def test_policy_coverage_and_prefetcher_drive_the_hf_replayer() -> None:
    # The trainer-neutral half unchanged: Prefetcher prepares each step's targets in its
    # thread, ReplayPolicy hands a stale sample to the router (own_routing), batch_coverage
    # counts what replays; the transformers replayer follows the mask.
    from routereplay.client import RouteRecord
    from routereplay.trainer_adapter import (
        Prefetcher,
        ReplayPolicy,
        batch_coverage,
        gather_targets,
        sample_from_record,
        thd_position_map,
    )

    model = _model("qwen3_moe")
    rep = HFRouterReplayer(model)
    rng = np.random.default_rng(9)

    def record(version: str, T: int) -> RouteRecord:
        return _record(rng, rep.layers, T, weight_versions=[(version, 0, T)])

    steps = [[record("step-2", 7), record("step-1", 5)], [record("step-2", 6)]]
    policy = ReplayPolicy(require_version="step-2", on_violation="own_routing")

    def prepare(records: list) -> tuple:
        cu = np.cumsum([0] + [r.num_tokens for r in records])
        pmap = thd_position_map([sample_from_record(i, r) for i, r in enumerate(records)], cu)
        report = policy.decide(pmap, records, rep.layers)
        targets = gather_targets(pmap, records, rep.layers, own_routing=report.own_routing)
        ids = np.concatenate([r.token_ids for r in records])[None]
        return ids, targets, report, batch_coverage(pmap, records, rep.layers)

    seen, _ = _experts_seen(model)
    with Prefetcher(prepare, steps, depth=1) as prepared:
        for (ids, targets, report, cov), records in zip(prepared, steps, strict=True):
            with torch.no_grad(), rep.micro_batch(targets):
                model(torch.from_numpy(ids))
            own = np.concatenate([np.full(r.num_tokens, r.weight_version == "step-1")
                                  for r in records])  # fmt: skip
            assert len(report.own_routing) == int(any(own))  # the stale sample, if any
            mask = np.ones(own.size, bool) if targets.replay_mask is None else targets.replay_mask
            assert np.array_equal(~mask, own)  # exactly the stale sample's rows
            assert cov.replayed == sum(r.num_tokens - 1 for r in records)
            replay = targets.valid & mask
            for k, layer in enumerate(rep.layers):
                got = seen[layer][-1][0].numpy()
                assert np.array_equal(got[replay], targets.experts[k][replay])
