"""``routereplay bench scale``: the store's throughput on a Redis Cluster, against redis-benchmark.

Writer processes (rollout workers) ``put`` GRPO groups of records into a private 3-master Redis
Cluster on loopback while reader processes (trainer ranks) ``get_many`` the groups the writers
have finished, a step's worth of groups per call. Records have the routes of real models
(Qwen3-30B-A3B: 48 MoE layers x 128 experts x top-8; DeepSeek-V3: 58 x 256 x top-8; ``bench
store``'s skewed workload), and each group's samples share their prompt, so its chunks are stored
once. One row per writer count (1, 2, 4 by default), each writer with ``--readers-per-writer``
readers, on a freshly flushed cluster.

The floor is ``redis-benchmark --cluster``'s raw SET and GET throughput on the same cluster in the
same run, with values the size of the rows' mean stored chunk; in route-tokens per second, the
floor is its bytes per second over the stored bytes per token. Readers check a sample of the
records they read against a digest the writer took before storing them; a mismatch or a lost
record fails the run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import queue
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay.bench.store import SHAPES, Shape, make_record, skewed_routes_many
from routereplay.bench.trainer import redis_cpu_s

__all__ = ["main", "measure", "parse_args"]

# redis-benchmark draws keys from requests / _FLOOR_KEYS_DIV names: every name is SET many times
# before the GETs run, so nearly every GET finds a value (the hit rate is measured and reported).
_FLOOR_KEYS_DIV = 20


@dataclass(frozen=True)
class Workload:
    """What each writer of a row writes: ``groups`` GRPO groups of ``group`` samples."""

    shape: Shape
    groups: int
    group: int
    prompt: int
    completion: int  # mean; each sample's is drawn from [completion / 2, completion * 3 / 2)
    block_size: int
    seed: int


# ---------------------------------------------------------------------------------------------
# the records
# ---------------------------------------------------------------------------------------------
def route_pool(work: Workload) -> list[np.ndarray]:
    """One writer's routes, ``[n, M, K]`` per sequence: each group's prompt, then its
    completions (lengths drawn from [completion / 2, completion * 3 / 2)). The skewed generator
    steps token by token (seconds per thousand tokens at these shapes), so a shape's routes are
    drawn once and every writer relabels them (:func:`make_groups`)."""
    shape = work.shape
    rng = np.random.default_rng(work.seed)
    lo, hi = max(1, work.completion // 2), max(2, work.completion * 3 // 2)
    lengths = [
        n for _ in range(work.groups)
        for n in (work.prompt, *rng.integers(lo, hi, work.group).tolist())
    ]  # fmt: skip
    M, E, K = len(shape.moe_layers), shape.num_experts, shape.top_k
    return skewed_routes_many(rng, lengths, M, E, K)


def make_groups(work: Workload, pool: list[np.ndarray], writer: int) -> list[list[tuple]]:
    """Writer ``writer``'s GRPO groups: ``[(route id, RouteRecord)]`` per group, the samples of
    a group sharing one prompt (tokens and routes). Each writer draws its own token ids and
    renames the experts of ``pool`` by a permutation per layer, which keeps the workload's
    statistics (its popularity order is a random permutation per layer already); so no chunk is
    shared across writers, only within a group, as in an RL step."""
    rng = np.random.default_rng([work.seed, writer])
    M, E = len(work.shape.moe_layers), work.shape.num_experts
    rename = np.argsort(rng.random((M, E)), axis=1).astype(pool[0].dtype)
    layer = np.arange(M)[None, :, None]
    seqs = iter(pool)
    groups = []
    for g in range(work.groups):
        prompt = rng.integers(0, 151_000, work.prompt)
        p_rows = rename[layer, next(seqs)]
        group = []
        for s in range(work.group):
            c_rows = rename[layer, next(seqs)]
            tokens = np.concatenate([prompt, rng.integers(0, 151_000, len(c_rows))])
            rec = make_record(work.shape, np.concatenate([p_rows, c_rows]), tokens, work.prompt)
            group.append((f"w{writer}-g{g}-s{s}", rec))
        groups.append(group)
    return groups


def record_digest(rec: Any) -> bytes:
    """A digest of everything ``RouteRecord.__eq__`` compares that a benchmark record carries:
    equal digests, equal records (dtypes and layouts of a decoded record aside)."""
    h = hashlib.blake2b(digest_size=16)
    meta = (rec.moe_layers, rec.num_layers, rec.num_experts, rec.prompt_len, rec.model)
    h.update(repr((meta, rec.experts.shape, rec.experts.dtype.itemsize)).encode())
    for a in (rec.token_ids.astype(np.int64), rec.valid.astype(bool), rec.experts):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()


# ---------------------------------------------------------------------------------------------
# the processes (top-level functions: the forkserver and spawn contexts import them by name)
# ---------------------------------------------------------------------------------------------
def _report(role: str, index: int, results: Any, body: Callable[[], dict]) -> None:
    """Run a process's body; send its result, or its traceback, to the parent."""
    try:
        out = body()
    except BaseException:
        results.put({"role": role, "index": index, "error": traceback.format_exc()})
        return
    results.put({"role": role, "index": index, **out})


