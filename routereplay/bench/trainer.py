"""``routereplay bench trainer``: route preparation throughput for a training step.

What a trainer rank does per step before its forward passes, end to end: fetch the batch's route
records from Redis (``RouteStore.get_many``), decode them, build the position map of the packed
batch, check token ids, slice for the parallel layout, and gather per-layer targets into torch
tensors (compact dtype; the widening to int64 happens on the GPU in the installer and is not
counted here). Default shape: 48 MoE layers, 128 experts, top-8 (a Qwen3-235B-like router), a
256k-token global batch of GRPO groups (one shared prompt per group, so the store's shared chunks
are fetched once), packed THD. ``--routes`` picks the routes: ``skewed`` (the default; ``bench
store``'s Zipf popularity with experts kept from token to token), ``uniform`` or ``progression``
(the workload before the option). What they store differs (40, 64 and 32 MB for the default
batch), and with it both the decode's cost and the floor's.

Throughput is measured in one process with torch and numpy limited to one thread (the redis-server
runs in its own process); the store decodes chunks on its default decode threads
(``RouteStore(decode_threads=...)``, up to 8) and, for comparison, on the calling thread alone.
Prints a table; ``--json`` prints one JSON line as well. The table ends with the CPU a step takes,
ours and the floor's (this process's, every thread, and the redis-server's, from its ``INFO``),
and, where the server runs on this machine, the least wall time that CPU allows on the usable
cores: on a machine with few cores, ours / floor cannot go below that bound over the floor.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import numpy as np

__all__ = ["main"]


def _make_records(rng, args):
    from routereplay.client import RouteRecord

    M, E, K = args.layers, args.experts, args.topk
    moe = tuple(range(M))
    # Token ids and lengths first, then the routes of every sequence (each group's prompt, each
    # completion) in one call: the skewed generator steps through tokens, vectorised across
    # sequences.
    groups: list[tuple[np.ndarray, list[np.ndarray]]] = []
    total = 0
    while total < args.tokens:
        prompt = rng.integers(0, 150_000, args.prompt_len)
        completions = []
        for _ in range(args.group):
            c = int(rng.integers(args.completion_len // 2, args.completion_len * 3 // 2))
            completions.append(rng.integers(0, 150_000, c))
            total += args.prompt_len + c
        groups.append((prompt, completions))
    lengths = [len(x) for p, cs in groups for x in (p, *cs)]
    rows = iter(ROUTES[args.routes](rng, lengths, M, E, K))
    records = []
    for prompt, completions in groups:
        p_rows = next(rows)
        for comp in completions:
            tok = np.concatenate([prompt, comp])
            ex = np.concatenate([p_rows, next(rows)])
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
    return records, len(groups)


def _progression_routes(rng, lengths: list[int], M: int, E: int, K: int) -> list[np.ndarray]:
    """[n, M, K] distinct ids per row, each row an arithmetic progression ``base + j * step``
    (mod E), fresh every token: ~11 bits of information per 8 ids, of which zstd's short matches
    find some (~27 bits per row stored). The workload of this bench before ``--routes``: few
    stored bytes (a fast floor) and many short matches (zstd's slowest decode), the hardest case
    for the floor ratio."""
    from routereplay.client import expert_dtype

    out = []
    for n in lengths:
        base = rng.integers(0, E, (n, M, 1))
        step = rng.integers(1, E // K, (n, M, 1))  # distinct: step * K <= E
        out.append(((base + np.arange(K) * step) % E).astype(expert_dtype(E)))
    return out


def _uniform_routes(rng, lengths: list[int], M: int, E: int, K: int) -> list[np.ndarray]:
    """K distinct experts drawn uniformly per row (``bench store``'s uniform workload): no
    structure to compress beyond the ids' width; a trained router's ids are close to this
    (docs/storage.md: 3.87 bits per id of a 3.95-bit bound)."""
    from routereplay.bench.store import uniform_routes

    return [uniform_routes(rng, n, M, E, K) for n in lengths]


def _skewed_routes(rng, lengths: list[int], M: int, E: int, K: int) -> list[np.ndarray]:
    """``bench store``'s skewed workload: Zipf(1.1) expert popularity permuted per layer, and
    each slot keeps the previous token's expert with p = 0.5, else draws a new one (distinct
    within the row); one router for the whole batch."""
    from routereplay.bench.store import skewed_routes_many

    return skewed_routes_many(rng, lengths, M, E, K)


ROUTES = {
    "skewed": _skewed_routes,
    "uniform": _uniform_routes,
    "progression": _progression_routes,
}


def _timeit(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    best = float("inf")
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _timeit_pair(
    a: Callable[[], object], b: Callable[[], object], repeat: int
) -> tuple[float, object, float, object]:
    """Best of ``repeat`` of ``a`` and of ``b``, run alternately: on a shared machine a slow
    spell then slows both sides of their ratio, not one (the floor measured alone, after the
    rest, varied 0.032 to 0.069 s between runs here)."""
    best_a = best_b = float("inf")
    out_a = out_b = None
    for _ in range(repeat):
        out_a = out_b = None  # a round's results go before the next round runs
        t0 = time.perf_counter()
        out_a = a()
        t1 = time.perf_counter()
        out_b = b()
        t2 = time.perf_counter()
        best_a, best_b = min(best_a, t1 - t0), min(best_b, t2 - t1)
    return best_a, out_a, best_b, out_b


def run(url: str, args) -> dict:
    import torch

    from routereplay.bench.store import vllm_inline
    from routereplay.client import RouteRecord, RouteStore
    from routereplay.trainer_adapter import (
        ReplayTargets,
        TargetBuffers,
        gather_targets,
        sample_from_record,
        thd_position_map,
    )

    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    records, groups = _make_records(rng, args)
    n_tokens = sum(r.num_tokens for r in records)
    ids = [f"bench-{i}" for i in range(len(records))]
    store = RouteStore.from_url(
        url, prefix="rrbench", decode_threads=args.decode_threads, block_size=args.block_size
    )
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

    # The targets' memory is recycled from step to step (TargetBuffers), as the floor reuses
    # its buffer and the pinned path reuses torch's page-locked blocks: fresh pages cost a
    # fault and zeroing each (the "fresh target memory" line measures that path too).
    buffers = TargetBuffers(keep=4)  # the targets kept below for the checks hold one each

    def targets(
        pm, recs, cp=1, tp=1, cp_rank=0, tp_rank=0, pin_memory=False, fresh=False
    ) -> ReplayTargets:
        local = pm.local(cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank)
        pool = None if pin_memory or fresh else buffers
        return gather_targets(local, recs, layers, pin_memory=pin_memory, buffers=pool)

    def gather(pm, recs, **kw):
        return torch.from_numpy(targets(pm, recs, **kw).experts)

    fetch_s, recs = _timeit(fetch, args.repeat)
    align_s, pm = _timeit(lambda: align(recs), args.repeat)
    gather_s, t = _timeit(lambda: gather(pm, recs), args.repeat)

    def prepare(_step: object = None):
        r = fetch()
        return gather(align(r), r)

    # Floor: the same stored bytes read from Redis (both round trips) and copied once, into a
    # buffer reused from call to call. Not a fresh bytes object: past glibc's largest
    # heap-served size (32 MiB) that is fresh pages each time, and the floor's copy then cost
    # 0.024 s for the skewed workload's 40 MB instead of 0.004 s (32 MB of progression rows
    # stayed under it), a floor that moved with the workload for no reason of Redis's.
    floor_buf = [np.empty(0, np.uint8)]

    def floor():
        raw = store.get_raw(ids)
        stored = [*raw.manifests.values(), *(c for c in raw.chunks.values() if c)]
        n = sum(map(len, stored))
        if floor_buf[0].size < n:
            floor_buf[0] = np.empty(n, np.uint8)
        blob = floor_buf[0][:n]
        np.concatenate([np.frombuffer(b, np.uint8) for b in stored], out=blob)
        return raw, blob

    e2e_s, _, floor_s, (raw, blob) = _timeit_pair(prepare, floor, args.repeat)
    # CPU per step of both, this process's and the redis-server's: on a machine with few cores
    # the wall-time ratio cannot go below what that CPU spread over every core takes.
    cpu_ours, cpu_ours_redis = _cpu_per_call(prepare, args.repeat, store.redis)
    cpu_floor, cpu_floor_redis = _cpu_per_call(floor, args.repeat, store.redis)
    cpus = _usable_cpus()
    # The bound holds only where the redis-server runs on this machine's cores: a loopback URL.
    local_server = urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")
    cpu_bound_s = (
        (cpu_ours + cpu_ours_redis) / cpus if cpu_ours_redis is not None and local_server else None
    )
    e2e_fresh_s, t_fresh = _timeit(lambda: gather(align(r := fetch()), r, fresh=True), args.repeat)
    # The same preparation with the chunks decoded on the calling thread only.
    serial_store = RouteStore.from_url(
        url, prefix="rrbench", decode_threads=1, block_size=args.block_size
    )
    e2e1_s, t1 = _timeit(lambda: gather(align(r := serial_store.get_many(ids)), r), args.repeat)
    serial_store.close()
    assert tuple(t.shape) == (args.layers, n_tokens, args.topk), t.shape
    # One rank of TP=2 x SP (half the rows) and of CP=2 (zigzag): the per-rank gather cost.
    pad = (-n_tokens) % 4
    cu_p = cu.copy()
    cu_p[-1] += pad  # pad the pack so it splits evenly
    pm_p = thd_position_map(
        [sample_from_record(i, r) for i, r in enumerate(recs)], cu, cu_seqlens_padded=cu_p
    )
    sp_s, _ = _timeit(lambda: gather(pm_p, recs, tp=2, tp_rank=1), args.repeat)

    # -- baselines in the same run ---------------------------------------------------------------
    # Peer path (verl, ART): routes arrive inline in the OpenAI response as base64 of an .npy of
    # [T-1, num_layers, K]; the trainer parses the JSON, decodes base64 and the .npy, pads the
    # last token, then aligns and gathers exactly as above.
    bodies = [
        json.dumps({"choices": [{"index": 0, "routed_experts": vllm_inline(r).decode()}]})
        for r in records
    ]

    def peer():
        out = []
        for body, r in zip(bodies, records, strict=True):
            arr = np.load(
                io.BytesIO(base64.b64decode(json.loads(body)["choices"][0]["routed_experts"]))
            )
            ex = np.concatenate([arr, np.zeros((1, *arr.shape[1:]), arr.dtype)])
            valid = np.ones(len(ex), bool)
            valid[-1] = False
            out.append(RouteRecord(token_ids=r.token_ids, experts=ex, valid=valid,
                                   moe_layers=r.moe_layers, num_layers=r.num_layers,
                                   num_experts=r.num_experts, prompt_len=r.prompt_len))  # fmt: skip
        return gather(align(out), out)

    peer_s, t_peer = _timeit(peer, args.repeat)
    assert torch.equal(t_peer, t), "the peer path gathered other targets"
    assert torch.equal(t1, t), "one decode thread gathered other targets"
    assert torch.equal(t_fresh, t), "fresh target memory gathered other targets"
    del t_fresh, t_peer, t1  # their buffers go back to the pool for the steps below

    # -- a training step: time added with and without prefetch ----------------------------------
    # The training step: on a GPU the step's targets are gathered into page-locked memory where
    # they are prepared (gather_targets(pin_memory=True), in the Prefetcher's thread), and
    # installed (ReplayTargets.to_torch, what the replayer does) on the step's thread.
    on_gpu = args.step_device != "cpu"

    def prepare_step(_step: object = None) -> ReplayTargets:
        r = fetch()
        return targets(align(r), r, pin_memory=on_gpu)

    def install(tg: ReplayTargets) -> object:
        return tg.to_torch(args.step_device) if on_gpu else tg

    install_s = install_pageable_s = e2e_pinned_s = None
    if on_gpu:
        # What a trainer on a GPU host prepares (gather_targets(pin_memory=True), the path the
        # docs recommend with Prefetcher): the targets land in the caching host allocator's
        # page-locked blocks, reused from step to step, instead of fresh pageable pages.
        e2e_pinned_s, _ = _timeit(prepare_step, args.repeat)

        def timed_install(tg: ReplayTargets) -> float:
            best = float("inf")
            for _ in range(args.repeat):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                install(tg)  # the thread's share; the copy runs on the GPU's stream
                best = min(best, time.perf_counter() - t0)
            torch.cuda.synchronize()
            return best

        pinned = prepare_step()
        install_s = timed_install(pinned)
        pageable = ReplayTargets(pinned.layers, pinned.experts.copy(), pinned.num_experts)
        install_pageable_s = timed_install(pageable)
        assert torch.equal(pinned.to_torch(args.step_device).cpu(), t.to(torch.int64))
    step = (
        _step_overhead(prepare_step, install, args.step_s, args.steps, args.step_device)
        if args.step_s > 0
        else {}
    )
    store.close()
    return {
        "tokens": n_tokens,
        "records": len(records),
        "block_size": args.block_size,
        "chunks_read": len(raw.chunks),
        "groups": groups,
        "routes": args.routes,
        "layers": args.layers,
        "experts": args.experts,
        "top_k": args.topk,
        "raw_mb": n_tokens * args.layers * args.topk * t.element_size() / 1e6,
        "put_s": put_s,
        "fetch_decode_s": fetch_s,
        "align_check_s": align_s,
        "gather_to_torch_s": gather_s,
        "decode_threads": store.decode_threads,
        "end_to_end_s": e2e_s,
        "end_to_end_tokens_per_s": n_tokens / e2e_s,
        "end_to_end_one_thread_s": e2e1_s,
        "end_to_end_fresh_targets_s": e2e_fresh_s,
        "tp2_sp_rank_gather_s": sp_s,
        "install_on_gpu_s": install_s,
        "install_on_gpu_pageable_s": install_pageable_s,
        "end_to_end_pinned_s": e2e_pinned_s,
        "ours_pinned_over_floor": None if e2e_pinned_s is None else e2e_pinned_s / floor_s,
        "peer_inline_json_s": peer_s,
        "floor_redis_get_copy_s": floor_s,
        "stored_mb": len(blob) / 1e6,
        "peer_inline_mb": sum(len(b) for b in bodies) / 1e6,
        "peer_over_ours": peer_s / e2e_s,
        "ours_over_floor": e2e_s / floor_s,
        "cpu_ours_process_s": cpu_ours,
        "cpu_ours_redis_s": cpu_ours_redis,
        "cpu_floor_process_s": cpu_floor,
        "cpu_floor_redis_s": cpu_floor_redis,
        "cpus": cpus,
        "cpu_bound_s": cpu_bound_s,
        "cpu_bound_over_floor": None if cpu_bound_s is None else cpu_bound_s / floor_s,
        "peer_over_ours_one_thread": peer_s / e2e1_s,
        "ours_one_thread_over_floor": e2e1_s / floor_s,
        **step,
    }


def _compute(seconds: float, device: str = "cpu") -> None:
    """A stand-in for a training step's compute on this thread for ``seconds``: matrix products
    on the CPU (torch releases the GIL inside them), or on the GPU, where the thread waits in
    CUDA synchronisation with the GIL released, as a trainer's thread does."""
    import torch

    n = 384 if device == "cpu" else 8192
    a = torch.randn(n, n, device=device)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)
        if device != "cpu":
            torch.cuda.synchronize()


