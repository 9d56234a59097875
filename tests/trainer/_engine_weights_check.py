"""Run in a fresh process (Megatron's parallel state and CPU shims are process-global), with the
megatron-core under test first on PYTHONPATH: ``RouterReplayer(..., weights="engine")`` on a real
MoE layer on CPU.

One MoE layer (8 experts, top-2, float32), replayed with the same ids twice: ids only, and with
engine weights (bfloat16 values, as an engine stores them). Some rows are fillers and some are the
router's own (``replay_mask``). Checks, per router score function:

- the router's output probs equal the engine's weights bit for bit at the replayed rows, and the
  ids-only run's probs elsewhere; both runs route the same experts;
- with the trainer's own probs as the engine's weights, the layer's output is the ids-only one;
- the loss is linear in the probs, so the router's gradient equals ids-only replay's exactly;
- full recompute (Megatron's checkpoint around the layer) and selective recompute ("moe"):
  outputs, probs and every gradient equal the run without recompute.

Prints ``RESULT {json}``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import torch

E, K, H, S, B = 8, 2, 32, 6, 2
N = S * B


def build(score: dict, recompute: str, legacy: bool, dtype: torch.dtype = torch.float32):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw = dict(score)
    if "moe_enable_routing_replay" in fields:
        kw["moe_enable_routing_replay"] = not legacy
    if recompute == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=["moe"])
    cfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64,
        moe_ffn_hidden_size=32, num_moe_experts=E, moe_router_topk=K,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
        moe_grouped_gemm=False, use_cpu_initialization=True, add_bias_linear=False,
        hidden_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16, **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    moe = build_module(
        get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp,
        config=cfg,
        layer_number=1,
    )
    moe.router.layer_number = 1
    return moe.to(dtype)


def targets(rng: np.random.Generator):
    """Ids: the router's own choice on even rows, other experts on odd rows; fillers at rows 0
    and 5 (weights 0), the router's own routing at rows 3 and 8."""
    from routereplay.trainer_adapter import filler_experts

    ids = np.argsort(rng.random((N, E)), axis=1)[:, :K].astype(np.uint8)
    valid = np.ones(N, bool)
    valid[[0, 5]] = False
    ids[~valid] = filler_experts(np.flatnonzero(~valid), E, K)
    replay = np.ones(N, bool)
    replay[[3, 8]] = False
    w = rng.random((N, K)).astype(np.float32) + 0.05
    w = w / w.sum(1, keepdims=True)
    w = torch.from_numpy(w).to(torch.bfloat16).float().numpy()  # an engine's bf16 values
    w[~valid] = 0
    return ids, valid, replay, w


def run(moe, rt, x, g, *, weights: str, recompute: str, legacy: bool):
    """One replayed forward + backward; returns output, the router probs of each router call,
    and the gradients."""
    from megatron.core import tensor_parallel

    from routereplay.trainer_adapter import RouterReplayer

    rep = RouterReplayer(moe, weights=weights, path="legacy" if legacy else "auto")
    calls = []
    h = moe.router.register_forward_hook(lambda m, a, o: calls.append((o[0].detach(), o[1])))
    moe.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    with rep.step():
        with rep.micro_batch(rt):
            if recompute == "full":
                y = tensor_parallel.checkpoint(lambda t: moe(t)[0], False, xi)
            else:
                y = moe(xi)[0]
        (y * g).sum().backward()
    h.remove()
    rep.remove()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    return y.detach(), calls, grads, xi.grad


def refused(moe, ids_t, legacy: bool) -> list[str]:
    """weights="engine" refuses targets without the engine's weights, naming the remedy."""
    from routereplay.trainer_adapter import ReplayConfigError, RouterReplayer

    rep = RouterReplayer(moe, weights="engine", path="legacy" if legacy else "auto")
    out = []
    for name, t in [("no_weights", ids_t), ("raw_ids", torch.from_numpy(ids_t.experts).long())]:
        try:
            rep.set_targets(t)
        except ReplayConfigError as e:
            if "weights='engine'" in str(e):
                out.append(name)
    rep.remove()
    return out