def _ready_set_go(role: str, index: int, results: Any, start: Any, timeout_s: float) -> None:
    """Tell the parent this process is ready, then wait for its start signal: the parent
    starts every process's clock at once, and sees a process that died before it was ready
    (where waiting on a barrier would wait for it until the timeout)."""
    results.put({"role": role, "index": index, "ready": True})
    if not start.wait(timeout_s):
        raise TimeoutError(f"{role} {index}: no start signal within {timeout_s} s")


def _store(url: str, prefix: str, block_size: int, decode_threads: int | None) -> Any:
    from routereplay.client import RouteStore

    return RouteStore.from_url(
        url, prefix=prefix, block_size=block_size, decode_threads=decode_threads, cluster=True
    )


def writer_process(
    url: str, prefix: str, work: Workload, pool: list[np.ndarray], index: int, verify_every: int,
    start: Any, handoff: Any, results: Any, timeout_s: float,
) -> None:  # fmt: skip
    """Generate this writer's groups, wait for everyone, then put them one after another and
    hand each finished group's ids (and the sample's digests) to the readers."""

    def body() -> dict[str, Any]:
        groups = make_groups(work, pool, index)
        k = 0
        sample: dict[str, bytes | None] = {}
        for group in groups:  # the digests are taken before the clock starts
            for rid, rec in group:
                sample[rid] = record_digest(rec) if k % verify_every == 0 else None
                k += 1
        store = _store(url, prefix, work.block_size, None)
        try:
            _ready_set_go("writer", index, results, start, timeout_s)
            return _put_groups(store, groups, sample, handoff)
        finally:
            store.close()

    _report("writer", index, results, body)


def _put_groups(
    store: Any, groups: list[list[tuple[str, Any]]], sample: dict, handoff: Any
) -> dict[str, Any]:
    t0, c0 = time.monotonic(), time.process_time()
    tokens = stored = chunk_bytes = chunks = 0
    for group in groups:
        for rid, rec in group:
            res = store.put(rid, rec)
            tokens += rec.num_tokens
            stored += res.bytes_written
            chunk_bytes += res.bytes_written - res.manifest_bytes
            chunks += res.chunks_written
        handoff.put([(rid, rec.num_tokens, sample[rid]) for rid, rec in group])
    return {
        "start": t0, "end": time.monotonic(), "cpu_s": time.process_time() - c0,
        "records": sum(len(g) for g in groups), "tokens": tokens, "bytes_written": stored,
        "chunk_bytes": chunk_bytes, "chunks_written": chunks,
    }  # fmt: skip