def _redis_cpu_s(client: object) -> float | None:
    """The redis-server's CPU seconds so far (``INFO cpu``: user + system, all its threads; a
    cluster's: every node's together), or None where the server will not say (a proxy may
    refuse INFO)."""
    import redis
    from redis.cluster import RedisCluster

    def used(info: dict) -> float:
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    try:
        if isinstance(client, RedisCluster):
            # Without target nodes a cluster client asks one node, whichever is its default.
            per_node = client.info("cpu", target_nodes=RedisCluster.ALL_NODES)
            return sum(used(info) for info in per_node.values())
        return used(client.info("cpu"))  # type: ignore[attr-defined]
    except (redis.RedisError, KeyError, TypeError, ValueError, AttributeError):
        return None


def _cpu_per_call(fn: Callable[[], object], n: int, client: object) -> tuple[float, float | None]:
    """CPU seconds of the call of ``fn`` (of ``n``) that took the least: this process's (every
    thread's: the decode threads and the gather's copies count) and the redis-server's (None if
    unknown). The least, as the wall times are the best of ``n``: a slow spell on a shared
    machine costs CPU time as well (cache and memory contention). CPU time is what a machine
    with few cores runs out of: the wall time can be no lower than the CPU a step needs spread
    over every core (``run`` prints that bound)."""
    best: tuple[float, float | None] | None = None
    for _ in range(n):
        r0 = _redis_cpu_s(client)
        p0 = time.process_time()
        out = fn()
        proc = time.process_time() - p0
        del out  # a call's targets go back to the pool before the next call takes one
        r1 = _redis_cpu_s(client)
        red = None if r0 is None or r1 is None else r1 - r0
        if best is None or proc + (red or 0.0) < best[0] + (best[1] or 0.0):
            best = (proc, red)
    assert best is not None
    return best


