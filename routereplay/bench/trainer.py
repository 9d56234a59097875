"""``routereplay bench trainer``: route preparation throughput for a training step.

What a trainer rank does per step before its forward passes, end to end: fetch the batch's route
records from Redis (``RouteStore.get_many``), decode them, build the position map of the packed
batch, check token ids, slice for the parallel layout, and gather per-layer targets into torch
tensors (compact dtype; the widening to int64 happens on the GPU in the installer and is not
counted here). Default shape: 48 MoE layers, 128 experts, top-8 (a Qwen3-235B-like router), a
256k-token global batch of GRPO groups (one shared prompt per group, so the store's shared chunks
are fetched once), packed THD.

Throughput is measured in one process with torch and numpy limited to one thread (the redis-server
runs in its own process). Prints a table; ``--json`` prints one JSON line as well.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import numpy as np

__all__ = ["main"]


def _make_records(rng, args):
    from routereplay.client import RouteRecord

    M, E, K = args.layers, args.experts, args.topk
    moe = tuple(range(M))
    records = []
    total = 0
    g = 0
    while total < args.tokens:
        prompt = rng.integers(0, 150_000, args.prompt_len)
        # High-entropy routes (distinct top-k per token and layer), the codec's hard case.
        p_rows = _random_topk(rng, args.prompt_len, M, E, K)
        for _ in range(args.group):
            c = int(rng.integers(args.completion_len // 2, args.completion_len * 3 // 2))
            tok = np.concatenate([prompt, rng.integers(0, 150_000, c)])
            ex = np.concatenate([p_rows, _random_topk(rng, c, M, E, K)])
            valid = np.ones(len(tok), bool)
            valid[-1] = False  # the last sampled token is never routed
            records.append(
                RouteRecord(
                    token_ids=tok,
                    experts=ex,
                    valid=valid,
                    moe_layers=moe,
                    num_layers=M,
                    num_experts=E,
                    prompt_len=args.prompt_len,
                )
            )
            total += len(tok)
        g += 1
    return records, g


def _random_topk(rng, n: int, M: int, E: int, K: int) -> np.ndarray:
    """[n, M, K] distinct expert ids per row, uint8/uint16."""
    from routereplay.client import expert_dtype

    dt = expert_dtype(E)
    base = rng.integers(0, E, (n, M, 1))
    step = rng.integers(1, E // K, (n, M, 1))  # distinct: base + j * step (mod E), step * K <= E
    return ((base + np.arange(K) * step) % E).astype(dt)


def _timeit(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    best = float("inf")
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(url: str, args) -> dict:
    import torch

    from routereplay.client import RouteStore
    from routereplay.trainer_adapter import gather_targets, sample_from_record, thd_position_map

    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    records, groups = _make_records(rng, args)
    n_tokens = sum(r.num_tokens for r in records)
    ids = [f"bench-{i}" for i in range(len(records))]
    store = RouteStore.from_url(url, prefix="rrbench")
    t0 = time.perf_counter()
    for i, r in zip(ids, records, strict=True):
        store.put(i, r)
    put_s = time.perf_counter() - t0
    # The trainer's own packed token ids (from its dataset, not from the store).
    lens = np.array([r.num_tokens for r in records])
    cu = np.concatenate([[0], np.cumsum(lens)])
    input_ids = np.concatenate([r.token_ids for r in records])[None, :]
    layers = tuple(range(args.layers))

    def fetch():
        return store.get_many(ids)

    def align(recs):
        pm = thd_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], cu)
        pm.check_tokens(recs, input_ids)
        return pm

    def gather(pm, recs, cp=1, tp=1, cp_rank=0, tp_rank=0):
        local = pm.local(cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank)
        tg = gather_targets(local, recs, layers)
        return torch.from_numpy(tg.experts)

    fetch_s, recs = _timeit(fetch, args.repeat)
    align_s, pm = _timeit(lambda: align(recs), args.repeat)
    gather_s, t = _timeit(lambda: gather(pm, recs), args.repeat)
    e2e_s, _ = _timeit(lambda: gather(align(r := fetch()), r), args.repeat)
    assert tuple(t.shape) == (args.layers, n_tokens, args.topk), t.shape
    # One rank of TP=2 x SP (half the rows) and of CP=2 (zigzag): the per-rank gather cost.
    pad = (-n_tokens) % 4
    cu_p = cu.copy()
    cu_p[-1] += pad  # pad the pack so it splits evenly
    pm_p = thd_position_map(
        [sample_from_record(i, r) for i, r in enumerate(recs)], cu, cu_seqlens_padded=cu_p
    )
    sp_s, _ = _timeit(lambda: gather(pm_p, recs, tp=2, tp_rank=1), args.repeat)
    store.close()
    return {
        "tokens": n_tokens,
        "records": len(records),
        "groups": groups,
        "layers": args.layers,
        "experts": args.experts,
        "top_k": args.topk,
        "raw_mb": n_tokens * args.layers * args.topk * t.element_size() / 1e6,
        "put_s": put_s,
        "fetch_decode_s": fetch_s,
        "align_check_s": align_s,
        "gather_to_torch_s": gather_s,
        "end_to_end_s": e2e_s,
        "end_to_end_tokens_per_s": n_tokens / e2e_s,
        "tp2_sp_rank_gather_s": sp_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="routereplay bench trainer", description=__doc__)
    p.add_argument("--tokens", type=int, default=262_144, help="global batch tokens")
    p.add_argument("--layers", type=int, default=48, help="MoE layers")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--completion-len", type=int, default=2048, help="mean completion tokens")
    p.add_argument("--group", type=int, default=8, help="GRPO group size (shared prompt)")
    p.add_argument("--repeat", type=int, default=3, help="best of N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-url", default=None, help="default: a private redis-server")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    if args.redis_url:
        res = run(args.redis_url, args)
    else:
        from routereplay.local_redis import redis_server

        with redis_server() as url:
            res = run(url, args)
    n = res["tokens"]
    print(
        f"routereplay bench trainer: {n} tokens in {res['records']} records "
        f"({res['groups']} GRPO groups of {args.group}), {args.layers} MoE layers, "
        f"{args.experts} experts, top-{args.topk}; targets {res['raw_mb']:.0f} MB (compact)"
    )
    print(f"  put (setup, not per step)      {res['put_s']:8.3f} s")
    for key, label in [
        ("fetch_decode_s", "fetch + decode (get_many)"),
        ("align_check_s", "position map + token check"),
        ("gather_to_torch_s", "gather -> torch (all rows)"),
        ("end_to_end_s", "END TO END per step"),
        ("tp2_sp_rank_gather_s", "gather, one TP2+SP rank"),
    ]:
        s = res[key]
        print(f"  {label:30s} {s:8.3f} s  {n / s / 1e6:8.2f} M tokens/s")
    target = 1e6
    ok = res["end_to_end_tokens_per_s"] >= target
    print(
        f"  target >= 1M tokens/s end to end on one core: "
        f"{'MET' if ok else 'NOT MET'} ({res['end_to_end_tokens_per_s'] / 1e6:.2f} M tokens/s); "
        f"time added per {n}-token step: {res['end_to_end_s']:.3f} s (one process, DP=1)"
    )
    if args.json:
        print(json.dumps(res))
    return 0