def reader_process(
    url: str, prefix: str, block_size: int, decode_threads: int | None, step_groups: int,
    index: int, start: Any, handoff: Any, results: Any, timeout_s: float,
) -> None:  # fmt: skip
    """Read finished groups, ``step_groups`` per ``get_many`` (fewer at the end), until the
    parent's ``None``; check the sampled records against the writers' digests."""

    def body() -> dict[str, Any]:
        store = _store(url, prefix, block_size, decode_threads)
        try:
            _ready_set_go("reader", index, results, start, timeout_s)
            return _read_steps(store, step_groups, handoff, index, timeout_s)
        finally:
            store.close()

    _report("reader", index, results, body)


def _read_steps(
    store: Any, step_groups: int, handoff: Any, index: int, timeout_s: float
) -> dict[str, Any]:
    c0 = time.process_time()
    out = {"intervals": [], "records": 0, "tokens": 0, "verified_records": 0,
           "verified_tokens_written": 0, "verified_tokens_read": 0}  # fmt: skip
    pending: list = []
    done = False
    while not done:
        item = handoff.get(timeout=timeout_s)
        done = item is None
        if not done:
            pending.append(item)
        if pending and (done or len(pending) >= step_groups):
            _read_step(store, [e for g in pending for e in g], out, index)
            pending = []
    out["cpu_s"] = time.process_time() - c0
    return out


def _read_step(store: Any, entries: list[tuple], out: dict, index: int) -> None:
    t0 = time.monotonic()
    recs = store.get_many([rid for rid, _, _ in entries])
    out["intervals"].append((t0, time.monotonic()))
    out["records"] += len(recs)
    out["tokens"] += sum(r.num_tokens for r in recs)
    for (rid, tokens, digest), rec in zip(entries, recs, strict=True):
        if digest is None:
            continue
        if rec.num_tokens != tokens or record_digest(rec) != digest:
            raise RuntimeError(
                f"reader {index}: record {rid!r} read back differs from what was written "
                f"({rec.num_tokens} tokens read, {tokens} written)"
            )
        out["verified_records"] += 1
        out["verified_tokens_written"] += tokens
        out["verified_tokens_read"] += rec.num_tokens


# ---------------------------------------------------------------------------------------------
# one row: W writers and their readers on a flushed cluster
# ---------------------------------------------------------------------------------------------
def _context() -> Any:
    # Not fork: a forked child would inherit the parent's Redis connections and threads. The
    # forkserver starts each process from one that has imported this module already.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return mp.get_context("spawn")


def _collect(results: Any, n: int, procs: list, deadline: float) -> list[dict]:
    """``n`` results; raises with the child's traceback if one failed or died without one."""
    got: list[dict] = []
    while len(got) < n:
        try:
            r = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"bench scale: {len(got)} of {n} results, processes exited "
                    f"{[p.exitcode for p in dead]}, deadline passed: "
                    f"{time.monotonic() > deadline}"
                ) from None
            continue
        if "error" in r:
            raise RuntimeError(f"bench scale: {r['role']} {r['index']} failed:\n{r['error']}")
        got.append(r)
    return got


def run_row(
    url: str, work: Workload, pool: list[np.ndarray], writers: int, args: argparse.Namespace,
    row: int,
) -> dict:  # fmt: skip
    """``writers`` writer processes and their readers against the cluster at ``url``."""
    ctx = _context()
    readers = writers * args.readers_per_writer
    start = ctx.Event()
    handoff, results = ctx.Queue(), ctx.Queue()
    prefix = f"scale{row}"
    procs = [
        ctx.Process(target=writer_process, args=(url, prefix, work, pool, i, args.verify_every,
                    start, handoff, results, args.timeout_s))
        for i in range(writers)
    ] + [
        ctx.Process(target=reader_process, args=(url, prefix, work.block_size,
                    args.decode_threads, args.step_groups, i, start, handoff, results,
                    args.timeout_s))
        for i in range(readers)
    ]  # fmt: skip
    deadline = time.monotonic() + args.timeout_s
    with _cluster_client(url) as client, _running(procs):
        _collect(results, writers + readers, procs, deadline)  # every one is ready
        cpu0 = redis_cpu_s(client)
        t0 = time.monotonic()
        start.set()
        w = _collect(results, writers, procs, deadline)
        # A writer's last groups can still sit in its queue's feeder thread after its result
        # arrives; its exit flushes them into the pipe, so the end markers go in after them.
        for p in procs[:writers]:
            p.join(max(0.0, deadline - time.monotonic()))
        for _ in range(readers):
            handoff.put(None)
        r = _collect(results, readers, procs, deadline)
        wall = time.monotonic() - t0
        cpu1 = redis_cpu_s(client)
    redis_cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    return summarise_row(work, w, r, wall, redis_cpu)


