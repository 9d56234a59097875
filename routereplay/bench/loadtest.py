"""``routereplay loadtest``: load a running service and verify every route it stored.

Sends chat and text completions (streamed and not, ``n`` choices) from bounded concurrency over
httpx, for a number of requests or a duration, then fetches every stored route in batches and
checks it against what the response said: the record decodes (each chunk against its content
address), holds ``num_rows`` rows, its token ids are the prompt's and the completion's as
returned (``return_token_ids``), and its valid rows are ``num_valid_rows``. Prints throughput,
latency percentiles, errors by kind and the route tally; exits 1 if any route was lost (said
stored, unreadable) or wrong, or any request answered 5xx.

Only loopback targets unless ``--allow-remote``: a load test is not for other people's servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np

from routereplay.client import AsyncRoutesClient, RouteError, RouteRecord

__all__ = ["LoadReport", "main", "run_load"]

_WORDS = (
    "router expert token layer replay rollout policy gradient reward sample batch prefix "
    "cache shard tensor sequence value advantage group trajectory"
).split()


@dataclass
class SentRoute:
    route_id: str
    handle: dict[str, Any]
    token_ids: list[int]


@dataclass
class LoadReport:
    requests: int = 0
    ok: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    routes_stored: int = 0
    routes_failed: int = 0
    routes_verified: int = 0
    routes_lost: int = 0
    routes_wrong: int = 0
    oversized_sent: int = 0
    oversized_refused: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(n for kind, n in self.errors.items() if kind.startswith("http_5"))

    @property
    def passed(self) -> bool:
        return not (self.routes_lost or self.routes_wrong or self.server_errors)

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if self.latencies else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "ok": self.ok, "wall_s": round(self.wall_s, 3),
            "req_per_s": round(self.ok / self.wall_s, 2) if self.wall_s else 0.0,
            "tok_per_s": round(self.completion_tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "latency_s": {f"p{q}": round(self.pct(q), 4) for q in (50, 90, 95, 99)}
            | {"max": round(max(self.latencies, default=float("nan")), 4)},
            "errors": dict(self.errors),
            "oversized": {"sent": self.oversized_sent, "refused_413": self.oversized_refused},
            "routes": {"stored": self.routes_stored, "failed": self.routes_failed,
                       "verified": self.routes_verified, "lost": self.routes_lost,
                       "wrong": self.routes_wrong},
            "passed": self.passed,
        }  # fmt: skip


def _body(rng: random.Random, model: str, args: argparse.Namespace, i: int) -> tuple[str, dict]:
    words = " ".join(rng.choice(_WORDS) for _ in range(args.prompt_words))
    common = {
        "model": model, "max_tokens": args.max_tokens, "n": args.n, "seed": i,
        "temperature": 1.0, "return_token_ids": True, "stream": rng.random() < args.stream_share,
    }  # fmt: skip
    if common["stream"]:
        common["stream_options"] = {"include_usage": True}
    if i % 2:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}
    return "/v1/completions", {**common, "prompt": words}


def _parse(resp: httpx.Response, stream: bool) -> tuple[list[SentRoute], int]:
    """The routes a response reports (handle + tokens per choice) and its completion tokens."""
    if not stream:
        body = resp.json()
        prompt = body.get("prompt_token_ids")
        out = []
        for c in body["choices"]:
            p = prompt if prompt is not None else c["prompt_token_ids"]
            h = c["routed_experts"]
            out.append(SentRoute(h["route_id"], h, list(p) + list(c["token_ids"])))
        return out, int(body["usage"]["completion_tokens"])
    prompt: dict[int, list[int]] = {}
    toks: dict[int, list[int]] = {}
    handles: dict[int, dict] = {}
    usage = 0
    for line in resp.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"error event: {chunk['error'].get('code')}")
        if chunk.get("usage") and not chunk.get("choices"):
            usage = int(chunk["usage"]["completion_tokens"])
        top_prompt = chunk.get("prompt_token_ids")
        for c in chunk.get("choices") or []:
            i = c["index"]
            if top_prompt is not None:
                prompt.setdefault(i, top_prompt)
            if c.get("prompt_token_ids") is not None:
                prompt.setdefault(i, c["prompt_token_ids"])
            toks.setdefault(i, []).extend(c.get("token_ids") or [])
            if c.get("routed_experts") is not None:
                handles[i] = c["routed_experts"]
    out = [SentRoute(h["route_id"], h, prompt[i] + toks[i]) for i, h in sorted(handles.items())]
    return out, usage


def check_route(sent: SentRoute, rec: RouteRecord) -> str | None:
    h = sent.handle
    if rec.num_tokens != h["num_rows"]:
        return f"{sent.route_id}: {rec.num_tokens} rows, the handle said {h['num_rows']}"
    if rec.token_ids.tolist() != sent.token_ids:
        return f"{sent.route_id}: token ids differ from the response's"
    if int(rec.valid.sum()) != h["num_valid_rows"]:
        return f"{sent.route_id}: {int(rec.valid.sum())} valid rows, handle {h['num_valid_rows']}"
    if list(rec.moe_layers) != h["moe_layers"] or rec.top_k != h["top_k"]:
        return f"{sent.route_id}: layout differs from the handle's"
    return None


async def run_load(args: argparse.Namespace) -> LoadReport:
    """Run the load described by ``args`` (see :func:`main`) and verify the routes."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    report = LoadReport()
    sent: list[SentRoute] = []
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.timeout, limits=limits
    ) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        deadline = time.monotonic() + args.duration if args.duration else None
        counter = iter(range(args.requests if args.requests else 1 << 62))

        async def worker() -> None:
            for i in counter:
                if deadline is not None and time.monotonic() > deadline:
                    return
                path, body = _body(rng, model, args, i)
                t0 = time.perf_counter()
                report.requests += 1
                try:
                    resp = await http.post(path, json=body)
                    if resp.status_code != 200:
                        report.errors[f"http_{resp.status_code}"] += 1
                        continue
                    got, tokens = _parse(resp, body["stream"])
                except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
                    report.errors[type(e).__name__] += 1
                    continue
                report.latencies.append(time.perf_counter() - t0)
                report.ok += 1
                report.completion_tokens += tokens
                sent.extend(got)

        done = asyncio.Event()

        async def hostile() -> None:
            # A client that keeps sending bodies far over the service's cap, on its own
            # connection, while the load runs: it must cost the others nothing.
            blob = b'{"model": "x", "prompt": "' + b"x" * (args.oversized_mib << 20) + b'"}'
            async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=60) as h:
                while not done.is_set():
                    report.oversized_sent += 1
                    try:
                        r = await h.post("/v1/completions", content=blob,
                                         headers={"content-type": "application/json"})  # fmt: skip
                        report.oversized_refused += r.status_code == 413
                    except httpx.HTTPError:
                        pass  # the server may close the connection on an unread body
                    await asyncio.sleep(args.oversized_interval)

        async def load() -> None:
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            done.set()

        t0 = time.perf_counter()
        await asyncio.gather(load(), *([hostile()] if args.oversized_mib else []))
        report.wall_s = time.perf_counter() - t0

    stored = [s for s in sent if s.handle["status"] == "stored"]
    report.routes_stored = len(stored)
    report.routes_failed = len(sent) - len(stored)
    async with AsyncRoutesClient(args.url, api_key=args.api_key, timeout=args.timeout) as rc:
        for a in range(0, len(stored), 256):
            part = stored[a : a + 256]
            recs = await rc.get_many([s.route_id for s in part], return_exceptions=True)
            for s, rec in zip(part, recs, strict=True):
                if isinstance(rec, RouteError):
                    report.routes_lost += 1
                    report.problems.append(f"{s.route_id}: {rec}")
                elif (problem := check_route(s, rec)) is not None:
                    report.routes_wrong += 1
                    report.problems.append(problem)
                else:
                    report.routes_verified += 1
    return report


