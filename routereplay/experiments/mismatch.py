"""``routereplay experiment mismatch``: how much of the train-inference gap routing replay closes.

1. Rollouts (``--dtype`` each): the model served by ``routereplay serve`` (vLLM, prefix caching
   on) with the sampled tokens' logprobs: independent prompts, a GRPO group (``n = 4``) and a
   3-turn trajectory whose turns re-send the history as token ids (later turns hit the prefix
   cache). Routes fetched from the service.
2. The trainer: the same weights in Megatron-Core (``bridge``), the rollouts packed in one row
   (THD sequences, the group as one prompt + its completions, the trajectory as its last turn;
   ``packing``), the sampled tokens' logprobs computed with replay ON (the engine's experts) and
   OFF (the trainer's own routing), and with the engine's ids AND routing weights replayed
   (``RouterReplayer(weights="engine")``; the service captures them, ``--route-weights``).
3. Reported per dtype: route agreement (share of (token, MoE layer) decisions equal to vLLM's:
   checked on the routers' routing maps with replay on, recorded with replay off), mean and max
   |logprob difference| to the engine's, and the k3 estimate of KL(engine || trainer). With
   ``--router-fp32`` also replay (ids, and ids + weights) with the router computed in float32
   (Megatron's ``moe_router_dtype``): what of the remaining gap the routing weights (not the
   expert ids) hold. The slot order on its own: ids + weights with each row's slots shuffled,
   against the same forward run again (``--deterministic``: torch's deterministic algorithms).

``--trainer hf`` runs steps 2-3 with the Hugging Face transformers model instead
(``HFRouterReplayer``; every rollout a whole sequence of a position-id pack; replay on, off and
ids + weights). ``--save-rollouts FILE`` writes step 1's data (records, tokens, engine logprobs)
and ``--from-rollouts FILE`` runs steps 2-3 from it elsewhere (the GPU machine has no vLLM).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "run_trainer", "run_trainer_hf"]

PROMPTS = [
    "The router picks two experts for every token of the batch",
    "Replay the rollout routes in the training step",
    "A mixture of experts model routes each token",
    "The policy gradient needs the rollout logprobs",
    "Which expert handles the query of this layer",
    "Reward the sample that keeps the cache warm",
]
FOLLOW_UPS = [" And then the gradient of the reward", " Finally the value of the policy"]
LABELS = {
    "replay_ids_weights": "replay ids + weights",
    "replay_ids_weights_again": "ids + weights, run again",
    "replay_ids_weights_slots_shuffled": "ids + weights, slots shuffled",
    "replay_on": "replay on (ids)",
    "replay_off": "replay off",
    "replay_on_router_fp32": "replay on router fp32",
    "replay_ids_weights_router_fp32": "ids + weights router fp32",
}


# -- 1. rollouts ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _service(model: Path, dtype: str, workdir: Path) -> Iterator[str]:
    from routereplay.bench.servers import engine_env, server_process
    from routereplay.local_redis import free_port

    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "routereplay.cli",
        "serve",
        "--port",
        str(port),
        "--model",
        str(model),
        "--served-model-name",
        "m",
        "--dtype",
        dtype,
        "--log-level",
        "warning",
        # The engine's routing weights are captured beside the ids (requests ask for them).
        "--route-weights",
        "request",
    ]
    url = f"http://127.0.0.1:{port}"
    with server_process(argv, f"{url}/ready", workdir / f"serve-{dtype}.log", engine_env(), 300):
        yield url


def collect_rollouts(model: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """Serve ``model`` in ``dtype``, sample, and fetch the routes: a JSON-able dict."""
    import httpx

    from routereplay.client import RoutesClient, encode_record

    body = {
        "model": "m",
        "max_tokens": args.max_tokens,
        "temperature": 1.0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "routed_experts_weights": True,
    }
    items: list[dict[str, Any]] = []  # one per choice: kind, route id, engine logprobs
    with (
        tempfile.TemporaryDirectory(prefix="rr-mismatch-") as d,
        _service(model, dtype, Path(d)) as url,
        httpx.Client(base_url=url, timeout=300) as http,
    ):

        def complete(prompt: Any, n: int, kind: str, seed: int) -> list[dict[str, Any]]:
            r = http.post("/v1/completions", json={**body, "prompt": prompt, "n": n, "seed": seed})
            r.raise_for_status()
            out = []
            for c in r.json()["choices"]:
                assert c["routed_experts"]["status"] == "stored", c["routed_experts"]
                out.append(
                    {
                        "kind": kind,
                        "route_id": c["routed_experts"]["route_id"],
                        "prompt_ids": c["prompt_token_ids"],
                        "token_ids": c["token_ids"],
                        "logprobs": c["logprobs"]["token_logprobs"],
                    }
                )
            return out

        for i, p in enumerate(PROMPTS[: args.prompts]):
            items += complete(p, 1, "single", seed=100 + i)
        items += complete(PROMPTS[0], args.group, "group", seed=7)
        # A trajectory: each turn's prompt is the history as token ids, plus the next message.
        # The first prompt is long enough (> 128 tokens, vLLM's cache block) that the later
        # turns' prompts hit the engine's prefix cache: their cached rows come from its cache.
        turn = complete("Turn one: " + ". ".join(PROMPTS * 2), 1, "turn", seed=11)[0]
        items.append(turn)
        for k, follow in enumerate(FOLLOW_UPS):
            tok = http.post("/tokenize", json={"prompt": follow, "add_special_tokens": False})
            history = turn["prompt_ids"] + turn["token_ids"] + tok.json()["tokens"]
            turn = complete(history, 1, "turn", seed=12 + k)[0]
            items.append(turn)
        with RoutesClient(url) as rc:
            records = rc.get_many([it["route_id"] for it in items])
    for it, rec in zip(items, records, strict=True):
        it["record"] = base64.b64encode(encode_record(rec)).decode()
        it["cached_tokens"] = rec.num_cached_tokens
    return {"dtype": dtype, "model": str(model), "items": items}


# -- 2./3. the trainer -----------------------------------------------------------------------------
def _router_maps(replayer: Any) -> tuple[dict[int, list[Any]], list[Any]]:
    """Forward hooks that keep each router's routing map (bool [N, E]) per call."""
    maps: dict[int, list[Any]] = {s.layer: [] for s in replayer.slots}
    hooks = [
        s.router.register_forward_hook(
            lambda m, a, out, layer=s.layer: maps[layer].append(out[1].detach())
        )
        for s in replayer.slots
    ]
    return maps, hooks