@contextlib.contextmanager
def _running(procs: list) -> Iterator[None]:
    """Start ``procs``; on the way out, wait for them, and stop any still running (a failed
    row leaves readers waiting for groups that will never come)."""
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.join(timeout=5.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()


@contextlib.contextmanager
def _cluster_client(url: str) -> Iterator[Any]:
    from redis.cluster import RedisCluster

    client = RedisCluster.from_url(url)
    try:
        yield client
    finally:
        client.close()


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of ``intervals`` was open."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarise_row(
    work: Workload, w: list[dict], r: list[dict], wall: float, redis_cpu: float | None
) -> dict:
    """A row's figures from its processes' results; raises if a record was not read back."""
    tokens = sum(x["tokens"] for x in w)
    read = sum(x["tokens"] for x in r)
    records = sum(x["records"] for x in w)
    if read != tokens or sum(x["records"] for x in r) != records:
        raise RuntimeError(f"bench scale: wrote {records} records ({tokens} tokens), read "
                           f"{sum(x['records'] for x in r)} ({read} tokens)")  # fmt: skip
    write_s = max(x["end"] for x in w) - min(x["start"] for x in w)
    read_s = _union_s([iv for x in r for iv in x["intervals"]])
    stored = sum(x["bytes_written"] for x in w)
    chunks = sum(x["chunks_written"] for x in w)
    client_cpu = sum(x["cpu_s"] for x in w + r)
    return {
        "shape": work.shape.name, "writers": len(w), "readers": len(r), "records": records,
        "tokens_written": tokens, "tokens_read": read, "write_s": write_s, "read_s": read_s,
        "wall_s": wall, "write_tokens_per_s": tokens / write_s, "read_tokens_per_s": read / read_s,
        "stored_bytes": stored, "stored_bytes_per_token": stored / tokens,
        "chunks_written": chunks, "chunk_bytes": sum(x["chunk_bytes"] for x in w),
        "client_cpu_s": client_cpu, "redis_cpu_s": redis_cpu,
        "cores_busy": (client_cpu + (redis_cpu or 0.0)) / wall,
        "client_cpu_us_per_token": client_cpu / tokens * 1e6,
        "redis_cpu_us_per_token": None if redis_cpu is None else redis_cpu / tokens * 1e6,
        **{k: sum(x[k] for x in r) for k in
           ("verified_records", "verified_tokens_written", "verified_tokens_read")},
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the floor: redis-benchmark on the same cluster
# ---------------------------------------------------------------------------------------------
def _keyspace(client: Any) -> tuple[int, int]:
    from redis.cluster import RedisCluster

    per_node = client.info("stats", target_nodes=RedisCluster.PRIMARIES).values()
    return (
        sum(int(i["keyspace_hits"]) for i in per_node),
        sum(int(i["keyspace_misses"]) for i in per_node),
    )


def _parse_csv(out: str) -> dict[str, float]:
    """``{"SET": rps, "GET": rps}`` from ``redis-benchmark --csv`` (after its cluster banner)."""
    rps = {}
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) >= 2 and cells[0] in ("SET", "GET"):
            rps[cells[0]] = float(cells[1])
    if set(rps) != {"SET", "GET"}:
        raise RuntimeError(f"redis-benchmark printed no SET/GET rates:\n{out[-2000:]}")
    return rps


