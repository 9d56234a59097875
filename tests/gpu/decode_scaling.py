"""How chunk decoding scales with threads on this host: zstd alone against the whole chunk
decode (headers, zstd, rows, the blake3 address check; what RouteStore's decode threads run),
and get_many, on bench trainer's default batch (~1500 distinct chunks). Prints one line per
thread count (DIAG_THREADS, default "1 2 4 8 16"); DIAG_PROFILE=1 first prints cProfile's
heaviest functions of one decode of every chunk in one call, on this thread. Run by
tests/gpu/run_bench_host.sh."""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zstandard

from routereplay.bench.trainer import make_records
from routereplay.client import RouteStore
from routereplay.client._chunks import _HEAD, decode_chunks
from routereplay.local_redis import redis_server


def best(fn, repeat: int = 5) -> float:
    b = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        b = min(b, time.perf_counter() - t0)
    return b


def split(xs: list, n: int) -> list[list]:
    k = -(-len(xs) // n)
    return [xs[i : i + k] for i in range(0, len(xs), k)]


def zstd_only(items: list[tuple[bytes, int]]) -> None:
    d = zstandard.ZstdDecompressor()
    for body, n in items:
        d.decompress(body, max_output_size=n)


def copy_split(pool: ThreadPoolExecutor, n: int, src: np.ndarray, dst: np.ndarray | None) -> None:
    out = np.empty_like(src) if dst is None else dst
    k = -(-src.size // n)
    list(pool.map(lambda i: np.copyto(out[i : i + k], src[i : i + k]), range(0, src.size, k)))


def profile(chunks: list) -> None:
    import cProfile
    import pstats

    decode_chunks(chunks)  # warm: the first call allocates what later ones reuse
    pr = cProfile.Profile()
    pr.enable()
    decode_chunks(chunks)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(15)


def main() -> None:
    threads = [int(x) for x in os.environ.get("DIAG_THREADS", "1 2 4 8 16").split()]
    a = argparse.Namespace(tokens=262_144, layers=48, experts=128, topk=8, prompt_len=1024,
                           completion_len=2048, group=8, seed=0,
                           routes=os.environ.get("DIAG_ROUTES", "skewed"))  # fmt: skip
    records, _ = make_records(np.random.default_rng(0), a)
    ids = [f"b{i}" for i in range(len(records))]
    with redis_server() as url:
        store = RouteStore.from_url(url, prefix="scaling", decode_threads=1)
        for i, r in zip(ids, records, strict=True):
            store.put(i, r)
        chunks = [(d, b) for d, b in store.get_raw(ids).chunks.items() if b]
        bodies = []
        for _, b in chunks:
            f = _HEAD.unpack_from(b)
            raw_len, body_len = f[-2], f[-1]
            bodies.append((b[_HEAD.size : _HEAD.size + body_len], raw_len))
        out_mb = sum(n for _, n in bodies) / 1e6
        floor = best(lambda: store.get_raw(ids))
        src = np.ones(103_000_000, np.uint8)
        dst = np.empty_like(src)
        print(f"{len(chunks)} chunks, {out_mb:.0f} MB decoded, {os.cpu_count()} CPUs; "
              f"floor (get_raw) {floor:.4f} s")  # fmt: skip
        if os.environ.get("DIAG_PROFILE"):
            profile(chunks)
        for n in threads:
            with ThreadPoolExecutor(n) as pool:
                zs = split(bodies, n * 4)
                tz = best(lambda zs=zs: list(pool.map(zstd_only, zs)))
                cs = split(chunks, n * 4)
                td = best(lambda cs=cs: list(pool.map(decode_chunks, cs)))
                # The host's copy bandwidth: a step's targets (103 MB) copied into fresh pages
                # and into reused ones, split among the threads as gather_targets splits them.
                tc = best(lambda n=n, pool=pool: copy_split(pool, n, src, None))
                tr = best(lambda n=n, pool=pool: copy_split(pool, n, src, dst))
            s = RouteStore.from_url(url, prefix="scaling", decode_threads=n)
            tg = best(lambda s=s: s.get_many(ids))
            s.close()
            print(f"threads {n:2d}: zstd alone {tz:.4f} s ({out_mb / 1e3 / tz:.2f} GB/s)   "
                  f"chunk decode {td:.4f} s   "
                  f"get_many {tg:.4f} s   copy 103 MB: fresh {tc:.4f} s, reused {tr:.4f} s "
                  f"({src.nbytes / 1e9 / tr:.1f} GB/s)")  # fmt: skip
        store.close()


if __name__ == "__main__":
    main()
