"""``routereplay report``: one self-contained HTML page (PNG figures inline) of the routing.

From stored routes (named by id, or every route of some weight versions found in Redis) and,
optionally, from the trainer's log of replay scalars:

- per MoE layer, each expert's share of the routed tokens, a heatmap per weight version side by
  side, with the load imbalance, routing entropy and unused experts per layer (the same figures
  as the service's expert-load metrics);
- the trainer's log (JSON lines of ``step_scalars(...)`` and ``ShadowReport.as_metrics()``, as
  a trainer logs them each step): coverage per step, and where the trainer's own router would
  have chosen other experts than the engine's, per layer.

    routereplay report --redis-url redis://host:6379/0 --weight-version step-1 \\
        --weight-version step-2 --trainer-log replay.jsonl --out routing.html
    routereplay report --url http://service:8000 --ids ID [ID ...] --out routing.html
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from routereplay.client import RouteRecord, expert_counts, load_figures

__all__ = ["Usage", "figures", "main", "render", "usage_by_version"]


@dataclass
class Usage:
    """Tokens routed to each expert, per MoE layer, for one weight version."""

    version: str
    layers: tuple[int, ...]
    counts: np.ndarray  # [M, E] int64
    tokens: int
    routes: int


def usage_by_version(records: Iterable[RouteRecord]) -> list[Usage]:
    """Expert counts of the records' valid rows, per weight version (a record's spans each
    count for their own version; rows of no known version count as ``unknown``)."""
    acc: dict[str, Usage] = {}
    for rec in records:
        layers = tuple(rec.moe_layers)
        for version, counts, tokens in expert_counts(rec):
            u = acc.get(version)
            if u is None:
                u = acc[version] = Usage(version, layers, np.zeros_like(counts), 0, 0)
            if u.layers != layers or u.counts.shape != counts.shape:
                raise ValueError(f"records of two model shapes under weight version {version!r}")
            u.counts += counts
            u.tokens += tokens
            u.routes += 1
    return sorted(acc.values(), key=lambda u: u.version)


# -- figures -------------------------------------------------------------------------------------
def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmaps(usages: Sequence[Usage]) -> str:
    """Expert share per layer (rows) and expert (columns), one panel per weight version on a
    common colour scale; PNG as base64."""
    plt = _plt()
    n = len(usages)
    E = usages[0].counts.shape[1]
    width, height = min(3.0 + E / 10, 10.0), 1.5 + 0.3 * len(usages[0].layers)
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    shares = [u.counts / np.maximum(u.counts.sum(axis=1, keepdims=True), 1) for u in usages]
    vmax = max(float(s.max()) for s in shares) or 1.0
    for ax, u, share in zip(axes[0], usages, shares, strict=True):
        im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
        ax.set_title(f"weight version {u.version}\n{u.tokens} tokens, {u.routes} routes",
                     fontsize=9)  # fmt: skip
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_yticks(range(len(u.layers)), [str(x) for x in u.layers])
    fig.colorbar(im, ax=axes[0].tolist(), label="share of the layer's routed slots")
    return _png(fig)


def load_bars(usages: Sequence[Usage]) -> str:
    """Load imbalance, routing entropy and unused-expert share per layer, one bar per version."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    titles = ("load imbalance (max / mean)", "routing entropy / log E", "unused experts")
    layers = usages[0].layers
    width = 0.8 / len(usages)
    for k, u in enumerate(usages):
        for ax, values in zip(axes, load_figures(u.counts), strict=True):
            ax.bar(np.arange(len(layers)) + k * width, values, width, label=u.version)
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xticks(np.arange(len(layers)) + 0.4 - width / 2, [str(x) for x in layers])
        ax.set_xlabel("MoE layer")
    for ax in axes[1:]:  # shares: the whole 0..1 range, so a row of zeros still reads as one
        ax.set_ylim(0, 1.05)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, title="weight version", fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    return _png(fig)