def measure_floor(url: str, value_bytes: int, requests: int, clients: int) -> dict:
    """redis-benchmark's SET then GET of ``value_bytes`` values on the cluster at ``url``; the
    GETs' hit rate from the masters' ``INFO stats`` (a missed GET moves no value)."""
    host_port = url.split("://", 1)[1].split("/", 1)[0]
    host, port = host_port.rsplit(":", 1)
    cmd = ["redis-benchmark", "--cluster", "-h", host, "-p", port, "-t", "set,get",
           "-d", str(value_bytes), "-n", str(requests), "-c", str(clients),
           "-r", str(max(1, requests // _FLOOR_KEYS_DIV)), "--csv"]  # fmt: skip
    with _cluster_client(url) as client:
        h0, m0 = _keyspace(client)
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
        h1, m1 = _keyspace(client)
    rps = _parse_csv(out.stdout)
    hit = (h1 - h0) / max(1, (h1 - h0) + (m1 - m0))
    return {
        "command": " ".join(cmd), "value_bytes": value_bytes, "set_rps": rps["SET"],
        "get_rps": rps["GET"], "get_hit_fraction": hit,
        "set_bytes_per_s": rps["SET"] * value_bytes,
        "get_bytes_per_s": rps["GET"] * value_bytes * hit,
    }  # fmt: skip


def _flush(url: str) -> None:
    # Each row starts on an empty cluster: its chunks must not be found from an earlier row,
    # and memory stays bounded. The cluster is this benchmark's own (see measure).
    from redis.cluster import RedisCluster

    with _cluster_client(url) as client:
        client.flushall(target_nodes=RedisCluster.PRIMARIES)


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------
def measure_shape(url: str, work: Workload, args: argparse.Namespace, row0: int) -> dict:
    """Rows for each writer count, then the floor with values of their mean chunk size."""
    pool = route_pool(work)
    rows = []
    for i, writers in enumerate(args.writers):
        _flush(url)
        rows.append(run_row(url, work, pool, writers, args, row0 + i))
    chunk = round(sum(r["chunk_bytes"] for r in rows) / sum(r["chunks_written"] for r in rows))
    _flush(url)
    floor = measure_floor(url, chunk, args.floor_requests, args.floor_clients)
    for r in rows:
        b = r["stored_bytes_per_token"]
        r["write_over_floor"] = floor["set_bytes_per_s"] / b / r["write_tokens_per_s"]
        r["read_over_floor"] = floor["get_bytes_per_s"] / b / r["read_tokens_per_s"]
    return {"shape": work.shape.name, "moe_layers": len(work.shape.moe_layers),
            "experts": work.shape.num_experts, "top_k": work.shape.top_k,
            "rows": rows, "floor": floor}  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    """Run the benchmark on ``args`` (from :func:`parse_args`) on a private cluster; returns
    its results: per shape, a row per writer count and the floor."""
    from routereplay.client import DEFAULT_BLOCK_SIZE
    from routereplay.local_redis import redis_cluster

    block = args.block_size or DEFAULT_BLOCK_SIZE
    shapes = {s.name: s for s in SHAPES}
    out = {"params": {k: v for k, v in vars(args).items() if k != "json"}, "shapes": []}
    out["params"]["block_size"] = block
    with redis_cluster(args.masters) as url:
        for i, name in enumerate(args.shapes):
            work = Workload(shapes[name], args.groups, args.group, args.prompt,
                            args.completion, block, args.seed + i)  # fmt: skip
            out["shapes"].append(measure_shape(url, work, args, 100 * i))
    return out


def _int_list(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected counts >= 1 like 1,2,4, got {text!r}")
    return vals


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="routereplay bench scale", description=__doc__)
    p.add_argument(
        "--writers",
        type=_int_list,
        default=[1, 2, 4],
        help="writer processes per row, comma-separated",
    )
    p.add_argument("--readers-per-writer", type=int, default=1)
    p.add_argument(
        "--shapes",
        nargs="+",
        default=[s.name for s in SHAPES[:2]],
        choices=[s.name for s in SHAPES],
    )
    p.add_argument("--groups", type=int, default=8, help="GRPO groups per writer")
    p.add_argument("--group", type=int, default=8, help="samples per group (shared prompt)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--completion", type=int, default=512, help="mean completion tokens")
    p.add_argument(
        "--step-groups",
        type=int,
        default=2,
        help="groups per get_many: a trainer rank's share of a step",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per stored chunk (default: the store's)",
    )
    p.add_argument(
        "--decode-threads",
        type=int,
        default=None,
        help="each reader's decode threads (default: the store's)",
    )
    p.add_argument(
        "--verify-every",
        type=int,
        default=4,
        help="readers check every Nth record against the writer's digest",
    )
    p.add_argument(
        "--floor-requests", type=int, default=20_000, help="redis-benchmark -n (per test)"
    )
    p.add_argument("--floor-clients", type=int, default=16, help="redis-benchmark -c")
    p.add_argument("--masters", type=int, default=3, help="cluster masters")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="give up on a row whose processes take longer",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line as well")
    args = p.parse_args(argv)  # fmt: skip
    for name in ("readers_per_writer", "groups", "group", "prompt", "completion",
                 "step_groups", "verify_every", "floor_requests", "floor_clients"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def _row_line(r: dict) -> str:
    redis_us = r["redis_cpu_us_per_token"]
    cpu = f"{r['client_cpu_us_per_token']:.1f}+" + ("?" if redis_us is None else f"{redis_us:.1f}")
    return (
        f"{r['shape']:14s} {r['writers']:2d} {r['readers']:2d} {r['tokens_written']:8d} "
        f"{r['stored_bytes_per_token']:8.1f} {r['write_tokens_per_s']:12,.0f} "
        f"{r['write_over_floor']:7.2f}x {r['read_tokens_per_s']:12,.0f} "
        f"{r['read_over_floor']:7.2f}x {r['cores_busy']:6.2f} {cpu:>13s} "
        f"{r['verified_records']:8d}"
    )


def _floor_line(f: dict, bytes_per_token: float) -> str:
    b = bytes_per_token
    return (
        f"{'  floor':14s} redis-benchmark -d {f['value_bytes']}: SET "
        f"{f['set_bytes_per_s'] / 1e6:,.0f} MB/s ({f['set_bytes_per_s'] / b:,.0f} tok/s), GET "
        f"{f['get_bytes_per_s'] / 1e6:,.0f} MB/s ({f['get_bytes_per_s'] / b:,.0f} tok/s at "
        f"{b:.1f} B/token), {f['get_hit_fraction']:.1%} of GETs hit"
    )


def _print_table(res: dict) -> None:
    pr = res["params"]
    print(
        f"routereplay bench scale: {pr['masters']}-master Redis Cluster on loopback; each writer "
        f"puts {pr['groups']} GRPO groups of {pr['group']} (prompt {pr['prompt']} + completion "
        f"~{pr['completion']} tokens), chunks of {pr['block_size']} tokens; readers get_many "
        f"{pr['step_groups']} groups per call"
    )
    print(
        f"{'shape':14s} {'W':>2s} {'R':>2s} {'tokens':>8s} {'B/token':>8s} {'write tok/s':>12s} "
        f"{'x floor':>8s} {'read tok/s':>12s} {'x floor':>8s} {'cores':>6s} "
        f"{'CPU us/token':>13s} {'checked':>8s}"
    )
    for shape in res["shapes"]:
        for r in shape["rows"]:
            print(_row_line(r))
        print(_floor_line(shape["floor"], shape["rows"][0]["stored_bytes_per_token"]))
    print(
        "W/R = writer/reader processes; tok/s = route-tokens per second: written over the "
        "writers' wall time, read over the time a get_many was in flight; x floor = how many "
        "times the floor's time per token ours takes (floor: raw SET/GET of the stored bytes); "
        "cores = client and redis CPU over the row's wall time; CPU us/token = the writers' and "
        "readers' CPU + the redis-servers', per token written and read; checked = records read "
        "back and compared with the writer's digest."
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    res = measure(args)
    _print_table(res)
    if args.json:
        print(json.dumps(res))
    return 0
