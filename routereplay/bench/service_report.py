"""The printed report of ``routereplay bench service``: every server's rows in a results folder,
each server's median and spread over its runs, then routereplay's ratios to the floor and to the
peer within each run (the same prompts for every server): their median and the worst run's,
against the targets."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["STATS_OFF", "THREADS", "WEIGHTS", "report"]

# routereplay with one setting changed (bench service's VARIANTS).
# routereplay with one setting changed (bench service's VARIANTS give each one's flags).
STATS_OFF, THREADS, WEIGHTS = "rr-stats-off", "rr-threads", "rr-weights"
_VARIANTS = (STATS_OFF, THREADS, WEIGHTS)
_SERVERS = ("floor", "peer", *_VARIANTS, "routereplay")


def _ms(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x * 1e3:.{digits}f}"


def _routes(r: dict[str, Any]) -> str:
    t = r.get("routes")
    if not t:
        return "-"
    s = f"{t['verified']}/{t['choices']}"
    if t["lost"] or t["wrong"]:
        s += f" lost {t['lost']} wrong {t['wrong']}: {t['first_problem'][:60]}"
    return s


def _cells(c: dict[str, int] | None) -> str:
    return "-" if c is None else f"{c['equal']}/{c['cells']}"


def _redis(r: dict[str, Any]) -> str:
    red = r.get("redis")
    if not red:
        return "-"
    return (f"{red['total_net_input_bytes'] / r['wall_s'] / 1e6:.1f} MB/s "
            f"{red['total_commands_processed'] / r['wall_s']:.0f} cmd/s "
            f"{red.get('cpu_s', 0) / r['wall_s']:.3f} cores "
            f"peak pending <= {r['writes_pending_peak']:.0f}{_store_wait(r)}")  # fmt: skip


def _store_wait(r: dict[str, Any]) -> str:
    w = r.get("store_wait")
    if not w:
        return ""
    out = f"; store wait mean {w['mean_s'] * 1e3:.1f} ms, p99 <= {w['p99_le_s'] * 1e3:g} ms"
    if lag := r.get("loop_lag"):
        out += f"; loop lag max <= {lag['max_le_s'] * 1e3:g} ms"
    if stalls := r.get("loop_stalls"):
        out += f" ({stalls:.0f} stalls logged)"
    if full := r.get("gc_full"):
        out += f"; {full['n']:.0f} full GCs, {full['mean_s'] * 1e3:.0f} ms mean"
    return out


def _engine(r: dict[str, Any]) -> str:
    keys = ("engine_ttft_mean", "engine_queue_mean", "engine_prefill_mean")
    return "/".join(_ms(r.get(k)) for k in keys)


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.0f}"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["server       mode   conc  seqs run   tok/s  e2e p50/p99 ms  TTFT p50/p99 ms  "
           "engine TTFT/queue/prefill ms  TPOT us  held ms  ITL p50/p99 ms  CPU us/tok api/all  "
           "routes ok  vs peer  vs engine  Redis"]  # fmt: skip
    for r in rows:
        out.append(
            f"{r['server']:12s} {r['mode']:6s} {r['concurrency']:4d} {r['sequences']:5d} "
            f"{r.get('run', 1):3d} {r['tok_s']:7.0f} "
            f"{_ms(r['e2e_p50']):>7s}/{_ms(r['e2e_p99']):<7s} "
            f"{_ms(r['ttft_p50']):>8s}/{_ms(r['ttft_p99']):<8s} {_engine(r):^29s} "
            f"{_us(r.get('engine_tpot_mean')):>7s} {_ms(r.get('held_mean'), 1):>8s} "
            f"{_ms(r['itl_p50']):>7s}/{_ms(r['itl_p99']):<7s} "
            f"{r['cpu_api_us_tok']:8.0f}/{r['cpu_all_us_tok']:<8.0f} {_routes(r):>10s} "
            f"{_cells(r.get('vs_peer')):>9s} {_cells(r.get('vs_engine')):>9s}  {_redis(r)}"
            + (f"  engine JIT compiles {r['engine_jit']}" if r.get("engine_jit") else "")
            + (f"  ERRORS {r['errors']}: {r['first_error'][:80]}" if r["errors"] else "")
        )
    return out


# The figures summarised over a server's runs: (key, scale to print, worst is the largest).
# Engine TPOT in microseconds: the servers' engines differ by fractions of a percent.
_FIGURES = (("tok_s", 1, False), ("ttft_p50", 1e3, True), ("ttft_p99", 1e3, True),
            ("engine_ttft_mean", 1e3, True), ("cpu_api_us_tok", 1, True),
            ("engine_tpot_mean", 1e6, True))  # fmt: skip


# Also kept by run, for the time a request's slot is held beyond the engine's.
_HOLD = ("held_mean", "e2e_mean")


def _runs(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[int, float]]]:
    """Each (server, mode, concurrency)'s figures, by run."""
    by: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in rows:
        got = by.setdefault((r["server"], r["mode"], r["concurrency"]), {})
        for key in (*(f[0] for f in _FIGURES), *_HOLD):
            if r.get(key) is not None:
                got.setdefault(key, {})[r.get("run", 1)] = r[key]
    return by


