"""``routereplay bench service``: serving cost of route capture, against vLLM's own server.

Three servers, one at a time, with the same model, engine settings, prompts and seeds:

- ``floor``: vLLM's OpenAI server with no routes (what serving costs without capture);
- ``peer``: the same server with ``--enable-return-routed-experts`` (routes inline, base64 of an
  ``.npy`` per choice: what RL frameworks wire by hand today);
- ``routereplay``: ``routereplay serve`` (vLLM in process, routes compressed into a private
  redis-server, a handle in the response).

The load is GRPO groups (:mod:`.serving_load`) at each concurrency level: first non-streamed
(how rollouts are sent), then streamed for TTFT and ITL (``--stream also``; vLLM's server
returns no routes in a stream, so the peer's streamed pass times its engine-side capture and
checks no routes). Per level:
output tokens/s, end-to-end latency, TTFT, ITL, the server's CPU per generated token (the API
process, and with its engine processes), vLLM's own means of its requests' time to the first
token, in its queue and in prefill (every server logs vLLM's stats), and for routereplay its
Redis traffic, the largest write backlog, and every route read back and checked
(:mod:`.serving_probe`). Where the peer ran in the same results folder, routereplay's records are
compared row by row with the peer's inline routes for the same seeded requests (the rows both
computed from the same tokens), and a sample with the engine's own prefill of the stored tokens.

``--py-spy DIR`` samples the server's processes with py-spy during each level
(:mod:`.pyspy`) and prints each one's main-thread frames that hold the most samples: where
an engine step's time goes; ``--py-spy-seconds S`` samples only each level's first ``S``
seconds, the window in which its first tokens are sent.

``--runs K`` starts each server once and passes over its levels K times, each run with its own
seeded prompts (the same for every server, none served from an earlier run's prefix cache); the
report gives each server's median and spread per level, and routereplay's ratios by median and by
its worst run. With ``--runs``, ``--py-spy`` samples only the last run.

Servers can run in separate invocations that share ``--results`` (a GPU host whose calls are
short): each adds its rows, and the report covers every server found there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from routereplay.local_redis import free_port, redis_server

from . import pyspy
from . import serving_probe as probe
from .servers import server_process
from .service_report import STATS_OFF, THREADS, WEIGHTS, report
from .serving_load import Choice, LevelLoad, make_groups, run_level

__all__ = ["main"]

SERVERS = ("floor", "peer", "routereplay")
# What each choice's response waits for its route to be stored (routereplay's /metrics).
_STORE_SECONDS = "routereplay_route_store_seconds"
# Read before and after each level of routereplay's servers: (row key, histogram, series).
_STALLS = (("store_wait", _STORE_SECONDS, ""),
           ("loop_lag", "routereplay_event_loop_lag_seconds", ""),
           ("gc_full", "routereplay_gc_pause_seconds", 'generation="2"'))  # fmt: skip
# Every backlog a record met: a level's largest is the top bucket its records reached.
_BACKLOG = "routereplay_route_write_backlog"
# Stalls of the server's event loop, each logged with its stack (--loop-stall-log-ms).
_STALLS_TOTAL = "routereplay_event_loop_stalls_total"
# What vLLM logs for each kernel its engine compiles while serving (every one with
# jit_monitor_verbose, which the engine settings turn on where the installed vLLM has it).
_JIT_LINE = b"JIT compilation during inference"
# vLLM's own per-request timings, read from every server (each logs vLLM's stats): from the
# engine's arrival of a request to its first token, in its queue, in its prefill and to its
# finish, and the time per output token of its decode.
_ENGINE = (("engine_ttft_mean", "vllm:time_to_first_token_seconds"),
           ("engine_queue_mean", "vllm:request_queue_time_seconds"),
           ("engine_prefill_mean", "vllm:request_prefill_time_seconds"),
           ("engine_e2e_mean", "vllm:e2e_request_latency_seconds"),
           ("engine_tpot_mean", "vllm:request_time_per_output_token_seconds"))  # fmt: skip
# Also on request, routereplay with one setting changed: its expert-load telemetry off (what
# that telemetry costs), its routes stored in threads of the serving process (what the route
# worker processes take off its GIL), every route stored with its routing weights (what they
# cost against ids only).
VARIANTS = {STATS_OFF: ["--routing-stats-window-s", "0"], THREADS: ["--route-workers", "0"],
            WEIGHTS: ["--route-weights", "on"]}  # fmt: skip


def _engine_config(args: argparse.Namespace) -> dict[str, Any]:
    """Engine settings both servers get: batch limits set explicitly, since vLLM's defaults for
    them differ between its OpenAI server and an engine built in another process."""
    from routereplay.service.engines.vllm_host import on_cpu_host

    eager = on_cpu_host() if args.enforce_eager is None else args.enforce_eager
    return {"dtype": args.dtype, "max_model_len": args.max_model_len, "seed": 0,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "enforce_eager": eager,
            "enable_prefix_caching": True, **_jit_log(),
            **json.loads(args.engine_args or "{}")}  # fmt: skip


def _jit_log() -> dict[str, bool]:
    """Every kernel compile the engine logs, not only the first (each row counts them): where
    the installed vLLM has the setting."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    return {"jit_monitor_verbose": True} if "jit_monitor_verbose" in known else {}


