"""Run in a fresh process (Megatron's parallel state and CPU shims are process-global).

1. The Qwen3-MoE bridge: Megatron logits equal Hugging Face transformers' (float32), weights
   round-trip exactly.
2. Shadow diagnostics: replaying the router's own choice counts 0 mismatches; replaying other
   experts counts exactly the differing (token, layer) decisions, filler rows left out.
3. Its cost: the replayed forward with shadow on vs off (median of interleaved runs).

Prints one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch


def main(variant: str) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from transformers import AutoModelForCausalLM

    from routereplay.experiments import bridge
    from routereplay.service.tiny_model import ensure_tiny_model
    from routereplay.trainer_adapter import ReplayTargets, RouterReplayer

    torch.set_num_threads(1)
    path = ensure_tiny_model(variant)
    cfg, state = bridge.load_hf_checkpoint(path)
    bridge.init_megatron(torch.device("cpu"))
    model = bridge.build_model(cfg)
    bridge.load_hf_weights(model, state, cfg)
    model.eval()
    out: dict = {"variant": variant, "moe_layers": bridge.moe_layers_of(cfg)}

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()  # fmt: skip
    B, S = 4, 64
    ids = torch.randint(
        3, int(cfg["vocab_size"]), (B, S), generator=torch.Generator().manual_seed(0)
    )
    pos = torch.arange(S)[None].expand(B, -1)
    mask = bridge.causal_mask(S)
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids, pos, mask)
    out["max_abs_logit_diff"] = float((got - ref).abs().max())
    out["max_abs_logit"] = float(ref.abs().max())
    back = bridge.export_hf_weights(model, cfg)
    out["roundtrip_exact"] = set(back) == set(state) and all(
        torch.equal(back[k], state[k]) for k in state
    )

    rep = RouterReplayer(model, shadow=True)
    layers = rep.layers
    # The router's own choice, recorded.
    for s in rep.slots:
        s.replay.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        model(ids, pos, mask)
    own = np.stack([s.replay.get_recorded_indices().numpy() for s in rep.slots]).astype(np.uint8)
    rep.clear()
    E = int(cfg.get("num_experts") or cfg["num_local_experts"])
    K = int(cfg["num_experts_per_tok"])

    def replay(experts: np.ndarray, valid: np.ndarray | None) -> None:
        t = ReplayTargets(layers, experts, E, 0, valid)
        with torch.no_grad(), rep.step(), rep.micro_batch(t):
            model(ids, pos, mask)

    replay(own, None)
    same = rep.shadow_report()
    out["own_choice_token_mismatch"] = same.token_mismatch()
    # Other experts on a known set of rows: rotate the experts of every 3rd row by one.
    other = own.copy()
    rows = np.arange(B * S)
    changed = rows % 3 == 0
    other[:, changed] = (other[:, changed] + 1) % E
    valid = rows % 5 != 0  # and leave every 5th row out as a filler
    replay(other, valid)
    rpt = rep.shadow_report()
    # A rotated row's set differs unless the rotation maps the set onto itself (impossible for
    # K < E distinct experts... except wrap-around sets like {E-1, 0}): count exactly.
    own_sets = np.sort(own, axis=2)
    other_sets = np.sort(other, axis=2)
    differ = (own_sets != other_sets).any(axis=2)  # [M, N]
    expect = differ[:, valid].sum() / (differ.shape[0] * valid.sum())
    out["rotated_token_mismatch"] = rpt.token_mismatch()
    out["expected_token_mismatch"] = float(expect)
    out["per_layer_rows"] = {int(k): v[0] for k, v in rpt.per_layer.items()}
    out["valid_rows"] = int(valid.sum())
    out["top_k"] = K

    # Cost: the replayed forward (with grad, as in training) with and without shadow.
    big = torch.randint(
        3, int(cfg["vocab_size"]), (8, 256), generator=torch.Generator().manual_seed(1)
    )
    bpos = torch.arange(256)[None].expand(8, -1)
    bmask = bridge.causal_mask(256)
    for s in rep.slots:
        s.replay.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        model(big, bpos, bmask)
    own_big = np.stack([s.replay.get_recorded_indices().numpy() for s in rep.slots]).astype(
        np.uint8
    )
    rep.clear()
    tb = ReplayTargets(layers, own_big, E, 0, None)
    rep.clear()

    def timed(backward: bool) -> float:
        t0 = time.perf_counter()
        with rep.step(), rep.micro_batch(tb):
            y = model(big, bpos, bmask)
            if backward:
                y.sum().backward()
        return time.perf_counter() - t0

    result = {}
    for backward in (False, True):
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(16):  # interleaved: the machine's load drifts
            for on in (False, True) if i % 2 else (True, False):
                rep.shadow = on
                times[on].append(timed(backward))
        off_med, on_med = statistics.median(times[False]), statistics.median(times[True])
        key = "forward_backward" if backward else "forward"
        result[key] = {"shadow_off_s": off_med, "shadow_on_s": on_med,
                       "overhead": on_med / off_med - 1}  # fmt: skip
    rep.shadow_report()
    out["cost"] = result
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "moe")