def _loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="routereplay loadtest",
        description="Load a running routereplay service and verify every route it stored.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service")
    p.add_argument("--api-key", help="bearer key, if the service has keys")
    p.add_argument("--model", help="default: the first of /v1/models")
    p.add_argument("--requests", type=int, default=200, help="how many requests (0: no limit)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--n", type=int, default=1, help="choices per request")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--stream-share", type=float, default=0.5, help="share of streamed requests")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--oversized-mib",
        type=int,
        default=0,
        help="meanwhile send bodies of this many MiB (they must be refused, 413)",
    )
    p.add_argument(
        "--oversized-interval", type=float, default=0.2, help="seconds between oversized bodies"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url")
    args = p.parse_args(argv)
    if not args.requests and not args.duration:
        p.error("give --requests or --duration (or both)")
    if not _loopback(args.url) and not args.allow_remote:
        p.error(f"{args.url} is not a loopback address (pass --allow-remote if it is yours)")
    report = asyncio.run(run_load(args))
    d = report.as_dict()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        lat = d["latency_s"]
        print(f"requests {d['requests']}  ok {d['ok']}  in {d['wall_s']} s: "
              f"{d['req_per_s']} req/s, {d['tok_per_s']} completion tok/s")  # fmt: skip
        print("latency s  " + "  ".join(f"{k} {v}" for k, v in lat.items()))
        print(f"errors     {d['errors'] or 'none'}")
        if args.oversized_mib:
            o = d["oversized"]
            print(f"oversized  {o['sent']} bodies of {args.oversized_mib} MiB, "
                  f"{o['refused_413']} refused with 413")  # fmt: skip
        r = d["routes"]
        print(f"routes     stored {r['stored']}  failed {r['failed']}  verified {r['verified']}  "
              f"lost {r['lost']}  wrong {r['wrong']}")  # fmt: skip
        for problem in report.problems[:20]:
            print(f"  {problem}")
        print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