def _vllm_argv(cfg: dict[str, Any], model: str, port: int, peer: bool) -> list[str]:
    # vLLM's stat logging stays on, as ``vllm serve`` runs by default and as routereplay's
    # engine runs (its /metrics serves vLLM's metrics): every server pays for it.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "bench-model", "--host", "127.0.0.1", "--port", str(port),
            "--disable-uvicorn-access-log"]  # fmt: skip
    if peer:
        argv.append("--enable-return-routed-experts")
    for k, v in cfg.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv += [flag] if v else []  # every such setting is off by default
        else:
            argv += [flag, json.dumps(v) if isinstance(v, dict) else str(v)]
    return argv


def _rr_argv(cfg: dict[str, Any], model: str, port: int, redis_url: str) -> list[str]:
    # enable_prefix_caching: the service sets it itself.
    own = {"dtype", "max_model_len", "seed", "gpu_memory_utilization", "enforce_eager",
           "enable_prefix_caching"}  # fmt: skip
    rest = {k: v for k, v in cfg.items() if k not in own}
    return [sys.executable, "-m", "routereplay.cli", "serve", "--model", model,
            "--served-model-name", "bench-model", "--port", str(port), "--redis-url", redis_url,
            "--log-level", "warning", "--dtype", cfg["dtype"],
            "--max-model-len", str(cfg["max_model_len"]), "--seed", str(cfg["seed"]),
            "--gpu-memory-utilization", str(cfg["gpu_memory_utilization"]),
            "--enforce-eager" if cfg["enforce_eager"] else "--no-enforce-eager",
            "--engine-args", json.dumps(rest)]  # fmt: skip


