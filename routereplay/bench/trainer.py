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
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

if TYPE_CHECKING:
    import torch

    from routereplay.client import RouteRecord, RouteStore
    from routereplay.trainer_adapter import PositionMap, ReplayTargets

__all__ = ["main"]


def make_records(
    rng: np.random.Generator, args: argparse.Namespace
) -> tuple[list[RouteRecord], int]:
    """The benchmark's records (GRPO groups sharing a prompt, shapes from ``args``) and how many
    groups they form."""
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
    """Store the bench batch's records at ``url``, time their preparation for a training step
    (each stage, end to end, against the peer path and the floor), and return the numbers."""
    import torch

    from routereplay.client import RouteStore
    from routereplay.trainer_adapter import ReplayTargets

    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    records, groups = make_records(rng, args)
    n_tokens = sum(r.num_tokens for r in records)
    ids = [f"bench-{i}" for i in range(len(records))]
    store = RouteStore.from_url(
        url, prefix="rrbench", decode_threads=args.decode_threads, block_size=args.block_size
    )
    m: dict[str, Any] = {"tokens": n_tokens, "records": len(records), "groups": groups}
    m["put_s"] = put_records(store, ids, records)
    steps = _Steps(store, ids, records, args.layers, args.step_device)
    m["fetch_decode_s"], recs = _timeit(steps.fetch, args.repeat)
    m["align_check_s"], pm = _timeit(lambda: steps.align(recs), args.repeat)
    m["gather_to_torch_s"], t = _timeit(lambda: steps.gather(pm, recs), args.repeat)
    floor = _Floor(store, ids)
    m["end_to_end_s"], _, m["floor_redis_get_copy_s"], (raw, blob) = _timeit_pair(
        steps.prepare, floor, args.repeat
    )
    m |= _cpu_per_step(steps.prepare, floor, args.repeat, store.redis, url)
    m["end_to_end_fresh_targets_s"], t_fresh = _timeit(
        lambda: steps.prepare(fresh=True), args.repeat
    )
    m["end_to_end_one_thread_s"], t1 = _one_decode_thread(url, args.block_size, steps, args.repeat)
    assert tuple(t.shape) == (args.layers, n_tokens, args.topk), t.shape
    m["tp2_sp_rank_gather_s"], _ = _tp2_sp_rank_gather(steps, recs, n_tokens, args.repeat)

    # -- baselines in the same run ---------------------------------------------------------------
    # Peer path (verl, ART): the routes inline in the OpenAI response, parsed by the trainer,
    # which then aligns and gathers exactly as above.
    bodies = _peer_bodies(records)
    m["peer_inline_json_s"], t_peer = _timeit(
        lambda: steps.gather(steps.align(p := _peer_records(bodies, records)), p), args.repeat
    )
    assert torch.equal(t_peer, t), "the peer path gathered other targets"
    assert torch.equal(t1, t), "one decode thread gathered other targets"
    assert torch.equal(t_fresh, t), "fresh target memory gathered other targets"
    del t_fresh, t_peer, t1  # their buffers go back to the pool for the steps below

    # -- a training step: time added with and without prefetch ----------------------------------
    install_s = install_pageable_s = e2e_pinned_s = None
    if steps.on_gpu:
        # What a trainer on a GPU host prepares (gather_targets(pin_memory=True), the path the
        # docs recommend with Prefetcher): the targets land in the caching host allocator's
        # page-locked blocks, reused from step to step, instead of fresh pageable pages.
        e2e_pinned_s, _ = _timeit(steps.prepare_step, args.repeat)
        pinned = steps.prepare_step()
        install_s = _timed_install(steps.install, pinned, args.repeat)
        pageable = ReplayTargets(pinned.layers, pinned.experts.copy(), pinned.num_experts)
        install_pageable_s = _timed_install(steps.install, pageable, args.repeat)
        assert torch.equal(pinned.to_torch(args.step_device).cpu(), t.to(torch.int64))
    m["step"] = (
        _step_overhead(steps.prepare_step, steps.install, args.step_s, args.steps, args.step_device)
        if args.step_s > 0
        else {}
    )
    store.close()
    m |= {
        "install_on_gpu_s": install_s,
        "install_on_gpu_pageable_s": install_pageable_s,
        "end_to_end_pinned_s": e2e_pinned_s,
        "decode_threads": store.decode_threads,
        "chunks_read": len(raw.chunks),
        "raw_mb": n_tokens * args.layers * args.topk * t.element_size() / 1e6,
        "stored_mb": len(blob) / 1e6,
        "peer_inline_mb": sum(len(b) for b in bodies) / 1e6,
    }
    return _results(m, args)