def _variants(records: list[Any], router_fp32: bool) -> list[tuple[str, bool, Any, str]]:
    """``(name, replay, router dtype, routing weights replayed: "ids" or the engine's)``."""
    variants = [("replay_on", True, None, "ids"), ("replay_off", False, None, "ids")]
    engine = all(r.weights is not None for r in records)
    if engine:
        variants[:0] = [
            ("replay_ids_weights", True, None, "engine"),
            ("replay_ids_weights_again", True, None, "engine"),
            ("replay_ids_weights_slots_shuffled", True, None, "engine"),
        ]
    if router_fp32:
        variants.append(("replay_on_router_fp32", True, "fp32", "ids"))
        if engine:
            variants.append(("replay_ids_weights_router_fp32", True, "fp32", "engine"))
    return variants


def _shuffle_slots(targets: Any, seed: int) -> Any:
    """``targets`` with each row's K slots in a random order, ids and weights together: the
    same routing decision in another slot order (the slot-order effect on its own)."""
    import dataclasses

    rng = np.random.default_rng(seed)
    perm = np.argsort(rng.random(targets.experts.shape), axis=-1)
    return dataclasses.replace(
        targets,
        experts=np.take_along_axis(targets.experts, perm, axis=-1),
        weights=np.take_along_axis(targets.weights, perm, axis=-1),
        pinned=None,
    )


def _gap(diff: np.ndarray, agreement: float, took: float) -> dict[str, Any]:
    """One variant's numbers from ``diff`` = trainer - engine logprob per sampled token."""
    return {
        "route_agreement": agreement,
        "mean_abs_logprob_diff": float(np.abs(diff).mean()),
        "max_abs_logprob_diff": float(np.abs(diff).max()),
        # k3: E[exp(d) - 1 - d], d = log p_trainer - log p_engine, tokens sampled by the engine
        "kl_k3": float(np.mean(np.exp(diff) - 1 - diff)),
        "forward_s": round(took, 4),
        "abs_diffs": np.abs(diff).round(6).tolist(),
    }