class _Bench:
    """One server's run: its levels, measured and checked."""

    def __init__(self, server: str, args: argparse.Namespace, model: str, proc_pid: int,
                 base: str, redis_url: str | None, log: Path) -> None:  # fmt: skip
        self.server, self.args, self.model, self.pid = server, args, model, proc_pid
        self.base, self.redis_url, self.log = base, redis_url, log
        self.layers, self.top_k = args.layout
        self.peer_path = args.results / "peer-routes.npz"

    def groups(self, conc: int, seqs: int, k: int, run: int) -> list:
        # Each run its own prompts (the same for every server), so that no run is served from
        # the prefix cache an earlier run filled.
        n = min(self.args.group_size, conc)
        return make_groups(max(1, seqs // n), n, self.args.prompt_tokens, self.args.max_tokens,
                           self.args.vocab, seed=10 + k + 100 * (run - 1))  # fmt: skip

    def warm_up(self) -> None:
        """A burst at each level's concurrency with short completions, not measured: the engine
        compiles kernels for the batch shapes it first meets (Triton's fused MoE JIT among
        them), which would otherwise land in the first level's timings."""
        for conc in sorted(set(self.args.concurrency)):
            n = min(self.args.group_size, conc)
            groups = make_groups(max(1, conc // n), n, self.args.prompt_tokens, "8",
                                 self.args.vocab, seed=99 + conc)  # fmt: skip
            asyncio.run(run_level(self.base, "bench-model", groups, conc, False))

    def level(self, mode: str, k: int, conc: int, seqs: int, run: int) -> dict[str, Any]:
        groups = self.groups(conc, seqs, k, run)
        url = f"{self.base}/metrics"
        cpu0 = probe.group_cpu_s(self.pid)
        red0 = probe.redis_counters(self.redis_url) if self.redis_url else None
        page0 = probe.metrics_page(url)
        log0 = self.log.stat().st_size
        with self.profiled(f"{self.server}-{mode}-c{conc}", run):
            lv = asyncio.run(run_level(self.base, "bench-model", groups, conc, mode == "stream"))
        cpu1 = probe.group_cpu_s(self.pid)
        page1 = probe.metrics_page(url)
        row = {**_timings(self.server, mode, lv, cpu0, cpu1), "run": run}
        row.update(_engine_means(page0, page1))
        row["held_mean"] = _held(row)
        row["engine_jit"] = _log_count(self.log, log0, _JIT_LINE)
        row["writes_pending_peak"] = None
        if red0 is not None:
            red1 = probe.redis_counters(self.redis_url)
            row["redis"] = {k: red1[k] - red0[k] for k in red0}
            for key, name, sel in _STALLS:
                row[key] = _between(url, name, sel, page0, page1)
            stalls = [probe.gauge(url, _STALLS_TOTAL, page) or 0 for page in (page0, page1)]
            row["loop_stalls"] = stalls[1] - stalls[0]
            backlog = _between(url, _BACKLOG, "", page0, page1)
            row["writes_pending_peak"] = backlog["max_le_s"] if backlog else 0.0
        row.update(self.routes(mode, conc, run, lv))
        return row

    def startup_heap(self) -> str:
        """What the server froze at start, and the full collection before it: the walk each
        full collection would take without the freeze."""
        url = f"{self.base}/metrics"
        page = probe.metrics_page(url)
        full = probe.histogram(url, "routereplay_gc_pause_seconds", 'generation="2"', page)
        frozen = probe.gauge(url, "routereplay_gc_frozen_objects", page)
        return (
            f"{self.server}: start-up heap of {frozen or 0:.0f} objects frozen; the full "
            f"collection before it took {full.get('sum', 0) * 1e3:.0f} ms"
        )

    @contextlib.contextmanager
    def profiled(self, tag: str, run: int) -> Iterator[None]:
        """With ``--py-spy DIR``: every server process sampled while the level runs (in the
        last of ``--runs``, so that the others run unsampled), and each one's main-thread frames
        with the most samples printed after it."""
        if self.args.py_spy is None or run != self.args.runs:
            yield
            return
        pids, secs = probe.group_pids(self.pid), self.args.py_spy_seconds
        with pyspy.recording(pids, self.args.py_spy, tag, seconds=secs) as files:
            yield
        for f in files:
            if f.exists():
                top = ", ".join(f"{share:.0%} {frame}" for frame, share in pyspy.top_frames(f, 6))
                print(f"py-spy {f.name}: {top}", flush=True)

    def routes(self, mode: str, conc: int, run: int, lv: LevelLoad) -> dict[str, Any]:
        if self.server == "floor" or (self.server == "peer" and mode == "stream"):
            return {}  # vLLM's server returns no routes in a stream
        keep = {(c.group, c.index) for c in lv.choices[: self.args.compare]}
        if self.server == "peer":
            tally = probe.check_inline(lv.choices, self.layers, self.top_k)
            _save_peer(
                self.peer_path,
                f"{mode}-{conc}-r{run}",
                [c for c in lv.choices if (c.group, c.index) in keep],
            )
            return {"routes": vars(tally)}
        tally, kept = probe.check_handles(lv.choices, self.redis_url, self.layers, self.top_k, keep)
        out: dict[str, Any] = {"routes": vars(tally)}
        if mode == "json":
            out["vs_peer"] = _compare_peer(self.peer_path, f"{mode}-{conc}-r{run}", kept)
            out["vs_engine"] = asyncio.run(self.engine_ref(lv.choices, kept))
        return out

    async def engine_ref(self, choices: list[Choice], kept: dict) -> dict[str, int]:
        """The engine's own prefill of ``--engine-ref`` stored sequences, row by row."""
        import httpx

        from routereplay.client import RouteStore

        same = cells = 0
        picked = [c for c in choices if (c.group, c.index) in kept][: self.args.engine_ref]
        async with httpx.AsyncClient(base_url=self.base, timeout=600) as http:
            for c in picked:
                body = {"model": "bench-model", "prompt": c.prompt_ids + c.token_ids,
                        "max_tokens": 1, "temperature": 0.0}  # fmt: skip
                r = (await http.post("/v1/completions", json=body)).json()
                cached = (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                with RouteStore.from_url(self.redis_url) as store:
                    ref = store.get(r["choices"][0]["routed_experts"]["route_id"])
                a, b = probe.compare_rows(kept[(c.group, c.index)], ref.experts,
                                          ref.token_ids.tolist(), int(cached))  # fmt: skip
                same, cells = same + a, cells + b
        return {"sequences": len(picked), "cells": cells, "equal": same}


def _between(url: str, name: str, sel: str, page0: str, page1: str) -> dict[str, float]:
    """What histogram ``name`` (series ``sel``) observed between two /metrics pages."""
    a, b = (probe.histogram(url, name, sel, page) for page in (page0, page1))
    return probe.histogram_summary(a, b)


def _log_count(log: Path, start: int, needle: bytes) -> int:
    """Lines of ``log`` from byte ``start`` on that hold ``needle``."""
    with open(log, "rb") as f:
        f.seek(start)
        return sum(needle in line for line in f)


def _engine_means(page0: str, page1: str) -> dict[str, float | None]:
    """The mean of each of :data:`_ENGINE` over the engine requests of a level (an ``n``-choice
    request is ``n`` of them), in seconds; None where the server exports no such histogram."""
    out: dict[str, float | None] = {}
    for key, name in _ENGINE:
        a, b = (probe.histogram_total(name, page) for page in (page0, page1))
        n = b["count"] - a["count"]
        out[key] = (b["sum"] - a["sum"]) / n if n > 0 else None
    return out


def _held(row: dict[str, Any]) -> float | None:
    """How much longer a request took at the client than in the engine, on average: the
    server's own time around the engine's (the request's reading and admission, its routes'
    store, its response), for which a sequence's slot is held while the engine has none of it."""
    if row["e2e_mean"] is None or row.get("engine_e2e_mean") is None:
        return None
    return row["e2e_mean"] - row["engine_e2e_mean"]


def _timings(server: str, mode: str, lv: LevelLoad, cpu0: tuple, cpu1: tuple) -> dict[str, Any]:
    import numpy as np

    def pct(xs: list[float], q: float) -> float | None:
        return float(np.percentile(xs, q)) if xs else None

    toks = max(lv.completion_tokens, 1)
    return {"server": server, "mode": mode, "concurrency": lv.concurrency,
            "requests": len(lv.latencies), "sequences": len(lv.choices), "wall_s": lv.wall_s,
            "completion_tokens": lv.completion_tokens, "tok_s": lv.completion_tokens / lv.wall_s,
            "e2e_p50": pct(lv.latencies, 50), "e2e_p99": pct(lv.latencies, 99),
            "e2e_mean": float(np.mean(lv.latencies)) if lv.latencies else None,
            "ttft_p50": pct(lv.ttft, 50), "ttft_p99": pct(lv.ttft, 99),
            "itl_p50": pct(lv.itl, 50), "itl_p99": pct(lv.itl, 99),
            "cpu_api_us_tok": (cpu1[0] - cpu0[0]) / toks * 1e6,
            "cpu_all_us_tok": (cpu1[1] - cpu0[1]) / toks * 1e6,
            "response_bytes": lv.response_bytes, "errors": len(lv.errors),
            "first_error": lv.errors[0] if lv.errors else ""}  # fmt: skip


def _save_peer(path: Path, level: str, choices: list[Choice]) -> None:
    import numpy as np

    old = dict(np.load(path)) if path.exists() else {}
    for c in choices:
        key = f"{level}-{c.group}-{c.index}"
        old[key + "-routes"] = probe.inline_array(c.route) if isinstance(c.route, str) else None
        old[key + "-tokens"] = np.asarray(c.prompt_ids + c.token_ids, dtype=np.int64)
    np.savez(path, **{k: v for k, v in old.items() if v is not None})


def _compare_peer(path: Path, level: str, kept: dict) -> dict[str, int] | None:
    import numpy as np

    if not path.exists():
        return None
    peer = np.load(path)
    same = cells = seqs = 0
    for (g, i), rec in kept.items():
        key = f"{level}-{g}-{i}"
        if key + "-routes" not in peer:
            continue
        a, b = probe.compare_rows(rec, peer[key + "-routes"], peer[key + "-tokens"].tolist(), 0)
        same, cells, seqs = same + a, cells + b, seqs + 1
    return {"sequences": seqs, "cells": cells, "equal": same}


def _levels(args: argparse.Namespace) -> list[tuple[str, int, int, int, int]]:
    """(mode, level index, concurrency, sequences, run) in the order they run: every run
    passes over all the levels, rollouts before streamed."""
    modes = {"off": ["json"], "also": ["json", "stream"], "only": ["stream"]}[args.stream]
    pairs = list(enumerate(zip(args.concurrency, args.sequences, strict=True)))
    runs = range(1, args.runs + 1)
    return [(m, k, c, s, r) for r in runs for m in modes for k, (c, s) in pairs]


def _run_server(server: str, args: argparse.Namespace, model: str, logs: Path) -> list[dict]:
    cfg = _engine_config(args)
    ours = server == "routereplay" or server in VARIANTS
    private = redis_server() if ours else contextlib.nullcontext(None)
    with private as url:
        port = free_port()
        argv = (_rr_argv(cfg, model, port, url) if ours
                else _vllm_argv(cfg, model, port, server == "peer"))  # fmt: skip
        argv += VARIANTS.get(server, [])
        base = f"http://127.0.0.1:{port}"
        ready = base + ("/ready" if ours else "/v1/models")
        print(f"starting {server} ...", flush=True)
        log = logs / f"{server}.log"
        with server_process(argv, ready, log, timeout_s=args.start_timeout_s) as p:
            b = _Bench(server, args, model, p.pid, base, url, log)
            if ours:
                print(b.startup_heap(), flush=True)
            b.warm_up()
            rows = []
            for mode, k, conc, seqs, run in _levels(args):
                rows.append(b.level(mode, k, conc, seqs, run))
                print(json.dumps(rows[-1]), flush=True)
            return rows


def _parser() -> argparse.ArgumentParser:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(
        prog="routereplay bench service", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", help="model path (default: the tiny Qwen3-MoE, built if missing)")
    also = ", ".join(VARIANTS)
    p.add_argument("--servers", default=",".join(SERVERS),
                   help=f"which, in order (default: all three; also {also})")  # fmt: skip
    p.add_argument("--concurrency", type=ints, default=[1, 8, 32], help="sequences in flight")
    p.add_argument("--sequences", type=ints, default=[4, 32, 64], help="sequences per level")
    p.add_argument("--group-size", type=int, default=1, help="n: choices per request (GRPO: 8)")
    p.add_argument("--prompt-tokens", default="64", help="a length or a span lo-hi")
    p.add_argument("--max-tokens", default="32", help="a length or a span lo-hi (ignore_eos)")
    p.add_argument("--stream", choices=["off", "also", "only"], default="also")
    p.add_argument("--runs", type=int, default=1,
                   help="passes over the levels per server start, each with its own prompts; "
                        "the report gives each server's median and spread")  # fmt: skip
    p.add_argument("--vocab", type=int, help="prompt ids below this (default: the tokenizer's)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on a CPU host only")  # fmt: skip
    p.add_argument(
        "--engine-args", help='more engine settings, JSON (e.g. {"load_format": "dummy"})'
    )
    p.add_argument(
        "--compare", type=int, default=8, help="sequences per level compared with the peer"
    )
    p.add_argument("--engine-ref", type=int, default=2, help="of those, re-run as a prefill")
    p.add_argument("--start-timeout-s", type=float, default=900)
    p.add_argument(
        "--results", type=Path, help="folder the rows accumulate in (default: temporary)"
    )
    p.add_argument("--py-spy", type=Path, metavar="DIR",
                   help="sample the server's processes with py-spy during each level; raw "
                        "collapsed stacks go to DIR")  # fmt: skip
    p.add_argument(
        "--py-spy-seconds",
        type=int,
        metavar="S",
        help="with --py-spy: only each level's first S seconds (its first tokens)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if len(args.concurrency) != len(args.sequences):
        p.error("--concurrency and --sequences need the same number of entries")
    if args.runs < 1:
        p.error("--runs needs at least 1")
    if args.py_spy is not None and pyspy.executable() is None:
        p.error("--py-spy needs the py-spy executable (pip install py-spy)")
    servers = args.servers.split(",")
    if set(servers) - {*SERVERS, *VARIANTS}:
        p.error(f"--servers: choose among {', '.join([*SERVERS, *VARIANTS])}")
    model = args.model
    if model is None:
        from routereplay.service.tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model("moe"))
    from routereplay.service.model_info import moe_layout

    cfg = json.loads((Path(model) / "config.json").read_text())
    _, moe, _, top_k = moe_layout(cfg)
    args.layout = (len(moe), top_k)
    if args.vocab is None:
        from transformers import AutoTokenizer

        args.vocab = min(len(AutoTokenizer.from_pretrained(model)), int(cfg["vocab_size"]))
    with tempfile.TemporaryDirectory(prefix="rr-bench-") as d:
        args.results = args.results or Path(d)
        args.results.mkdir(parents=True, exist_ok=True)
        for server in servers:
            rows = _run_server(server, args, model, args.results)
            (args.results / f"{server}.json").write_text(json.dumps(rows, indent=1))
        print(report(args.results, vars(args)))
    return 0