def _results(m: dict[str, Any], args: argparse.Namespace) -> dict:
    """The measurements ``m`` of :func:`run`, with the shape from ``args`` and the rates and
    ratios derived from them, in the order ``--json`` prints them."""
    n, e2e, e2e1 = m["tokens"], m["end_to_end_s"], m["end_to_end_one_thread_s"]
    peer_s, floor_s = m["peer_inline_json_s"], m["floor_redis_get_copy_s"]
    pinned_s, bound_s = m["end_to_end_pinned_s"], m["cpu_bound_s"]
    return {
        "tokens": n,
        "records": m["records"],
        "block_size": args.block_size,
        "chunks_read": m["chunks_read"],
        "groups": m["groups"],
        "routes": args.routes,
        "layers": args.layers,
        "experts": args.experts,
        "top_k": args.topk,
        "raw_mb": m["raw_mb"],
        "put_s": m["put_s"],
        "fetch_decode_s": m["fetch_decode_s"],
        "align_check_s": m["align_check_s"],
        "gather_to_torch_s": m["gather_to_torch_s"],
        "decode_threads": m["decode_threads"],
        "end_to_end_s": e2e,
        "end_to_end_tokens_per_s": n / e2e,
        "end_to_end_one_thread_s": e2e1,
        "end_to_end_fresh_targets_s": m["end_to_end_fresh_targets_s"],
        "tp2_sp_rank_gather_s": m["tp2_sp_rank_gather_s"],
        "install_on_gpu_s": m["install_on_gpu_s"],
        "install_on_gpu_pageable_s": m["install_on_gpu_pageable_s"],
        "end_to_end_pinned_s": pinned_s,
        "ours_pinned_over_floor": None if pinned_s is None else pinned_s / floor_s,
        "peer_inline_json_s": peer_s,
        "floor_redis_get_copy_s": floor_s,
        "stored_mb": m["stored_mb"],
        "peer_inline_mb": m["peer_inline_mb"],
        "peer_over_ours": peer_s / e2e,
        "ours_over_floor": e2e / floor_s,
        "cpu_ours_process_s": m["cpu_ours_process_s"],
        "cpu_ours_redis_s": m["cpu_ours_redis_s"],
        "cpu_floor_process_s": m["cpu_floor_process_s"],
        "cpu_floor_redis_s": m["cpu_floor_redis_s"],
        "cpus": m["cpus"],
        "cpu_bound_s": bound_s,
        "cpu_bound_over_floor": None if bound_s is None else bound_s / floor_s,
        "peer_over_ours_one_thread": peer_s / e2e1,
        "ours_one_thread_over_floor": e2e1 / floor_s,
        **m["step"],
    }


