"""``routereplay bench routes``: the entropy of routes a real router chose, and what the codec
stores for them.

Starts Redis and ``routereplay serve`` on a local model (default: the tiny Qwen3-MoE built here;
``--tiny-variant sharp`` has a sharper router), samples ``--requests`` completions, reads their
routes back through the HTTP client, and reports per id (one expert id of one slot, layer and
token):

- ``H0``: order-0 entropy of the ids, per layer (what a per-layer Huffman table can reach);
- ``Hkeep``: entropy of the ``keep`` model: whether a slot changed from the previous token, then
  the new id's per-layer entropy;
- ``Hcond``: entropy of an id given the same slot's id at the previous token (per layer; biased
  low on small samples, so reported with its sample size);
- ``bound``: log2 of the ordered top-k choices per id (uniformly random routes);
- ``ours``: the compressed body of ``encode_record`` per record (token ids zeroed), and ``zstd``:
  plain zstd (level 1) of the same rows, both in bits per id; ``frame`` is the rest of a record
  blob (header, shape and metadata fields), in bytes per record.

The same table is printed for generated routes (uniform and the skewed workload of ``bench
store``) of the same shape, so the real routes are read against known cases in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import zstandard

__all__ = ["main", "route_stats"]


def _h(counts: np.ndarray) -> float:
    """Entropy in bits of a histogram (total bits, not per symbol)."""
    c = counts[counts > 0].astype(np.float64)
    n = c.sum()
    return float(-(c * np.log2(c / n)).sum()) if n else 0.0


def _payload(blob: bytes) -> dict:
    """The msgpack payload of a record blob (after its 16-byte frame header, docs/storage.md)."""
    import msgpack

    return msgpack.unpackb(blob[16:], raw=False)


def route_stats(records: list, E: int, K: int) -> dict[str, float]:
    """Bits per expert id of several models of ``records`` (see the module doc)."""
    from routereplay.client import encode_record

    h0 = hkeep = hcond = 0.0
    ours = plain = framing = 0
    n_ids = 0
    xf: Counter[int] = Counter()
    rows = [r.experts[r.valid] for r in records]  # only rows that were routed
    M = records[0].experts.shape[1]
    zc = zstandard.ZstdCompressor(level=1)
    for m in range(M):
        ids = np.concatenate([x[:, m].reshape(-1) for x in rows]).astype(np.int64)
        h_layer = _h(np.bincount(ids, minlength=E))
        h0 += h_layer
        # Each stream's first token always carries a new id (keep model); it is coded at the
        # layer's order-0 share in the conditional model.
        first = [x[:1, m].reshape(-1).astype(np.int64) for x in rows]
        n_first = sum(f.size for f in first)
        changed_n = unchanged_n = 0
        new_ids = list(first)
        joint = np.zeros((E, E), np.int64)
        for x in rows:
            if len(x) < 2:
                continue
            a, b = x[:-1, m].astype(np.int64), x[1:, m].astype(np.int64)  # [T-1, K]
            ch = a != b
            changed_n += int(ch.sum())
            unchanged_n += int((~ch).sum())
            new_ids.append(b[ch])
            np.add.at(joint, (a.reshape(-1), b.reshape(-1)), 1)
        flags = np.array([changed_n + n_first, unchanged_n])
        new = np.concatenate(new_ids)
        hkeep += _h(flags) + (_h(np.bincount(new, minlength=E)) if new.size else 0.0)
        # H(b | a) = H(a, b) - H(a), over the pairs of consecutive tokens.
        if joint.any():
            hcond += _h(joint.reshape(-1)) - _h(joint.sum(axis=1))
        hcond += n_first * h_layer / max(1, ids.size)
    for r in records:
        # Token ids zeroed: they then cost a few bytes, so the blob is (almost) all route bytes,
        # framing included; subtracting 4 B/token would undercount compressed token ids.
        blob = encode_record(dataclasses.replace(r, token_ids=np.zeros(r.num_tokens, np.int64)))
        payload = _payload(blob)
        body = len(payload["body"])
        ours += body
        framing += len(blob) - body
        plain += len(zc.compress(np.ascontiguousarray(r.experts).tobytes()))
        xf[int(payload["xf"])] += 1
        n_ids += r.experts.size
    n_valid = sum(x.size for x in rows)
    bound = sum(math.log2(E - i) for i in range(K)) / K
    names = {0: "plain", 1: "delta", 2: "gaps", 3: "keep", 4: "tokens"}  # docs/storage.md
    return {
        "ids": n_valid,
        "H0": h0 / n_valid,
        "Hkeep": hkeep / n_valid,
        "Hcond": hcond / n_valid,
        "bound": bound,
        "ours": 8 * ours / n_ids,
        "zstd": 8 * plain / n_ids,
        "framing_per_record": framing / len(records),
        "transforms": ", ".join(f"{names[k]} {v}" for k, v in sorted(xf.items())),
    }


def _row(name: str, s: dict) -> str:
    best = min(s["H0"], s["Hkeep"], s["Hcond"], s["bound"])
    return (
        f"{name:22s} {s['ids']:>9d} {s['H0']:6.3f} {s['Hkeep']:6.3f} {s['Hcond']:6.3f} "
        f"{s['bound']:6.3f} {s['ours']:6.3f} {s['zstd']:6.3f} {s['ours'] / best:8.3f} "
        f"{s['ours'] / s['zstd']:8.3f} {s['framing_per_record']:6.0f}  {s['transforms']}"
    )


def _sample_routes(args: argparse.Namespace, model: str) -> list:
    import httpx

    from routereplay.client import RoutesClient
    from routereplay.local_redis import free_port, redis_server

    from .servers import server_process

    rng = np.random.default_rng(args.seed)
    words = ("route expert token layer model train sample reward policy value gradient batch "
             "prompt answer reason step think check count plan write read").split()  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rr-bench-") as d, redis_server() as url:
        port = free_port()
        argv = [sys.executable, "-m", "routereplay.cli", "serve", "--port", str(port),
                "--redis-url", url, "--log-level", "warning", "--dtype", "float32",
                "--max-model-len", "2048", "--seed", "0"]  # fmt: skip
        argv += ["--model", model] if model else ["--tiny-variant", args.tiny_variant]
        what = model or f"tiny {args.tiny_variant}"
        print(f"starting routereplay serve ({what}) ...", flush=True)
        base = f"http://127.0.0.1:{port}"
        with server_process(argv, f"{base}/ready", Path(d) / "rr.log"):
            ids = []
            with httpx.Client(base_url=base, timeout=300) as http:
                name = http.get("/v1/models").json()["data"][0]["id"]
                for i in range(args.requests):
                    prompt = " ".join(rng.choice(words, int(rng.integers(8, 64))))
                    r = http.post("/v1/completions", json={
                        "model": name, "prompt": prompt, "max_tokens": args.max_tokens,
                        "temperature": 1.0, "seed": i, "ignore_eos": True})  # fmt: skip
                    r.raise_for_status()
                    ids += [c["routed_experts"]["route_id"] for c in r.json()["choices"]]
            with RoutesClient(base) as rc:
                return rc.get_many(ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="routereplay bench routes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", help="model path (default: a tiny Qwen3-MoE built here)")
    p.add_argument("--tiny-variant", default="sharp", choices=["moe", "sharp", "dense-first"])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", type=Path, help="also write the served routes here (record blobs)")
    p.add_argument("--load", type=Path, help="read routes saved by --save instead of serving")
    args = p.parse_args(argv)

    import msgpack

    from routereplay.bench.store import skewed_routes, uniform_routes
    from routereplay.client import RouteRecord, decode_record, encode_record

    if args.load:
        recs = [decode_record(b) for b in msgpack.unpackb(args.load.read_bytes())]
    else:
        recs = _sample_routes(args, args.model or "")
    if args.save:
        args.save.write_bytes(msgpack.packb([encode_record(r) for r in recs]))
    r0 = recs[0]
    E, K, M = r0.num_experts, r0.top_k, r0.experts.shape[1]
    tokens = sum(r.num_tokens for r in recs)
    print(f"\n{len(recs)} routes, {tokens} tokens, {M} MoE layers, {E} experts, top-{K}")
    print(
        "bits per expert id (lower is better); x_best = ours / the lowest estimate; "
        "x_zstd = ours / plain zstd of the same rows"
    )
    print(f"{'routes':22s} {'ids':>9s} {'H0':>6s} {'Hkeep':>6s} {'Hcond':>6s} {'bound':>6s} "
          f"{'ours':>6s} {'zstd':>6s} {'x_best':>8s} {'x_zstd':>8s} {'frame':>6s}  "
          "transforms")  # fmt: skip
    print(_row("served (real router)", route_stats(recs, E, K)))
    rng = np.random.default_rng(args.seed)
    for kind, gen in (("generated uniform", uniform_routes), ("generated skewed", skewed_routes)):
        fake = [
            RouteRecord(
                token_ids=r.token_ids,
                experts=gen(rng, r.num_tokens, M, E, K),
                valid=np.ones(r.num_tokens, bool),
                moe_layers=r.moe_layers,
                num_layers=r.num_layers,
                num_experts=E,
            )
            for r in recs
        ]
        print(_row(kind, route_stats(fake, E, K)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
