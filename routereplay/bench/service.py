"""``routereplay bench service``: routereplay vs vLLM's own OpenAI server with inline routes.

One invocation, same tiny model, same engine settings: first vLLM's ``api_server
--enable-return-routed-experts`` (routes inline as base64 .npy), then ``routereplay serve`` (the
in-process backend, routes to a private Redis, a handle in the response). Each runs alone on the
machine, with the same prompts and seeds, at each concurrency level (bounded request counts,
loopback, httpx). Printed: p50/p95 latency, throughput, response bytes per request, route bytes
per choice in the response, and the bytes a trainer then fetches for the routes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from routereplay.local_redis import free_port, redis_server

from .servers import server_process

__all__ = ["main"]


@dataclass
class Level:
    server: str
    concurrency: int
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    response_bytes: int = 0
    route_bytes_in_response: int = 0
    completion_tokens: int = 0
    trainer_bytes: int = 0
    route_ids: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.latencies)

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies, q))


def _engine_flags(args: argparse.Namespace) -> list[str]:
    return ["--dtype", "float32", "--max-model-len", str(args.max_model_len), "--seed", "0",
            "--gpu-memory-utilization", "0.5"]  # fmt: skip


async def _run_level(
    name: str, base: str, model: str, prompts: list[list[int]], conc: int, args: argparse.Namespace
) -> Level:
    lv = Level(name, conc)
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:

        async def one(i: int, prompt: list[int]) -> None:
            body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens,
                    "temperature": 1.0, "seed": 1000 + i, "ignore_eos": True}  # fmt: skip
            async with sem:
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json=body)
                lat = time.perf_counter() - t0
            r.raise_for_status()
            data = r.json()
            lv.latencies.append(lat)
            lv.response_bytes += len(r.content)
            lv.completion_tokens += data["usage"]["completion_tokens"]
            for c in data["choices"]:
                re = c.get("routed_experts")
                lv.route_bytes_in_response += len(json.dumps(re)) if re is not None else 0
                if isinstance(re, dict):
                    lv.route_ids.append(re["route_id"])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        lv.wall_s = time.perf_counter() - t0
        if lv.route_ids:
            # What a trainer downloads afterwards: the records, one batch request.
            r = await client.post("/v1/routes:batch", json={"ids": lv.route_ids})
            r.raise_for_status()
            lv.trainer_bytes = len(r.content)
    return lv


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, size=length).tolist() for _ in range(n)]


async def _bench_server(name: str, base: str, model: str, args: argparse.Namespace) -> list[Level]:
    # Warm-up (first-request costs), then one level at a time; fresh prompts per level so the
    # prefix cache favours neither server.
    await _run_level(name, base, model, _prompts(2, args.prompt_tokens, 1), 2, args)
    out = []
    for k, (conc, n) in enumerate(zip(args.concurrency, args.requests, strict=True)):
        out.append(await _run_level(name, base, model, _prompts(n, args.prompt_tokens, 100 + k),
                                    conc, args))  # fmt: skip
    return out


def _ratios(by: dict, a: str, b: str, title: str, note: str) -> list[str]:
    """Rows of ``a``'s latency and throughput over ``b``'s, per concurrency both ran."""
    pairs = [(conc, lv, by[(b, conc)]) for (srv, conc), lv in by.items()
             if srv == a and (b, conc) in by]  # fmt: skip
    if not pairs:
        return []
    rows = ["", f"{title:20s} conc   p50 ratio  p95 ratio  throughput ratio  {note}"]
    for conc, x, y in pairs:
        rows.append(
            f"{'':20s} {conc:5d} {x.pct(50) / y.pct(50):10.3f} {x.pct(95) / y.pct(95):10.3f} "
            f"{(x.n / x.wall_s) / (y.n / y.wall_s):17.3f}"
        )
    return rows


def _report(levels: list[Level]) -> str:
    rows = ["server           conc  reqs   p50_s   p95_s   req/s   tok/s  resp_B/req  "
            "route_B/choice  trainer_B/req"]  # fmt: skip
    for lv in levels:
        trainer = lv.trainer_bytes / lv.n if lv.trainer_bytes else lv.route_bytes_in_response / lv.n
        rows.append(
            f"{lv.server:15s} {lv.concurrency:5d} {lv.n:5d} {lv.pct(50):7.3f} {lv.pct(95):7.3f} "
            f"{lv.n / lv.wall_s:7.2f} {lv.completion_tokens / lv.wall_s:7.1f} "
            f"{lv.response_bytes / lv.n:11.0f} {lv.route_bytes_in_response / lv.n:15.0f} "
            f"{trainer:14.0f}"
        )
    by = {(lv.server, lv.concurrency): lv for lv in levels}
    rows += _ratios(by, "routereplay", "vllm-inline", "routereplay / vllm",
                    "(targets: latency <= 1.05, throughput >= 0.95)")  # fmt: skip
    rows += _ratios(by, "routereplay", "rr-stats-off", "stats on / stats off",
                    "(routing statistics: --routing-stats-window-s 60 against 0)")  # fmt: skip
    rows.append("trainer_B/req: vllm-inline = the base64 routes already in the response; "
                "routereplay = one POST /v1/routes:batch of all the level's route ids")  # fmt: skip
    return "\n".join(rows)


def _bench_routereplay(
    server: str, extra: list[str], model: str, name: str, d: Path, args: argparse.Namespace
) -> list[Level]:
    """``routereplay serve`` (in-process vLLM, routes to a private Redis) with ``extra`` flags."""
    with redis_server() as url:
        port = free_port()
        argv_r = [sys.executable, "-m", "routereplay.cli", "serve", "--model", model,
                  "--served-model-name", name, "--port", str(port), "--redis-url", url,
                  "--log-level", "warning", *_engine_flags(args), *extra]  # fmt: skip
        print(f"starting routereplay serve {' '.join(extra)} (in-process vLLM, routes to Redis)"
              " ...", flush=True)  # fmt: skip
        with server_process(argv_r, f"http://127.0.0.1:{port}/ready", d / f"{server}.log"):
            return asyncio.run(_bench_server(server, f"http://127.0.0.1:{port}", name, args))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="routereplay bench service")
    p.add_argument("--model", help="model path (default: the tiny Qwen3-MoE, built if missing)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 8, 32])  # fmt: skip
    p.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")],
                   default=[8, 32, 64], help="requests per concurrency level")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--only", choices=["vllm", "routereplay"], help="run one server only")
    p.add_argument("--json", type=Path, help="also write raw numbers here")
    p.add_argument(
        "--routing-stats-off-too",
        action="store_true",
        help="also run routereplay with its routing statistics off (rr-stats-off), before the "
        "default run: what the expert-load telemetry costs the capture path",
    )
    args = p.parse_args(argv)
    if len(args.concurrency) != len(args.requests):
        p.error("--concurrency and --requests need the same number of entries")

    model = args.model
    if model is None:
        from routereplay.service.tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model("moe"))
    name = "bench-model"
    levels: list[Level] = []
    with tempfile.TemporaryDirectory(prefix="rr-bench-") as d:
        if args.only != "routereplay":
            port = free_port()
            argv_v = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                      "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
                      "--enable-return-routed-experts", "--enable-prefix-caching",
                      "--enforce-eager", "--disable-uvicorn-access-log",
                      *_engine_flags(args)]  # fmt: skip
            print("starting vLLM's OpenAI server (inline routes) ...", flush=True)
            with server_process(argv_v, f"http://127.0.0.1:{port}/v1/models", Path(d) / "vllm.log"):
                levels += asyncio.run(
                    _bench_server("vllm-inline", f"http://127.0.0.1:{port}", name, args)
                )
        if args.only != "vllm":
            variants = [("routereplay", [])]
            if args.routing_stats_off_too:
                variants.insert(0, ("rr-stats-off", ["--routing-stats-window-s", "0"]))
            for server, extra in variants:
                levels += _bench_routereplay(server, extra, model, name, Path(d), args)
    print(f"\nmodel {model}; prompt {args.prompt_tokens} tokens, completion {args.max_tokens} "
          f"tokens (ignore_eos), float32, enforce-eager, same seeds for both servers")  # fmt: skip
    print(_report(levels))
    if args.json:
        args.json.write_text(json.dumps([
            {"server": lv.server, "concurrency": lv.concurrency, "n": lv.n,
             "p50_s": lv.pct(50), "p95_s": lv.pct(95), "wall_s": lv.wall_s,
             "response_bytes": lv.response_bytes, "trainer_bytes": lv.trainer_bytes,
             "route_bytes_in_response": lv.route_bytes_in_response,
             "median_s": statistics.median(lv.latencies)}
            for lv in levels
        ], indent=1))  # fmt: skip
    return 0
