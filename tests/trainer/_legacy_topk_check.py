"""Run in a fresh process with the megatron-core under test first on PYTHONPATH: the legacy replay
top-k (trainer_adapter._legacy) against the release's own top-k function.

For each routing configuration (softmax before/after top-k, sigmoid with and without expert bias,
a scaling factor, group-limited top-k): replaying the router's own choice must reproduce the
release's outputs (gates, map, tokens per expert) and gradients bit for bit, and replaying other
experts must select exactly those. Prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    import megatron.core
    from megatron.core.transformer.moe import router

    from routereplay.trainer_adapter import _legacy

    name = _legacy.install()
    wrapped = getattr(router, name)
    original = wrapped.__routereplay_original__
    counts = name == "topk_softmax_with_capacity"
    torch.manual_seed(0)
    N, E, K = 64, 16, 4
    configs = [
        dict(score_function="softmax", use_pre_softmax=False),
        dict(score_function="softmax", use_pre_softmax=True),
        dict(score_function="softmax", use_pre_softmax=False, scaling_factor=2.5),
        dict(score_function="sigmoid"),
        dict(score_function="sigmoid", expert_bias=torch.randn(E) * 0.1),
        dict(score_function="softmax", num_groups=4, group_topk=2),
        dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=1.5),
    ]
    results = []
    for cfg in configs:
        logits = torch.randn(N, E, dtype=torch.float32)
        # The release's own answer and its gradient.
        la = logits.clone().requires_grad_()
        out = original(la, K, **cfg)
        out[0].pow(2).sum().backward()
        own = out[1]

        def run(rr: object, x: torch.Tensor, cfg: dict = cfg) -> tuple:
            token = _legacy._ACTIVE.set(rr)
            try:
                return wrapped(x, K, **cfg)
            finally:
                _legacy._ACTIVE.reset(token)

        # RECORD: the router's own choice, in its own order (what R2 records).
        rr = _legacy.LegacyRouterReplay()
        rr.set_router_replay_action(_legacy.ReplayAction.RECORD)
        recorded_out = run(rr, logits)
        recorded = rr.get_recorded_indices()
        # Replaying it reproduces the release's outputs and gradient bit for bit.
        rr.set_target_indices(recorded)
        rr.set_router_replay_action(_legacy.ReplayAction.REPLAY_FORWARD)
        lb = logits.clone().requires_grad_()
        rep = run(rr, lb)
        rep[0].pow(2).sum().backward()
        bitwise = (
            torch.equal(recorded_out[1], own)
            and torch.equal(rep[1], own)
            and torch.equal(rep[0], out[0])
            and torch.equal(lb.grad, la.grad)
        )
        if counts:
            bitwise = bitwise and torch.equal(rep[2], out[2])
        # The same experts in another order (an engine's order): the same selection, gates equal
        # up to float summation order.
        own_idx = torch.stack([r.nonzero().flatten() for r in own])
        rr.set_target_indices(own_idx)
        lc = logits.clone().requires_grad_()
        rep_sorted = run(rr, lc)
        rep_sorted[0].pow(2).sum().backward()
        same = (
            torch.equal(rep_sorted[1], own)
            and torch.allclose(rep_sorted[0], out[0], rtol=1e-5, atol=1e-6)
            and torch.allclose(lc.grad, la.grad, rtol=1e-5, atol=1e-6)
        )
        # Other experts: a random top-K set per row is what gets selected, and the gates sum as
        # the release's normalisation says.
        other = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
        rr.set_target_indices(other)
        rep2 = run(rr, logits)
        want = torch.zeros(N, E, dtype=torch.bool).scatter(1, other, True)
        selects = torch.equal(rep2[1], want) and bool((rep2[0][~want] == 0).all())
        # No action: the wrapper is the original, untouched.
        rr.clear_router_replay_action()
        passthrough = torch.equal(run(rr, logits)[1], own)
        results.append(
            {
                "config": {k: (v if not torch.is_tensor(v) else "tensor") for k, v in cfg.items()},
                "reproduces": bool(same),
                "bitwise": bool(bitwise),
                "selects_replayed": selects,
                "passthrough": passthrough,
            }
        )
    ok = all(
        r["bitwise"] and r["reproduces"] and r["selects_replayed"] and r["passthrough"]
        for r in results
    )
    print("RESULT " + json.dumps({"megatron": megatron.core.__version__, "function": name,
                                  "ok": ok, "cases": results}))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