def trainer_figures(rows: Sequence[dict[str, float]], prefix: str = "replay/") -> dict[str, str]:
    """From a trainer's log, by file name: coverage per step, and the share of decisions where
    the trainer's own router differs from the engine's, per layer (mean over the logged steps);
    each only where the log has its scalars."""
    plt = _plt()
    out = {}
    steps = [r.get("step", i) for i, r in enumerate(rows)]
    cov = [r.get(f"{prefix}coverage") for r in rows]
    if any(c is not None for c in cov):
        fig, ax = plt.subplots(figsize=(6.5, 3))
        ax.plot(steps, [np.nan if c is None else c for c in cov], marker="o")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("step")
        ax.set_ylabel("coverage (rows with a route)")
        ax.set_title("replay coverage per step", fontsize=10)
        out["trainer-coverage.png"] = _png(fig)
    key = f"{prefix}router_token_mismatch/layer_"
    per_layer: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        for k, v in r.items():
            if k.startswith(key):
                per_layer[int(k[len(key) :])].append(float(v))
    if per_layer:
        layers = sorted(per_layer)
        fig, ax = plt.subplots(figsize=(6.5, 3))
        ax.bar([str(x) for x in layers], [float(np.mean(per_layer[x])) for x in layers])
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("tokens routed otherwise")
        ax.set_title("engine-trainer disagreement per layer (shadow diagnostics, mean over steps)",
                     fontsize=10)  # fmt: skip
        out["trainer-disagreement.png"] = _png(fig)
    return out


# -- the page ------------------------------------------------------------------------------------
# Records script errors and images that fail to load on the page itself, so a headless browser
# (and a reader) can tell that every figure rendered.
_CHECK = """<script>
window.__errors = [];
window.addEventListener("error", e => window.__errors.push(String(e.message || e)));
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.dataset.images = imgs.length + "/" + ok;
  document.body.dataset.errors = String(window.__errors.length);
});
</script>"""


def _table(usages: Sequence[Usage]) -> str:
    head = ("<tr><th>weight version</th><th>MoE layer</th><th>load imbalance</th>"
            "<th>entropy / log E</th><th>unused experts</th></tr>")  # fmt: skip
    rows = []
    for u in usages:
        for layer, imb, ent, unused in zip(u.layers, *load_figures(u.counts), strict=True):
            rows.append(f"<tr><td>{html.escape(u.version)}</td><td>{layer}</td><td>{imb:.3f}</td>"
                        f"<td>{ent:.3f}</td><td>{unused:.3f}</td></tr>")  # fmt: skip
    return f"<table>{head}{''.join(rows)}</table>"


def figures(
    usages: Sequence[Usage], trainer_rows: Sequence[dict[str, float]] = ()
) -> dict[str, str]:
    """The report's figures by file name, PNGs as base64."""
    if not usages:
        raise ValueError("no routes to report")
    return {
        "expert-utilisation.png": heatmaps(usages),
        "expert-load.png": load_bars(usages),
        **trainer_figures(trainer_rows),
    }


def render(usages: Sequence[Usage], figs: dict[str, str], title: str = "") -> str:
    """The HTML page: ``figs`` (:func:`figures` of ``usages``) as inline PNGs."""
    img = '<img alt="{alt}" src="data:image/png;base64,{b64}">'
    parts = [
        "<h2>Expert utilisation per MoE layer</h2>",
        img.format(alt="expert utilisation heatmaps", b64=figs["expert-utilisation.png"]),
        "<h2>Load per layer</h2>",
        img.format(alt="load per layer", b64=figs["expert-load.png"]),
        _table(usages),
    ]
    trainer = [b for name, b in figs.items() if name.startswith("trainer-")]
    if trainer:
        parts.append("<h2>Trainer: coverage and engine-trainer disagreement</h2>")
        parts += [img.format(alt="trainer figure", b64=b) for b in trainer]
    name = html.escape(title or "routereplay routing report")
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{name}</title>{_CHECK}'
        "<style>body{font-family:sans-serif;margin:2em;max-width:1400px}img{max-width:100%}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}</style>"
        f"</head><body><h1>{name}</h1>{''.join(parts)}</body></html>"
    )


