"""``routereplay bench tp``: host CPU of one training step's route preparation at tensor
parallelism TP, every rank preparing its own targets against one rank per group preparing them
for all (``share_targets``).

``bench trainer``'s batch (GRPO groups, 48 MoE layers x 128 experts x top-8 by default) is
stored in a private redis-server; TP rank processes on this host (gloo, sequence parallel on)
then run ``--steps`` steps each way:

- **each**: every rank fetches and decodes the step's records (``get_many``), maps them and
  gathers its sequence-parallel slice: what a trainer does without sharing;
- **shared**: rank 0 does that once for the group's rows and ``share_targets(...,
  sequence_parallel=True)`` scatters each rank its slice.

Printed per way: wall time per step (slowest rank), the CPU time per step of all the ranks
together and of the redis-server, and the ratio. Every rank checks that both ways give it the
same targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from routereplay.local_redis import free_port, redis_server

if TYPE_CHECKING:
    from routereplay.client import RouteStore
    from routereplay.trainer_adapter import ReplayTargets

__all__ = ["main"]


def _records_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(layers=args.layers, experts=args.experts, topk=args.topk,
                              tokens=args.tokens, prompt_len=1024, completion_len=2048, group=8,
                              routes=args.routes)  # fmt: skip


def _store(url: str, args: argparse.Namespace, work: Path) -> None:
    from routereplay.client import RouteStore

    from .trainer import make_records, put_records

    records, _ = make_records(np.random.default_rng(args.seed), _records_args(args))
    ids = [f"tp-{i}" for i in range(len(records))]
    with RouteStore.from_url(url, prefix="rrbench") as store:
        put_records(store, ids, records)
    (work / "ids.json").write_text(json.dumps(ids))


def _prepare(
    store: RouteStore, ids: list[str], layers: tuple[int, ...], tp: int, rank: int, sp: bool
) -> ReplayTargets:
    from routereplay.trainer_adapter import gather_targets, sample_from_record, thd_position_map

    recs = store.get_many(ids)
    lens = [r.num_tokens for r in recs]
    cu = np.concatenate([[0], np.cumsum(lens)])
    cup = cu.copy()
    cup[-1] += (-cu[-1]) % (2 * tp)  # padded so that it splits evenly
    pm = thd_position_map([sample_from_record(i, r) for i, r in enumerate(recs)], cu,
                          cu_seqlens_padded=cup)  # fmt: skip
    local = pm.local(tp_size=tp, tp_rank=rank, sequence_parallel=sp, cu_seqlens_padded=cup)
    return gather_targets(local, recs, layers)


def _rank(rank: int, tp: int, port: int, url: str, work: Path, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from routereplay.client import RouteStore
    from routereplay.trainer_adapter import share_targets

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    ids = json.loads((work / "ids.json").read_text())
    layers = tuple(range(args.layers))
    store = RouteStore.from_url(url, prefix="rrbench", decode_threads=args.decode_threads)
    out: dict[str, list[float]] = {}
    last = {}
    for way in ("each", "shared", "each", "shared"):
        for _ in range(args.steps):
            dist.barrier()
            r0 = _redis_cpu(url) if rank == 0 else 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            if way == "each":
                t = _prepare(store, ids, layers, tp, rank, True)
            else:
                make = (lambda: _prepare(store, ids, layers, tp, 0, False)) if rank == 0 else None
                t = share_targets(make, group=None, src=0, sequence_parallel=True)
            c1 = time.process_time()
            dist.barrier()
            out.setdefault(way, []).extend([time.perf_counter() - t0, c1 - c0])
            if rank == 0:
                out.setdefault(way + "-redis", []).append(_redis_cpu(url) - r0)
            last[way] = t
    same = bool(np.array_equal(last["each"].experts, last["shared"].experts))
    (work / f"rank{rank}.json").write_text(json.dumps({"times": out, "same": same}))
    dist.destroy_process_group()


def _redis_cpu(url: str) -> float:
    import redis

    info = redis.Redis.from_url(url).info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _run(args: argparse.Namespace) -> dict:
    with redis_server() as url, tempfile.TemporaryDirectory(prefix="rr-tp-") as d:
        work = Path(d)
        _store(url, args, work)
        (work / "args.json").write_text(json.dumps(vars(args)))
        port = free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "routereplay.bench.tp", "--rank",
                                   str(r), str(port), url, d]) for r in range(args.tp)]  # fmt: skip
        if any(p.wait() for p in procs):
            raise RuntimeError("a TP rank failed; its traceback is above")
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(args.tp)]
    return _summary(ranks, args)


def _summary(ranks: list[dict], args: argparse.Namespace) -> dict:
    res: dict = {"tp": args.tp, "same_targets": all(r["same"] for r in ranks)}
    for way in ("each", "shared"):
        walls = np.array([r["times"][way][0::2] for r in ranks])  # [rank, step]
        cpus = np.array([r["times"][way][1::2] for r in ranks])
        steps = walls.shape[1]
        res[way] = {"wall_s": float(np.median(walls.max(axis=0))),
                    "cpu_ranks_s": float(cpus.sum() / steps),
                    "cpu_source_s": float(cpus[0].sum() / steps),
                    "cpu_redis_s": float(np.mean(ranks[0]["times"][way + "-redis"]))}  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "--rank":  # a TP rank process started by _run
        rank, port, url, d = int(argv[1]), int(argv[2]), argv[3], Path(argv[4])
        _rank(rank, json.loads((d / "args.json").read_text())["tp"], port, url, d,
              argparse.Namespace(**json.loads((d / "args.json").read_text())))  # fmt: skip
        return 0
    p = argparse.ArgumentParser(prog="routereplay bench tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks on this host")
    p.add_argument("--tokens", type=int, default=262_144, help="global batch tokens")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--routes", choices=["skewed", "uniform", "progression"], default="skewed")
    p.add_argument("--steps", type=int, default=3, help="steps per way (each way runs twice)")
    p.add_argument("--decode-threads", type=int, default=1, help="per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = _run(args)
    e, s = res["each"], res["shared"]
    print(f"routereplay bench tp: TP={args.tp} ranks on this host, {args.tokens} tokens a step, "
          f"{args.routes} routes, {args.decode_threads} decode thread(s) per rank")  # fmt: skip
    for way, r in (("every rank prepares", e), ("one rank, share_targets", s)):
        print(f"  {way:26s} wall {r['wall_s']:.3f} s/step, CPU of all ranks "
              f"{r['cpu_ranks_s']:.3f} s/step (rank 0 {r['cpu_source_s']:.3f}), redis-server "
              f"{r['cpu_redis_s']:.3f}")  # fmt: skip
    print(f"  ranks' CPU, shared / each: {s['cpu_ranks_s'] / e['cpu_ranks_s']:.2f}; wall: "
          f"{s['wall_s'] / e['wall_s']:.2f}; same targets on every rank: "
          f"{res['same_targets']}")  # fmt: skip
    if args.json:
        print(json.dumps(res))
    return 0 if res["same_targets"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