def run_trainer(
    rollouts: dict[str, Any], *, device: str = "cpu", router_fp32: bool = False
) -> dict[str, Any]:
    """Logprobs and routing of the rollouts in Megatron, replay on and off; the numbers."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from routereplay.client import decode_record
    from routereplay.trainer_adapter import RouterReplayer, batch_coverage, gather_targets

    from . import bridge
    from .packing import PackedAttention

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[rollouts["dtype"]]
    dev = torch.device(device)
    items = rollouts["items"]
    records = [decode_record(base64.b64decode(it["record"])) for it in items]
    hf_cfg, hf_state = bridge.load_hf_checkpoint(rollouts["model"])
    bridge.init_megatron(dev)
    theta = bridge._rope_theta(hf_cfg)

    pack = _pack(records, items)
    pm = pack.position_map()
    ids = pack.input_ids()
    pm.check_tokens(records, ids)
    engine_lp = np.array([items[t.record]["logprobs"][t.completion_index] for t in pack.targets])

    results: dict[str, Any] = {
        "dtype": rollouts["dtype"],
        "tokens_packed": int(ids.size),
        "sampled_tokens": len(pack.targets),
    }
    models: dict[Any, Any] = {}
    trainer_lps: dict[str, np.ndarray] = {}
    for name, replay, router_dtype, weights in _variants(records, router_fp32):
        if (router_dtype, weights) not in models:
            m = _megatron_model(hf_cfg, hf_state, dev, dtype, router_dtype)
            models[router_dtype, weights] = (m, RouterReplayer(m, shadow=True, weights=weights))
        model, rep = models[router_dtype, weights]
        targets = gather_targets(pm, records, rep.layers, weights=weights == "engine")
        if name.endswith("_slots_shuffled"):
            targets = _shuffle_slots(targets, seed=0)
        tokens = torch.from_numpy(ids).to(dev)
        pos = torch.from_numpy(np.asarray(pack.positions)[None]).to(dev)
        PackedAttention.CONTEXT = pack.attention_context(dev, theta)
        maps, hooks = _router_maps(rep)
        t0 = time.perf_counter()
        with torch.no_grad(), rep.step():
            if replay:
                with rep.micro_batch(targets):
                    logits = model(tokens, pos, None)
            else:
                rep.set_action(RouterReplayAction.RECORD)
                logits = model(tokens, pos, None)
        took = time.perf_counter() - t0
        for h in hooks:
            h.remove()
        agreement = _route_agreement(maps, rep.layers, targets)
        trainer_lp = _sampled_logprobs(logits, pack, dev)
        trainer_lps[name] = trainer_lp
        diff = trainer_lp - engine_lp
        shadow = rep.shadow_report() if replay else None
        results[name] = _gap(diff, agreement, took)
        if shadow is not None:
            results[name]["shadow_token_mismatch"] = shadow.token_mismatch()
            if name == "replay_on":  # what a trainer logs each step (routereplay report)
                results["trainer_log"] = {
                    **batch_coverage(pm, records, rep.layers).as_metrics(),
                    **shadow.as_metrics(),
                }
    results.update(_slot_order_effect(trainer_lps))
    return results


def _pack(records: list[Any], items: list[dict[str, Any]]) -> Any:
    """The rollouts in one THD pack: each single rollout a sequence, the group as its prompt
    then its completions, the trajectory as its last turn."""
    from .packing import Pack

    pack = Pack(records)
    for i, it in enumerate(items):
        if it["kind"] == "single":
            pack.add_sequence(i)
    pack.add_group([i for i, it in enumerate(items) if it["kind"] == "group"])
    pack.add_trajectory([i for i, it in enumerate(items) if it["kind"] == "turn"])
    return pack


def _megatron_model(
    hf_cfg: Any, hf_state: Any, dev: Any, dtype: Any, router_dtype: str | None
) -> Any:
    """The checkpoint as a Megatron-Core model in eval mode, attending as the pack says;
    ``router_dtype``: Megatron's ``moe_router_dtype`` ("fp32"), or None for the model's."""
    from . import bridge
    from .packing import PackedAttention

    extra = {"moe_router_dtype": router_dtype} if router_dtype else {}
    m = bridge.build_model(hf_cfg, device=dev, dtype=dtype, core_attention=PackedAttention, **extra)
    bridge.load_hf_weights(m, hf_state, hf_cfg)
    m.eval()
    return m


def _route_agreement(maps: dict[int, list[Any]], layers: Sequence[int], targets: Any) -> float:
    """Share of the (row, MoE layer) decisions of the last forward (``maps``, from
    :func:`_router_maps`) equal to the engine's (``targets``), on the rows that carry a route;
    1.0 when none does."""
    valid = targets.valid
    agree, total = 0, 0
    for k, layer in enumerate(layers):
        chosen = maps[layer][-1].cpu().numpy()  # [N, E] bool: the experts this router used
        want = np.zeros_like(chosen)
        np.put_along_axis(want, targets.experts[k].astype(np.int64), True, axis=1)
        same = (chosen == want).all(axis=1)
        agree += int(same[valid].sum())
        total += int(valid.sum())
    return agree / total if total else 1.0


def _sampled_logprobs(logits: Any, pack: Any, dev: Any) -> np.ndarray:
    """The trainer's logprob of each sampled token of ``pack`` (its targets, in order) from
    the pack's ``[1, T, V]`` logits."""
    import torch

    logp = torch.log_softmax(logits.float(), -1)[0]
    idx = torch.tensor([t.predictor for t in pack.targets], device=dev)
    tok = torch.tensor([pack.tokens[t.index] for t in pack.targets], device=dev)
    return logp[idx].gather(1, tok[:, None]).squeeze(1).cpu().numpy()