def check(score: dict, legacy: bool) -> dict:
    from routereplay.trainer_adapter import ReplayTargets

    rng = np.random.default_rng(1)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    g = torch.randn(S, B, H, generator=torch.Generator().manual_seed(3))
    moe = build(score, "none", legacy)
    ids, valid, replay, w = targets(rng)
    ids_t = ReplayTargets((0,), ids[None], E, 2, valid, replay_mask=replay)
    eng_t = dataclasses.replace(ids_t, weights=w[None])
    y0, c0, g0, _ = run(moe, ids_t, x, g, weights="ids", recompute="none", legacy=legacy)
    y1, c1, g1, _ = run(moe, eng_t, x, g, weights="engine", recompute="none", legacy=legacy)
    p0, m0 = c0[0]
    p1, m1 = c1[0]
    rows = torch.from_numpy(valid & replay)
    idx = torch.from_numpy(ids).long()
    out = {
        "same_routing_map": torch.equal(m0, m1),
        "engine_rows_exact": torch.equal(p1.gather(1, idx)[rows], torch.from_numpy(w)[rows]),
        "other_rows_own_probs": torch.equal(p1[~rows], p0[~rows]),
        "output_changed": not torch.equal(y0, y1),
        "router_grad_equal": torch.equal(g1["router.weight"], g0["router.weight"]),
        "router_grad_max_diff": float((g1["router.weight"] - g0["router.weight"]).abs().max()),
    }
    # The trainer's own probs as the engine's weights: the ids-only run, bit for bit.
    own = p0.gather(1, idx).numpy().astype(np.float32)
    own[~valid] = 0
    same_t = dataclasses.replace(ids_t, weights=own[None])
    y2, _, g2, _ = run(moe, same_t, x, g, weights="engine", recompute="none", legacy=legacy)
    out["own_probs_reproduce_ids_only"] = torch.equal(y2, y0) and all(
        torch.equal(g2[n], g0[n]) for n in g0
    )
    out["refused"] = refused(moe, ids_t, legacy)
    out["recompute"] = {}
    modes = ["full", "selective"]
    from megatron.core.transformer import TransformerConfig

    if "recompute_modules" not in {f.name for f in dataclasses.fields(TransformerConfig)}:
        modes = ["full"]  # releases without selective recompute of the MoE layer
    for mode in modes:
        m = build(score, mode if mode == "selective" else "none", legacy)
        m.load_state_dict(moe.state_dict())
        y3, c3, g3, _ = run(m, eng_t, x, g, weights="engine", recompute=mode, legacy=legacy)
        out["recompute"][mode] = {
            "router_calls": len(c3),
            "probs_equal": all(torch.equal(p, p1) for p, _ in c3),
            "output_equal": torch.equal(y3, y1),
            "grads_equal": set(g3) == set(g1) and all(torch.equal(g3[n], g1[n]) for n in g1),
        }
    return out


def bf16_check(legacy: bool) -> dict:
    """A bfloat16 layer: the router's probs are bfloat16 and hold the engine's values exactly."""
    from routereplay.trainer_adapter import ReplayTargets

    moe = build(dict(moe_router_pre_softmax=False), "none", legacy, torch.bfloat16)
    ids, valid, replay, w = targets(np.random.default_rng(1))
    t = ReplayTargets((0,), ids[None], E, 2, valid, replay_mask=replay, weights=w[None])
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    _, calls, grads, _ = run(moe, t, x, torch.ones_like(x), weights="engine", recompute="none",
                             legacy=legacy)  # fmt: skip
    p, _ = calls[0]
    rows = torch.from_numpy(valid & replay)
    got = p.gather(1, torch.from_numpy(ids).long())[rows]
    return {
        "probs_dtype": str(p.dtype),
        "engine_rows_exact": torch.equal(got, torch.from_numpy(w)[rows].bfloat16()),
        "router_grad_finite": bool(grads["router.weight"].float().isfinite().all()),
    }


def main() -> int:
    import megatron.core

    from routereplay.experiments import bridge
    from routereplay.trainer_adapter import _megatron

    bridge.init_megatron(torch.device("cpu"))
    legacy = not _megatron.NATIVE or "--legacy" in sys.argv
    scores = {
        "softmax_topk_renormalized": dict(moe_router_pre_softmax=False),
        "softmax_then_topk": dict(moe_router_pre_softmax=True),
        "sigmoid": dict(moe_router_score_function="sigmoid"),
    }
    cases = {name: check(s, legacy) for name, s in scores.items()}
    bf16 = bf16_check(legacy)
    ok = all(
        c["refused"] == ["no_weights", "raw_ids"]
        and c["same_routing_map"] and c["engine_rows_exact"] and c["other_rows_own_probs"]
        and c["output_changed"] and c["router_grad_equal"] and c["own_probs_reproduce_ids_only"]
        and all(r["router_calls"] == 2 and r["probs_equal"] and r["output_equal"]
                and r["grads_equal"] for r in c["recompute"].values())
        for c in cases.values()
    ) and bf16 == {"probs_dtype": "torch.bfloat16", "engine_rows_exact": True,
                   "router_grad_finite": True}  # fmt: skip
    print("RESULT " + json.dumps({"megatron": megatron.core.__version__, "legacy": legacy,
                                  "ok": ok, "cases": cases, "bf16": bf16}))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