class _Steps:
    """A trainer rank's route preparation for the bench's packed batch, stage by stage: fetch
    and decode the records from ``store``, build and check the position map, gather the
    targets; and a training step's: its targets prepared, then installed on ``device``."""

    def __init__(
        self,
        store: RouteStore,
        ids: list[str],
        records: list[RouteRecord],
        layers: int,
        device: str,
    ) -> None:
        from routereplay.trainer_adapter import TargetBuffers

        self.store = store
        self.ids = ids
        # The trainer's own packed token ids (from its dataset, not from the store).
        lens = np.array([r.num_tokens for r in records])
        self.cu = np.concatenate([[0], np.cumsum(lens)])
        self.input_ids = np.concatenate([r.token_ids for r in records])[None, :]
        self.layers = tuple(range(layers))
        self.device = device
        self.on_gpu = device != "cpu"
        # The targets' memory is recycled from step to step (TargetBuffers), as the floor reuses
        # its buffer and the pinned path reuses torch's page-locked blocks: fresh pages cost a
        # fault and zeroing each (the "fresh target memory" line measures that path too).
        self.buffers = TargetBuffers(keep=4)  # the targets run keeps for its checks hold one each

    def fetch(self) -> list[RouteRecord]:
        return self.store.get_many(self.ids)

    def align(self, recs: list[RouteRecord]) -> PositionMap:
        from routereplay.trainer_adapter import sample_from_record, thd_position_map

        pm = thd_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], self.cu)
        pm.check_tokens(recs, self.input_ids)
        return pm

    def targets(
        self,
        pm: PositionMap,
        recs: list[RouteRecord],
        cp: int = 1,
        tp: int = 1,
        cp_rank: int = 0,
        tp_rank: int = 0,
        pin_memory: bool = False,
        fresh: bool = False,
    ) -> ReplayTargets:
        from routereplay.trainer_adapter import gather_targets

        local = pm.local(cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank)
        pool = None if pin_memory or fresh else self.buffers
        return gather_targets(local, recs, self.layers, pin_memory=pin_memory, buffers=pool)

    def gather(self, pm: PositionMap, recs: list[RouteRecord], **kw: Any) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.targets(pm, recs, **kw).experts)

    def prepare(self, _step: object = None, *, fresh: bool = False) -> torch.Tensor:
        """End to end: fetch, align, gather (into fresh memory with ``fresh``)."""
        r = self.fetch()
        return self.gather(self.align(r), r, fresh=fresh)

    def prepare_step(self, _step: object = None) -> ReplayTargets:
        """A training step's targets: on a GPU gathered into page-locked memory where they are
        prepared (gather_targets(pin_memory=True), in the Prefetcher's thread)."""
        r = self.fetch()
        return self.targets(self.align(r), r, pin_memory=self.on_gpu)

    def install(self, tg: ReplayTargets) -> object:
        """On the step's thread, what the replayer does (ReplayTargets.to_torch); nothing on a
        CPU."""
        return tg.to_torch(self.device) if self.on_gpu else tg


class _Floor:
    """The floor: the same stored bytes read from Redis (both round trips) and copied once, into
    a buffer reused from call to call."""

    def __init__(self, store: RouteStore, ids: list[str]) -> None:
        self.store = store
        self.ids = ids
        # Not a fresh bytes object each call: past glibc's largest heap-served size (32 MiB)
        # that is fresh pages each time, and the floor's copy then cost 0.024 s for the skewed
        # workload's 40 MB instead of 0.004 s (32 MB of progression rows stayed under it), a
        # floor that moved with the workload for no reason of Redis's.
        self.buf = np.empty(0, np.uint8)

    def __call__(self) -> tuple[object, np.ndarray]:
        raw = self.store.get_raw(self.ids)
        stored = [*raw.manifests.values(), *(c for c in raw.chunks.values() if c)]
        n = sum(map(len, stored))
        if self.buf.size < n:
            self.buf = np.empty(n, np.uint8)
        blob = self.buf[:n]
        np.concatenate([np.frombuffer(b, np.uint8) for b in stored], out=blob)
        return raw, blob


def put_records(store: RouteStore, ids: list[str], records: list[RouteRecord]) -> float:
    """Seconds to store ``records`` under ``ids`` (setup, not per step)."""
    t0 = time.perf_counter()
    for i, r in zip(ids, records, strict=True):
        store.put(i, r)
    return time.perf_counter() - t0


