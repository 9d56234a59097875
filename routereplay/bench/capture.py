"""``routereplay bench capture``: what storing routes costs the serving process.

GRPO groups (``--groups`` of ``--group-size`` choices sharing a ``--prompt-tokens`` prompt, each
with ``--completion-tokens`` of its own) of the production router shape (48 MoE layers, top-8 of
128 experts; ``--weights`` adds the routing weights) finish at once, ``--in-flight`` at a time,
and go through the service's capture as the engine hands them over. Measured in the same run,
each on a flushed private redis-server:

- ``floor``: the choices are handed to nothing (what the harness itself costs);
- ``peer``: each choice's array becomes vLLM's inline base64 ``.npy`` (what ``vllm serve
  --enable-return-routed-experts`` spends on it in its API process);
- ``routereplay, threads``: ``--route-workers 0``, the store in threads of the serving process;
- ``routereplay, N processes``: ``--route-workers N`` for each N of ``--workers``.

For each: wall seconds, the serving process's CPU per token (every thread of it: the GIL the
thread that streams tokens needs), the route workers' CPU per token, and the worst and p99 delay
of a 5 ms ticker on the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time
import uuid
from collections.abc import Awaitable, Callable

import numpy as np

__all__ = ["main"]

LAYERS, TOP_K, EXPERTS = 48, 8, 128


def _choices(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    """``(prompt ids, ChoiceFinished)`` per choice: the engine's ``[T - 1, 48, 8]`` arrays."""
    from routereplay.service.engine import ChoiceFinished

    rng = np.random.default_rng(0)
    P, C = a.prompt_tokens, a.completion_tokens

    def rows(n: int) -> np.ndarray:
        return np.argsort(rng.random((n, LAYERS, EXPERTS), dtype=np.float32), axis=2)[
            :, :, :TOP_K
        ].astype(np.uint8)

    out = []
    for g in range(a.groups):
        prompt = rng.integers(0, 151_000, P).tolist()
        shared = rows(P)
        for i in range(a.group_size):
            experts = np.concatenate([shared, rows(C - 1)])
            weights = None
            if a.weights:
                weights = rng.random(experts.shape).astype(np.float32)
            fin = ChoiceFinished(
                index=i, finish_reason="length", stop_reason=None,
                output_token_ids=rng.integers(0, 151_000, C).tolist(), num_cached_tokens=0,
                routed_experts=experts, routed_weights=weights,
                weights_dtype="float32" if a.weights else None,
            )  # fmt: skip
            out.append((f"g{g}", prompt, fin))
    return out


