"""What ``routereplay bench service`` measures beside the client's timings: the server's CPU,
its Redis traffic, its /metrics histograms, and whether every route is there and right."""

from __future__ import annotations

import base64
import contextlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np

from routereplay.client import RouteError, RouteRecord, RouteStore

from .loadtest import SentRoute, check_route
from .serving_load import Choice

__all__ = ["RouteTally", "check_handles", "check_inline", "compare_rows", "gauge",
           "group_cpu_s", "group_pids", "histogram", "histogram_summary", "histogram_total",
           "inline_array", "metrics_page", "redis_counters"]  # fmt: skip

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of(pid: int) -> tuple[int, float]:
    """(process group id, user + system CPU seconds) of ``pid``, from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[2]), (int(fields[11]) + int(fields[12])) / _TICK


def _group(leader: int) -> Iterator[tuple[int, float]]:
    """(pid, CPU seconds) of each live process of ``leader``'s process group (the server and
    the engine processes it started), from one read of each /proc/PID/stat; Linux only."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                pgid, cpu = _cpu_of(int(name))
                if pgid == leader:
                    yield int(name), cpu


def group_pids(leader: int) -> list[int]:
    """The live processes of ``leader``'s process group."""
    return [pid for pid, _ in _group(leader)]


def group_cpu_s(leader: int) -> tuple[float, float]:
    """CPU seconds of ``leader`` alone and of every live process in its process group."""
    own = total = 0.0
    for pid, cpu in _group(leader):
        total += cpu
        own += cpu if pid == leader else 0.0
    return own, total


def redis_counters(url: str) -> dict[str, float]:
    """The Redis counters a level's traffic is the difference of."""
    import redis

    with contextlib.closing(redis.Redis.from_url(url)) as r:
        info = r.info()
    keys = ("total_net_input_bytes", "total_commands_processed", "used_memory")
    out = {k: float(info[k]) for k in keys}
    out["cpu_s"] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return out


def metrics_page(metrics_url: str) -> str:
    """A Prometheus endpoint's text, read once; empty if it does not answer."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(metrics_url, timeout=10).text
    return ""


def gauge(metrics_url: str, name: str, page: str | None = None) -> float | None:
    """A Prometheus gauge without labels (from ``page`` when given, else read once); None if
    the endpoint does not export it."""
    for line in (metrics_page(metrics_url) if page is None else page).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def histogram(
    metrics_url: str, name: str, labels: str = "", page: str | None = None
) -> dict[str, float]:
    """A Prometheus histogram (from ``page`` when given, else read once): ``sum``, ``count``
    and each bucket's cumulative count keyed ``le=<bound>``; ``labels`` picks one series
    (``'generation="2"'``). Empty if the endpoint does not export it."""
    sel = "{" + labels + "}" if labels else ""
    bucket = name + "_bucket{" + (labels + "," if labels else "") + 'le="'
    out: dict[str, float] = {}
    for line in (metrics_page(metrics_url) if page is None else page).splitlines():
        if line.startswith(name + "_sum" + sel + " "):
            out["sum"] = float(line.split()[1])
        elif line.startswith(name + "_count" + sel + " "):
            out["count"] = float(line.split()[1])
        elif line.startswith(bucket):
            le = line[len(bucket) :].split('"')[0]
            out["le=" + le] = float(line.rsplit(" ", 1)[1])
    return out


def histogram_total(name: str, page: str) -> dict[str, float]:
    """``sum`` and ``count`` of a histogram over all of its series (vLLM labels its own by
    model and engine) in a /metrics page; 0 where the page has none."""
    out = {"sum": 0.0, "count": 0.0}
    for line in page.splitlines():
        for key in out:
            head = f"{name}_{key}"
            if line.startswith(head) and line[len(head) : len(head) + 1] in ("{", " "):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def histogram_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean, p99 and maximum (the upper bounds of the buckets they fall in) of the observations
    between two reads of one histogram."""
    n = after.get("count", 0.0) - before.get("count", 0.0)
    if n <= 0:
        return {}
    bounds = sorted((k for k in after if k.startswith("le=")), key=lambda k: float(k[3:]))
    p99 = top = float("inf")
    for key in bounds:
        if after[key] - before.get(key, 0.0) >= 0.99 * n and p99 == float("inf"):
            p99 = float(key[3:])
        if after[key] - before.get(key, 0.0) >= n:
            top = float(key[3:])
            break
    mean = (after["sum"] - before.get("sum", 0.0)) / n
    return {"n": n, "mean_s": mean, "p99_le_s": p99, "max_le_s": top}