def _cpu_per_step(
    prepare: Callable[[], object],
    floor: Callable[[], object],
    repeat: int,
    client: object,
    url: str,
) -> dict[str, Any]:
    """CPU per step of ours (``prepare``) and of the floor, this process's and the redis-server's
    (:func:`_cpu_per_call`), the usable CPUs, and the least wall time ours needs on them."""
    from routereplay.client import usable_cpus

    # On a machine with few cores the wall-time ratio cannot go below what that CPU spread over
    # every core takes.
    cpu_ours, cpu_ours_redis = _cpu_per_call(prepare, repeat, client)
    cpu_floor, cpu_floor_redis = _cpu_per_call(floor, repeat, client)
    cpus = usable_cpus()
    # The bound holds only where the redis-server runs on this machine's cores: a loopback URL.
    local_server = urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")
    cpu_bound_s = (
        (cpu_ours + cpu_ours_redis) / cpus if cpu_ours_redis is not None and local_server else None
    )
    return {
        "cpu_ours_process_s": cpu_ours,
        "cpu_ours_redis_s": cpu_ours_redis,
        "cpu_floor_process_s": cpu_floor,
        "cpu_floor_redis_s": cpu_floor_redis,
        "cpus": cpus,
        "cpu_bound_s": cpu_bound_s,
    }


def _one_decode_thread(
    url: str, block_size: int, steps: _Steps, repeat: int
) -> tuple[float, object]:
    """The preparation end to end with the chunks decoded on the calling thread only (a second
    store, ``decode_threads=1``): best seconds of ``repeat``, and the last targets."""
    from routereplay.client import RouteStore

    serial_store = RouteStore.from_url(
        url, prefix="rrbench", decode_threads=1, block_size=block_size
    )
    timed = _timeit(
        lambda: steps.gather(steps.align(r := serial_store.get_many(steps.ids)), r), repeat
    )
    serial_store.close()
    return timed


def _tp2_sp_rank_gather(
    steps: _Steps, recs: list[RouteRecord], n_tokens: int, repeat: int
) -> tuple[float, object]:
    """The gather of one rank of TP=2 x SP (half the rows): best seconds of ``repeat``, and the
    last targets."""
    from routereplay.trainer_adapter import sample_from_record, thd_position_map

    pad = (-n_tokens) % 4
    cu_p = steps.cu.copy()
    cu_p[-1] += pad  # pad the pack so it splits evenly
    pm_p = thd_position_map(
        [sample_from_record(i, r) for i, r in enumerate(recs)], steps.cu, cu_seqlens_padded=cu_p
    )
    return _timeit(lambda: steps.gather(pm_p, recs, tp=2, tp_rank=1), repeat)


def _peer_bodies(records: list[RouteRecord]) -> list[str]:
    """Each record as the peer path (verl, ART) receives it: inline in the OpenAI response, as
    base64 of an .npy of ``[T-1, num_layers, K]``."""
    from routereplay.bench.store import vllm_inline

    return [
        json.dumps({"choices": [{"index": 0, "routed_experts": vllm_inline(r).decode()}]})
        for r in records
    ]


def _peer_records(bodies: list[str], records: list[RouteRecord]) -> list[RouteRecord]:
    """The peer path's records from ``bodies``: the JSON parsed, the base64 and the .npy
    decoded, the last token padded."""
    from routereplay.client import RouteRecord

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
    return out


def _timed_install(
    install: Callable[[ReplayTargets], object], tg: ReplayTargets, repeat: int
) -> float:
    """Best of ``repeat`` installs of ``tg`` on the GPU, as the step's thread sees them."""
    import torch

    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        install(tg)  # the thread's share; the copy runs on the GPU's stream
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best


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


def redis_cpu_s(client: object) -> float | None:
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
        r0 = redis_cpu_s(client)
        p0 = time.process_time()
        out = fn()
        proc = time.process_time() - p0
        del out  # a call's targets go back to the pool before the next call takes one
        r1 = redis_cpu_s(client)
        red = None if r0 is None or r1 is None else r1 - r0
        if best is None or proc + (red or 0.0) < best[0] + (best[1] or 0.0):
            best = (proc, red)
    assert best is not None
    return best


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