def _proc_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of live processes ``pids`` (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


async def _ticker(stop: asyncio.Event, delays: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.005)
        delays.append(time.perf_counter() - t0 - 0.005)


async def _run(
    choices: list, in_flight: int, handle: Callable[[str, list[int], object], Awaitable[bool]]
) -> tuple[float, float, list[float], int]:
    """(wall s, this process's CPU s, ticker delays, choices handled) of every choice."""
    slots = asyncio.Semaphore(in_flight)
    stop, delays = asyncio.Event(), []
    ticker = asyncio.create_task(_ticker(stop, delays))

    async def one(req: str, prompt: list[int], fin: object) -> bool:
        async with slots:
            return await handle(req, prompt, fin)

    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    ok = await asyncio.gather(*(one(*c) for c in choices))
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter() - t0
    stop.set()
    await ticker
    cpu = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
    return wall, cpu, delays, sum(ok)


async def _routereplay(redis_url: str, processes: int, choices: list, in_flight: int):  # type: ignore[no-untyped-def]
    from routereplay.client import AsyncRouteStore
    from routereplay.service.capture import RouteCapture
    from routereplay.service.metrics import ServiceMetrics
    from routereplay.service.model_info import ModelInfo
    from routereplay.service.route_workers import RouteWorkers
    from routereplay.service.routing_stats import RoutingStats

    info = ModelInfo(name="bench", num_layers=LAYERS, moe_layers=tuple(range(LAYERS)),
                     num_experts=EXPERTS, top_k=TOP_K, max_model_len=1 << 17)  # fmt: skip
    workers = RouteWorkers(processes)
    pids = await asyncio.to_thread(workers.start)
    stats = RoutingStats(info.moe_layers, EXPERTS, TOP_K)
    cap = RouteCapture(info, ServiceMetrics(), workers=workers, stats=stats, max_pending=1 << 16)
    store = AsyncRouteStore.from_url(redis_url, prefix="bench")

    async def handle(req: str, prompt: list[int], fin) -> bool:  # type: ignore[no-untyped-def]
        h = await cap.capture(store, f"{req}-{fin.index}-{uuid.uuid4().hex[:6]}", fin, prompt, req)
        return h.status == "stored"

    try:
        w0 = _proc_cpu_s(pids)
        result = await _run(choices, in_flight, handle)
        return (*result, _proc_cpu_s(pids) - w0)
    finally:
        await workers.aclose()
        await store.close()


async def _peer(choices: list, in_flight: int):  # type: ignore[no-untyped-def]
    from routereplay.service.capture import npy_base64

    async def handle(req: str, prompt: list[int], fin) -> bool:  # type: ignore[no-untyped-def]
        # As the service's inline form does it: a long array's base64 in a thread.
        return bool(await asyncio.to_thread(npy_base64, fin.routed_experts))

    return (*(await _run(choices, in_flight, handle)), 0.0)


async def _floor(choices: list, in_flight: int):  # type: ignore[no-untyped-def]
    async def handle(req: str, prompt: list[int], fin) -> bool:  # type: ignore[no-untyped-def]
        await asyncio.sleep(0)
        return True

    return (*(await _run(choices, in_flight, handle)), 0.0)


def _print(name: str, result: tuple, tokens: int, n: int) -> None:
    wall, cpu, delays, ok, worker_cpu = result
    d = np.asarray(delays or [0.0]) * 1e3
    api, wkr = cpu / tokens * 1e6, worker_cpu / tokens * 1e6
    print(f"{name:28} {ok:>4}/{n:<4} {wall:7.2f} {api:10.1f} {wkr:10.1f} "
          f"{np.percentile(d, 99):8.1f} {d.max():8.1f}")  # fmt: skip


async def _main(a: argparse.Namespace) -> None:
    import redis

    from routereplay.local_redis import redis_server

    choices = _choices(a)
    tokens = sum(len(p) + len(f.output_token_ids) for _, p, f in choices)
    print(f"{len(choices)} choices ({a.groups} groups of {a.group_size}), {a.prompt_tokens} + "
          f"{a.completion_tokens} tokens each, 48 layers x top-8 of 128"
          f"{' + weights' if a.weights else ''}, {a.in_flight} in flight; CPU per token of "
          f"prompt + completion")  # fmt: skip
    print(f"{'server':28} {'stored':>9} {'wall s':>7} {'API us/tok':>10} {'wkr us/tok':>10} "
          f"{'p99 ms':>8} {'max ms':>8}")  # fmt: skip
    with redis_server() as url:
        flush = redis.Redis.from_url(url)
        _print("floor: no routes", await _floor(choices, a.in_flight), tokens, len(choices))
        _print("peer: inline .npy base64", await _peer(choices, a.in_flight), tokens, len(choices))
        for n in [0, *a.workers]:
            flush.flushall()
            name = "routereplay, threads" if n == 0 else f"routereplay, {n} processes"
            result = await _routereplay(url, n, choices, a.in_flight)
            _print(name, result, tokens, len(choices))
        flush.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="routereplay bench capture", description=__doc__)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--completion-tokens", type=int, default=512)
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--weights", action="store_true", help="the routing weights too")
    p.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                   help="route worker process counts to measure (comma-separated)")  # fmt: skip
    asyncio.run(_main(p.parse_args(argv)))
    return 0