def _spread(by_run: dict[int, float] | None, scale: float) -> str:
    if not by_run:
        return "-"
    xs = list(by_run.values())
    mid = f"{statistics.median(xs) * scale:.0f}"
    return mid if len(xs) == 1 else f"{mid} [{min(xs) * scale:.0f}-{max(xs) * scale:.0f}]"


def _medians(by: dict[tuple, dict[str, dict[int, float]]]) -> list[str]:
    """Each server's median and [lowest-highest] over its runs, where any ran more than once."""
    if all(len(v.get("tok_s", {})) < 2 for v in by.values()):
        return []
    out = ["", "medians [spread]   mode   conc runs  tok/s              TTFT p50 ms        "
           "TTFT p99 ms        engine TTFT ms     API CPU us/tok     engine TPOT us"]  # fmt: skip
    for (srv, mode, conc), v in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        cols = "".join(f"{_spread(v.get(k), sc):19s}" for k, sc, _ in _FIGURES)
        out.append(f"{srv:18s} {mode:6s} {conc:4d} {len(v.get('tok_s', {})):4d}  {cols}")
    return out


def _against(ours: dict[str, dict[int, float]], other: dict[str, dict[int, float]]) -> str:
    """Each figure's ratio within each run (the same prompts for both servers): the median over
    the runs both made, and the worst run's."""
    cols = []
    for key, _, worst_high in _FIGURES:
        mine, theirs = ours.get(key, {}), other.get(key, {})
        per_run = [mine[r] / theirs[r] for r in mine.keys() & theirs.keys() if theirs[r]]
        if not per_run:
            cols.append(f"{'-':>7s} {'-':>7s}")
            continue
        worst = (max if worst_high else min)(per_run)
        cols.append(f"{statistics.median(per_run):7.3f} {worst:7.3f}")
    return "   ".join([*cols, _held_more(ours, other)])


def _held_more(ours: dict[str, dict[int, float]], other: dict[str, dict[int, float]]) -> str:
    """How much longer than ``other`` a request's slot is held beyond the engine, within each
    run (median over runs): in ms, and as a share of the request's time, which is about the
    throughput it costs at a fixed number of sequences in flight."""
    mine, theirs, e2e = ours.get("held_mean", {}), other.get("held_mean", {}), ours.get("e2e_mean")
    runs = [r for r in mine.keys() & theirs.keys() if e2e and e2e.get(r)]
    if not runs:
        return "-"
    more = [mine[r] - theirs[r] for r in runs]
    share = [(mine[r] - theirs[r]) / e2e[r] for r in runs]  # type: ignore[index]
    return f"{statistics.median(more) * 1e3:+.1f} ms ({statistics.median(share):+.2%})"


def _ratios(by: dict[tuple, dict[str, dict[int, float]]]) -> list[str]:
    out = ["", "routereplay over   mode   conc  tok/s (median, worst run)  TTFT p50  "
           "TTFT p99  engine TTFT  API CPU   engine TPOT  held longer   (targets: tok/s >= 1.0 "
           "peer and >= 0.98 floor; TTFT p50 <= 1.05 and p99 <= 1.2 floor; API CPU <= 1.5 "
           "peer)"]  # fmt: skip
    for (srv, mode, conc), v in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if srv != "routereplay":
            continue
        for other in ("floor", "peer", *_VARIANTS):
            if (o := by.get((other, mode, conc))) is not None:
                out.append(f"{other:18s} {mode:6s} {conc:4d}  {_against(v, o)}")
    return out


def report(results: Path, args: dict[str, Any]) -> str:
    """The report of every server's rows found in ``results``."""
    rows = []
    for s in _SERVERS:
        f = results / f"{s}.json"
        if f.exists():
            rows += json.loads(f.read_text())
    by = _runs(rows)
    head = (f"model {args['model'] or 'tiny'}; groups of {args['group_size']}, prompts "
            f"{args['prompt_tokens']} tokens, completions {args['max_tokens']} tokens "
            f"(ignore_eos), {args['dtype']}, the same seeds for every server")  # fmt: skip
    notes = ["CPU us/tok: CPU time of the server's API process / of it and its engine processes, "
             "per generated token; routes ok: read back whole and matching the response (peer: "
             "an array of the model's layout per choice); vs peer / vs engine: (row, layer) cells "
             "with the same experts as the peer's inline routes for the same seeded request / "
             "the engine's own prefill of the stored tokens, over rows computed from the same "
             "tokens; engine TTFT/queue/prefill: vLLM's own means over the level's engine "
             "requests (one per choice), from the engine's arrival of a request; TPOT: vLLM's "
             "mean time per output token of a request's decode; held: the client's mean request "
             "time less vLLM's mean end-to-end time (the server's own time around the engine's: "
             "reading and admitting the request, storing its routes, sending its response); "
             "held longer: routereplay's held less the other server's, and that as a share of "
             "routereplay's mean request time; engine JIT compiles: kernels the engine compiled "
             "while the level ran (its log)"]  # fmt: skip
    return "\n".join([head, *_table(rows), *_medians(by), *_ratios(by), *notes])