def _slot_order_effect(trainer_lps: dict[str, np.ndarray]) -> dict[str, float]:
    """The most the slot order alone moves a logprob (the same decisions, only the slots
    permuted), beside what the same forward moves when it runs again (a GPU's atomic adds sum
    in any order); nothing without the shuffled run."""
    if "replay_ids_weights_slots_shuffled" not in trainer_lps:
        return {}
    base = trainer_lps["replay_ids_weights"]
    out = {}
    for key, name in (("slot_order", "slots_shuffled"), ("rerun", "again")):
        moved = np.abs(trainer_lps[f"replay_ids_weights_{name}"] - base)
        out[f"{key}_max_abs_logprob_change"] = float(moved.max())
    return out


def run_trainer_hf(rollouts: dict[str, Any], *, device: str = "cpu") -> dict[str, Any]:
    """The same numbers with the Hugging Face transformers model as the trainer
    (:class:`~routereplay.trainer_adapter.hf.HFRouterReplayer`): every rollout as its own
    sequence of a position-id pack, replay on (ids), ids + weights and off."""
    import torch
    from transformers import AutoModelForCausalLM

    from routereplay.client import decode_record
    from routereplay.trainer_adapter import gather_targets, sample_from_record, thd_position_map
    from routereplay.trainer_adapter.hf import HFRouterReplayer, find_hf_routers, packed_inputs

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[rollouts["dtype"]]
    items = rollouts["items"]
    records = [decode_record(base64.b64decode(it["record"])) for it in items]
    seqs = [it["prompt_ids"] + it["token_ids"] for it in items]
    cu = np.cumsum([0] + [len(x) for x in seqs])
    pm = thd_position_map([sample_from_record(i, r, length=len(seqs[i]))
                           for i, r in enumerate(records)], cu, records=records)  # fmt: skip
    ids, pos, mask = packed_inputs(seqs, dtype)
    pm.check_tokens(records, ids.numpy())
    # The sampled tokens: position of each, and the engine's logprob of it.
    where = [
        (int(cu[i]) + len(it["prompt_ids"]) + j, tok, lp)
        for i, it in enumerate(items)
        for j, (tok, lp) in enumerate(zip(it["token_ids"], it["logprobs"], strict=True))
    ]
    at = torch.tensor([w[0] for w in where], device=device)
    tok = torch.tensor([w[1] for w in where], device=device)
    engine_lp = np.array([w[2] for w in where])
    model = AutoModelForCausalLM.from_pretrained(rollouts["model"], dtype=dtype).to(device).eval()
    model.set_attn_implementation("sdpa")
    routers = find_hf_routers(model)
    layers = tuple(r.layer for r in routers)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for r in routers:  # the experts each MoE block actually used, and their weights
        block = model.get_submodule(r.name.rsplit(".", 1)[0])
        block.experts.register_forward_pre_hook(
            lambda m, a, layer=r.layer: seen.__setitem__(
                layer, (a[1].detach().cpu(), a[2].detach().float().cpu())
            )
        )
    engine_w = all(r.weights is not None for r in records)
    results: dict[str, Any] = {
        "dtype": rollouts["dtype"],
        "trainer": "hf",
        "tokens_packed": int(ids.numel()),
        "sampled_tokens": len(where),
    }
    for name, weights in (("replay_ids_weights", "engine"), ("replay_on", "ids"),
                          ("replay_off", None)):  # fmt: skip
        if weights == "engine" and not engine_w:
            continue
        targets = gather_targets(pm, records, layers, weights=engine_w)
        rep = None if weights is None else HFRouterReplayer(model, weights=weights)
        t0 = time.perf_counter()
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if rep is not None:
                stack.enter_context(rep.micro_batch(targets))
            logits = model(ids.to(device), position_ids=pos.to(device),
                           attention_mask=mask.to(device)).logits  # fmt: skip
        took = time.perf_counter() - t0
        if rep is not None:
            rep.remove()
        valid = targets.valid if targets.valid is not None else np.ones(ids.numel(), bool)
        agree = sum(int((np.sort(seen[layer][0].numpy(), 1) == np.sort(targets.experts[k], 1))
                        .all(1)[valid].sum()) for k, layer in enumerate(layers))  # fmt: skip
        logp = torch.log_softmax(logits[0].float(), -1)
        diff = logp[at - 1].gather(1, tok[:, None]).squeeze(1).cpu().numpy() - engine_lp
        results[name] = _gap(diff, agree / (int(valid.sum()) * len(layers)), took)
        if engine_w and weights is not None:  # the experts' weights against the engine's
            results[name]["max_abs_weight_diff"] = max(
                float(np.abs(seen[layer][1].numpy() - targets.weights[k])[valid].max())
                for k, layer in enumerate(layers)
            )
    return results


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'dtype':9} {'replay':29} {'route agreement':>16} {'mean |dlogp|':>13} "
        f"{'max |dlogp|':>12} {'KL (k3)':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        for name in LABELS:
            if name in r:
                x = r[name]
                lines.append(
                    f"{r['dtype']:9} {LABELS[name]:29} {x['route_agreement']:16.4f} "
                    f"{x['mean_abs_logprob_diff']:13.6f} {x['max_abs_logprob_diff']:12.6f} "
                    f"{x['kl_k3']:10.2e}"
                )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 3.8), squeeze=False)
    for ax, r in zip(axes[0], rows, strict=True):
        on = np.asarray(r["replay_on"]["abs_diffs"]) + 1e-9
        off = np.asarray(r["replay_off"]["abs_diffs"]) + 1e-9
        bins = np.logspace(-9, max(0.0, float(np.log10(max(on.max(), off.max())))), 40)
        ax.hist(off, bins=bins, alpha=0.6, label=f"replay off (mean {off.mean():.4f})")
        ax.hist(on, bins=bins, alpha=0.6, label=f"replay on (mean {on.mean():.4f})")
        ax.set_xscale("log")
        ax.set_xlabel("|trainer logprob - vLLM logprob| per sampled token")
        ax.set_ylabel("tokens")
        ax.set_title(f"{title}, {r['dtype']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.deterministic:
        import os

        import torch

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at cuBLAS's start
        torch.use_deterministic_algorithms(True, warn_only=True)
    all_rollouts = _rollouts(args)
    if args.trainer == "hf":
        rows = [run_trainer_hf(r, device=args.device) for r in all_rollouts]
    else:
        rows = [
            run_trainer(r, device=args.device, router_fp32=args.router_fp32) for r in all_rollouts
        ]
    for r, ro in zip(rows, all_rollouts, strict=True):
        cached = sum(it["cached_tokens"] for it in ro["items"])
        prompts = sum(len(it["prompt_ids"]) for it in ro["items"])
        r["prefix_cache_hits"] = [cached, prompts]
    _print_summary(rows, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.trainer_log:
        lines = [json.dumps({"step": i, "dtype": r["dtype"], **r["trainer_log"]})
                 for i, r in enumerate(rows) if "trainer_log" in r]  # fmt: skip
        args.trainer_log.write_text("\n".join(lines) + "\n")
    if args.plot:
        _plot(rows, args.plot, Path(all_rollouts[0]["model"]).name)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="routereplay experiment mismatch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="sharp",
        help="a tiny variant (moe, dense-first, sharp) or a checkpoint directory",
    )
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--trainer",
        choices=("megatron", "hf"),
        default="megatron",
        help="Megatron-Core (RouterReplayer) or Hugging Face transformers (HFRouterReplayer)",
    )
    p.add_argument(
        "--router-fp32",
        action="store_true",
        help="also replay with the router in float32 (routing weights' share)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="torch's deterministic algorithms (a GPU's scatter-adds in a fixed order)",
    )
    p.add_argument("--save-rollouts", type=Path)
    p.add_argument("--from-rollouts", type=Path)
    p.add_argument(
        "--model-dir", type=Path, help="with --from-rollouts: the model's files are here"
    )
    p.add_argument("--json", type=Path, help="write the numbers here")
    p.add_argument("--plot", type=Path, help="write a PNG of the |logprob difference| histograms")
    p.add_argument(
        "--trainer-log",
        type=Path,
        help="write the Megatron trainer's replay scalars (coverage, shadow diagnostics per "
        "layer), one JSON line per dtype, as a trainer logs them (routereplay report)",
    )
    return p