def _usable_cpus() -> int:
    # The CPUs this process may run on (taskset shrinks them), as the store's default decode
    # threads count them (client/_threads.py; private there, so not imported by tooling).
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _step_overhead(
    prepare: Callable[[object], object],
    install: Callable[[object], object],
    step_s: float,
    steps: int,
    device: str,
) -> dict:
    """Mean step time of ``steps`` steps: compute only; compute after preparing the step's
    targets (serial); compute while the next step's targets are prepared (Prefetcher). Both
    prepared variants then install the step's targets on ``device`` on the step's thread
    (``install``: the host-to-GPU copy, nothing on a CPU)."""
    from routereplay.trainer_adapter import Prefetcher

    def mean_step(run_one: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            run_one()
        return (time.perf_counter() - t0) / steps

    _compute(0.1, device)  # warm-up: the first GPU products pay for library setup
    base = mean_step(lambda: _compute(step_s, device))
    serial = mean_step(lambda: (install(prepare()), _compute(step_s, device)))
    with Prefetcher(prepare, range(steps + 1), depth=1) as pf:
        # Step 0's targets: prepared before the loop, as a trainer's first step waits. Each
        # step installs its targets, computes, then takes the next step's (prepared meanwhile).
        current = [next(pf)]

        def prefetched_step() -> None:
            install(current[0])
            _compute(step_s, device)
            current[0] = next(pf)

        pre = mean_step(prefetched_step)
    return {
        "step_s": step_s,
        "steps": steps,
        "step_device": device,
        "step_compute_only_s": base,
        "step_serial_s": serial,
        "step_prefetch_s": pre,
        "added_serial_pct": 100 * (serial - base) / base,
        "added_prefetch_pct": 100 * (pre - base) / base,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="routereplay bench trainer", description=__doc__)
    p.add_argument("--tokens", type=int, default=262_144, help="global batch tokens")
    p.add_argument("--layers", type=int, default=48, help="MoE layers")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--completion-len", type=int, default=2048, help="mean completion tokens")
    p.add_argument("--group", type=int, default=8, help="GRPO group size (shared prompt)")
    p.add_argument(
        "--routes", choices=sorted(ROUTES), default="skewed",
        help="the routes' workload: skewed (Zipf popularity per layer, experts kept from token "
        "to token; bench store's), uniform (distinct ids drawn uniformly; near what a trained "
        "router gives), progression (arithmetic rows: compressible by short zstd matches, the "
        "slowest to decode, and the smallest stored, hence the fastest floor)",
    )  # fmt: skip
    p.add_argument("--repeat", type=int, default=3, help="best of N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-url", default=None, help="default: a private redis-server")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--step-s", type=float, default=2.0,
        help="simulated compute per training step for the prefetch part (0: skip it)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="simulated steps per variant")
    p.add_argument(
        "--step-device", default="cpu",
        help="where the simulated step computes and the targets are installed: cpu, or a CUDA "
        "device (cuda, cuda:1), which adds the host-to-GPU copy of each step's targets",
    )  # fmt: skip
    p.add_argument(
        "--block-size", type=int, default=None,
        help="tokens per stored chunk (default: the store's, 128); fewer, larger chunks cost "
        "less per step to read, at the price of coarser prefix sharing and prefix-cache fills",
    )  # fmt: skip
    p.add_argument(
        "--decode-threads", type=int, default=None,
        help="the store's decode threads (default: its own, the CPUs up to 8)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.block_size is None:
        from routereplay.client import DEFAULT_BLOCK_SIZE

        args.block_size = DEFAULT_BLOCK_SIZE
    elif args.block_size < 1:
        p.error(f"--block-size must be >= 1, got {args.block_size}")
    if args.step_device != "cpu":
        import torch

        if not args.step_device.startswith("cuda") or not torch.cuda.is_available():
            p.error(
                f"--step-device {args.step_device!r}: expected cpu or an available CUDA device "
                f"(torch sees {torch.cuda.device_count()} GPUs)"
            )
    return args


def measure(args: argparse.Namespace) -> dict:
    """Run the benchmark on ``args`` (from :func:`parse_args`); returns its results."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    if args.redis_url:
        return run(args.redis_url, args)
    from routereplay.local_redis import redis_server

    with redis_server() as url:
        return run(url, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = measure(args)
    n = res["tokens"]
    print(
        f"routereplay bench trainer: {n} tokens in {res['records']} records "
        f"({res['groups']} GRPO groups of {args.group}), {args.layers} MoE layers, "
        f"{args.experts} experts, top-{args.topk}, {args.routes} routes; targets "
        f"{res['raw_mb']:.0f} MB (compact); {res['chunks_read']} distinct chunks of "
        f"{res['block_size']} tokens"
    )
    print(f"  put (setup, not per step)      {res['put_s']:8.3f} s")
    th = res["decode_threads"]
    for key, label in [
        ("fetch_decode_s", f"fetch + decode (get_many, {th} thr)"),
        ("align_check_s", "position map + token check"),
        ("gather_to_torch_s", "gather -> torch (all rows)"),
        ("end_to_end_s", f"END TO END per step ({th} thr)"),
        ("end_to_end_one_thread_s", "end to end, 1 decode thread"),
        ("end_to_end_fresh_targets_s", "end to end, fresh target memory"),
        ("tp2_sp_rank_gather_s", "gather, one TP2+SP rank"),
    ]:
        s = res[key]
        print(f"  {label:30s} {s:8.3f} s  {n / s / 1e6:8.2f} M tokens/s")
    peer_s, floor_s = res["peer_inline_json_s"], res["floor_redis_get_copy_s"]
    print(
        f"  {'peer: inline JSON base64 .npy':30s} {peer_s:8.3f} s  {n / peer_s / 1e6:8.2f} M "
        f"tokens/s  ({res['peer_inline_mb']:.0f} MB of JSON vs {res['stored_mb']:.0f} MB stored)"
    )
    print(
        f"  {'floor: Redis GET + one copy':30s} {floor_s:8.3f} s  {n / floor_s / 1e6:8.2f} M "
        "tokens/s  (into a reused buffer)"
    )
    print(
        f"  ratios (same run), {th} decode threads: peer / ours = {res['peer_over_ours']:.2f}x "
        f"(target >= 3), ours / floor = {res['ours_over_floor']:.2f}x; one decode thread: "
        f"{res['peer_over_ours_one_thread']:.2f}x (target >= 2), "
        f"{res['ours_one_thread_over_floor']:.2f}x  [{res['cpus']} CPUs]"
    )
    if res["cpu_ours_redis_s"] is not None:
        line = (
            f"  CPU per step, this process + redis-server: ours {res['cpu_ours_process_s']:.3f} + "
            f"{res['cpu_ours_redis_s']:.3f} s, floor {res['cpu_floor_process_s']:.3f} + "
            f"{res['cpu_floor_redis_s']:.3f} s"
        )
        if res["cpu_bound_s"] is not None:
            line += (
                f"; on {res['cpus']} CPUs ours needs >= {res['cpu_bound_s']:.3f} s even with "
                f"every core busy: {res['cpu_bound_over_floor']:.2f}x the floor at best"
            )
        print(line)
    else:
        print(f"  CPU per step: ours {res['cpu_ours_process_s']:.3f} s in this process "
              "(the redis-server did not report its CPU: INFO refused)")  # fmt: skip
    if res["end_to_end_pinned_s"] is not None:
        s = res["end_to_end_pinned_s"]
        print(
            f"  {'end to end, pinned targets':30s} {s:8.3f} s  {n / s / 1e6:8.2f} M tokens/s  "
            f"(a GPU host's path: peer / ours = {peer_s / s:.2f}x, ours / floor = "
            f"{res['ours_pinned_over_floor']:.2f}x)"
        )
    if res["install_on_gpu_s"] is not None:
        print(
            f"  {'install on ' + args.step_device:30s} {res['install_on_gpu_s']:8.4f} s  "
            f"(the step's thread; from pageable targets: {res['install_on_gpu_pageable_s']:.4f} s)"
        )
    if "step_s" in res:
        print(
            f"  a {res['step_s']:.1f} s training step on {res['step_device']} ({res['steps']} "
            "steps each, compute and install on the main thread): compute only "
            f"{res['step_compute_only_s']:.3f} s; prepare then compute "
            f"{res['step_serial_s']:.3f} s (+{res['added_serial_pct']:.1f}%); with Prefetcher "
            f"{res['step_prefetch_s']:.3f} s (+{res['added_prefetch_pct']:.2f}%, target < 1%)"
        )
    if args.json:
        print(json.dumps(res))
    return 0