# -- where the routes come from ------------------------------------------------------------------
def _records_by_version(store: Any, versions: Sequence[str], limit: int) -> list[RouteRecord]:
    """Up to ``limit`` records in the store that carry one of ``versions``: a SCAN of its
    manifests, read 256 at a time."""
    keys = store.keys
    ids = [keys.route_id(k) for k in store.redis.scan_iter(match=keys.manifest_pattern(),
                                                             count=1000)]  # fmt: skip
    out: list[RouteRecord] = []
    for i in range(0, len(ids), 256):
        for rec in store.get_many(ids[i : i + 256], missing_ok=True):
            if rec is not None and any(str(v) in versions for v, _, _ in rec.weight_versions):
                out.append(rec)
                if len(out) >= limit:
                    return out
    return out


def _source_error(e: BaseException) -> bool:
    """Whether ``e`` is the route source's answer (a route missing or malformed, Redis or the
    service unreachable): reported in one line, not as a traceback."""
    import httpx
    import redis

    from routereplay.client import RouteError

    return isinstance(e, (RouteError, redis.RedisError, httpx.HTTPError, OSError))


def load_records(args: argparse.Namespace) -> list[RouteRecord]:
    if args.url:
        from routereplay.client import RoutesClient

        with RoutesClient(args.url, api_key=args.api_key) as client:
            return list(client.get_many(args.ids))
    from routereplay.client import RouteStore

    with RouteStore.from_url(args.redis_url, prefix=args.prefix) as store:
        records = [r for r in store.get_many(args.ids, missing_ok=True) if r is not None]
        if args.weight_version:
            records += _records_by_version(store, args.weight_version, args.max_routes)
        return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="routereplay report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a routereplay service (routes by --ids)")
    src.add_argument("--redis-url", help="the route store itself")
    p.add_argument("--api-key", help="with --url: the service's API key")
    p.add_argument("--prefix", default="rr",
                   help="with --redis-url: the store's key prefix (a tenant's routes, with API "
                   "keys: <route-prefix>:t:<tenant>)")  # fmt: skip
    p.add_argument("--ids", nargs="*", default=[], help="route ids")
    p.add_argument(
        "--weight-version",
        action="append",
        default=[],
        help="with --redis-url: every route of this weight version (repeatable)",
    )
    p.add_argument("--max-routes", type=int, default=5000)
    p.add_argument(
        "--trainer-log", type=Path, help="JSON lines of the trainer's replay scalars, one per step"
    )
    p.add_argument("--title", default="")
    p.add_argument("--out", type=Path, required=True, help="the HTML file to write")
    p.add_argument("--png-dir", type=Path, help="also write each figure there as a PNG file")
    args = p.parse_args(argv)  # fmt: skip
    if args.url and not args.ids:
        p.error("--url needs --ids")
    if args.redis_url and not (args.ids or args.weight_version):
        p.error("--redis-url needs --ids or --weight-version")
    try:
        records = load_records(args)
    except Exception as e:
        if not _source_error(e):
            raise
        print(f"routereplay report: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if not records:
        print("routereplay report: no routes found", file=sys.stderr)
        return 1
    rows = []
    if args.trainer_log:
        rows = [json.loads(x) for x in args.trainer_log.read_text().splitlines() if x.strip()]
    usages = usage_by_version(records)
    if args.weight_version:
        usages = [u for u in usages if u.version in args.weight_version] or usages
    figs = figures(usages, rows)
    args.out.write_text(render(usages, figs, args.title))
    if args.png_dir:
        args.png_dir.mkdir(parents=True, exist_ok=True)
        for name, b64 in figs.items():
            (args.png_dir / name).write_bytes(base64.b64decode(b64))
    print(f"{args.out}: {len(records)} routes, weight versions "
          f"{', '.join(u.version for u in usages)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