@dataclass
class RouteTally:
    """Routes of one level: said stored (or returned), read back and checked."""

    choices: int = 0
    present: int = 0
    verified: int = 0
    lost: int = 0
    wrong: int = 0
    first_problem: str = ""

    def bad(self, what: str, lost: bool) -> None:
        if lost:
            self.lost += 1
        else:
            self.wrong += 1
        self.first_problem = self.first_problem or what


def inline_array(b64: str) -> np.ndarray:
    """vLLM's inline routes: base64 of an ``.npy`` of (rows, MoE layers, top-k) expert ids."""
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def check_inline(choices: list[Choice], layers: int, top_k: int) -> RouteTally:
    """The peer's routes: one array per choice, of the layout the model has."""
    t = RouteTally(choices=len(choices))
    for c in choices:
        if not isinstance(c.route, str):
            t.bad(f"group {c.group} choice {c.index}: no routes in the response", True)
            continue
        t.present += 1
        a = inline_array(c.route)
        rows = len(c.prompt_ids) + len(c.token_ids) - 1
        if a.shape != (rows, layers, top_k):
            t.bad(f"group {c.group} choice {c.index}: shape {a.shape}, expected "
                  f"{(rows, layers, top_k)}", False)  # fmt: skip
            continue
        t.verified += 1
    return t


def _wrong(c: Choice, rec: RouteRecord, layers: int, top_k: int) -> str | None:
    """What is wrong with ``c``'s record against its response (``loadtest``'s check: rows,
    token ids, valid rows and layout as the handle says), then against the model's layout;
    named by route id."""
    rid = c.route["route_id"]
    why = check_route(SentRoute(rid, c.route, c.prompt_ids + c.token_ids), rec)
    if why is None and (len(rec.moe_layers) != layers or rec.top_k != top_k):
        why = f"{rid}: layout {len(rec.moe_layers)} x top-{rec.top_k}, expected {layers} x {top_k}"
    return why


def check_handles(
    choices: list[Choice], redis_url: str, layers: int, top_k: int, keep: set[tuple[int, int]]
) -> tuple[RouteTally, dict[tuple[int, int], RouteRecord]]:
    """routereplay's routes: every handle says stored, and every record reads back whole
    (each chunk against its content address) and matches the response; the records of the
    choices in ``keep`` (group, index) are returned for comparison."""
    t = RouteTally(choices=len(choices))
    kept: dict[tuple[int, int], RouteRecord] = {}
    stored = []
    for c in choices:
        if isinstance(c.route, dict) and c.route.get("status") == "stored":
            stored.append(c)
        else:
            t.bad(f"group {c.group} choice {c.index}: handle {c.route!r:.200}", True)
    t.present = len(stored)
    with RouteStore.from_url(redis_url) as store:
        for lo in range(0, len(stored), 64):
            part = stored[lo : lo + 64]
            try:
                recs = store.get_many([c.route["route_id"] for c in part])
            except RouteError as e:
                for c in part:
                    t.bad(f"{c.route['route_id']}: {e}", True)
                continue
            for c, rec in zip(part, recs, strict=True):
                why = _wrong(c, rec, layers, top_k)
                if why:
                    t.bad(why, False)
                    continue
                t.verified += 1
                if (c.group, c.index) in keep:
                    kept[(c.group, c.index)] = rec
    return t, kept


def compare_rows(
    ours: RouteRecord, ref: np.ndarray, ref_tokens: list[int], start: int
) -> tuple[int, int]:
    """(cells equal, cells compared) of ``ours`` against ``ref`` (rows, layers, top-k) over the
    valid rows both computed from the same tokens: rows ``start`` up to the first differing
    token of the two sequences (a row is the forward pass of its token, which sees that token
    and the ones before it); ids compared as sets."""
    same = 0
    for a, b in zip(ours.token_ids.tolist(), ref_tokens, strict=False):
        if a != b:
            break
        same += 1
    end = min(same, ours.num_tokens, len(ref))
    if end <= start:
        return 0, 0
    valid = ours.valid[start:end]
    x = np.sort(np.asarray(ours.experts[start:end])[valid], -1)
    y = np.sort(np.asarray(ref[start:end])[valid], -1)
    eq = (x == y).all(-1)
    return int(eq.sum()), int(eq.size)