def _rollouts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Step 1's data for each dtype: read from ``--from-rollouts`` (the model's files where
    ``--model-dir`` says), or collected from the service (and written to ``--save-rollouts``)."""
    if args.from_rollouts:
        all_rollouts = json.loads(args.from_rollouts.read_text())
        if args.model_dir:
            for r in all_rollouts:
                r["model"] = str(args.model_dir)
        return all_rollouts
    from routereplay.service.engines.vllm_host import on_cpu_host
    from routereplay.service.tiny_model import VARIANTS, ensure_tiny_model

    model = ensure_tiny_model(args.model) if args.model in VARIANTS else Path(args.model)
    dtypes = args.dtypes.split(",")
    # On a CPU host the dtypes' engines start and sample side by side (a start-up is mostly one
    # core's work); on a GPU each engine claims most of its memory, so they run one at a time.
    with ThreadPoolExecutor(len(dtypes) if on_cpu_host() else 1) as pool:
        all_rollouts = list(pool.map(lambda d: collect_rollouts(model, d, args), dtypes))
    if args.save_rollouts:
        args.save_rollouts.write_text(json.dumps(all_rollouts))
    return all_rollouts


def _print_summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Each dtype's pack and prefix-cache hits, the table, and the slot order's effect where it
    was measured."""
    pack = (
        "a position-id pack, every rollout whole (the group's prompt and the trajectory's "
        "history repeated)"
        if args.trainer == "hf"
        else f"THD sequences, a GRPO group of {args.group} as prompt + completions, a 3-turn "
        "trajectory"
    )
    for r in rows:
        cached, prompts = r["prefix_cache_hits"]
        print(
            f"{r['dtype']}: {r['sampled_tokens']} sampled tokens in one pack of "
            f"{r['tokens_packed']} ({pack}); prefix-cache hits: {cached} of {prompts} prompt "
            "tokens"
        )
    print(_table(rows))
    for r in rows:
        if "slot_order_max_abs_logprob_change" in r:
            print(
                f"{r['dtype']}: slot order alone (ids + weights, each row's slots shuffled) moves "
                f"the trainer's logprobs by at most {r['slot_order_max_abs_logprob_change']:.3g}; "
                f"the same forward run again, by {r['rerun_max_abs_logprob_change']:.3g}"
            )


if __name__ == "__main__":
    sys.exit(main())
