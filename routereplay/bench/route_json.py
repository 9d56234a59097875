"""``routereplay bench json``: what rendering a route as JSON costs the serving process.

One page of a long route (``--rows`` rows of the production router shape, 48 MoE layers top-8
of 128 experts; ``--weights`` adds the routing weights) rendered three ways in the same run:
the service's renderer (numpy fields, the GIL free in its copies), the peer (``json.dumps`` of
``tolist()``, what a ``JSONResponse`` of the lists does) and the floor (the binary record). For
each: seconds per render, MB of output, and the worst delay a 5 ms ticker thread saw while it
ran (how long the event loop would have waited for the GIL).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np

__all__ = ["main"]


def _record(rows: int, weights: bool):  # type: ignore[no-untyped-def]
    from routereplay.client import RouteRecord

    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((rows, 48, 128), dtype=np.float32), axis=2)[:, :, :8]
    valid = np.ones(rows, dtype=bool)
    valid[-1] = False
    w = None
    if weights:
        w = rng.random((rows, 48, 8)).astype(np.float32)
        w[~valid] = 0
    return RouteRecord(
        token_ids=rng.integers(0, 151_000, rows), experts=experts.astype(np.uint8), valid=valid,
        moe_layers=tuple(range(48)), num_layers=48, num_experts=128, prompt_len=rows // 2,
        model="bench", weights=w, weights_dtype="float32" if weights else None,
    )  # fmt: skip


def _peer(rec) -> bytes:  # type: ignore[no-untyped-def]
    body = {"token_ids": rec.token_ids.tolist(), "experts": rec.experts.tolist(),
            "valid": rec.valid.tolist()}  # fmt: skip
    if rec.weights is not None:
        body["weights"] = rec.weights.tolist()
    return json.dumps(body).encode()


def _measure(render: Callable[[], bytes], repeat: int) -> tuple[float, float, float]:
    """(median seconds, MB, worst ticker delay in ms) of ``render`` in a worker thread."""
    times, worst, size = [], 0.0, 0
    for _ in range(repeat):
        done = threading.Event()
        out: list[bytes] = []

        def work(out: list[bytes] = out, done: threading.Event = done) -> None:
            out.append(render())
            done.set()

        t = threading.Thread(target=work)
        t0 = time.perf_counter()
        t.start()
        while not done.is_set():  # the ticker: the event loop's stand-in
            a = time.perf_counter()
            time.sleep(0.005)
            worst = max(worst, time.perf_counter() - a - 0.005)
        t.join()
        times.append(time.perf_counter() - t0)
        size = len(out[0])
    return statistics.median(times), size / 1e6, worst * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="routereplay bench json", description=__doc__)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--weights", action="store_true", help="the routing weights too")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    from routereplay.client import encode_record
    from routereplay.service.serving.route_json import route_json

    rec = _record(a.rows, a.weights)
    rows = {
        "routereplay (JSON)": lambda: route_json("r", rec),
        "peer: json.dumps(tolist())": lambda: _peer(rec),
        "floor: binary record": lambda: encode_record(rec),
    }
    print(f"{a.rows} rows x 48 layers x top-8{' + weights' if a.weights else ''}, "
          f"median of {a.repeat}")  # fmt: skip
    print(f"{'form':30} {'s/render':>9} {'MB':>7} {'worst ticker delay ms':>22}")
    for name, fn in rows.items():
        s, mb, worst = _measure(fn, a.repeat)
        print(f"{name:30} {s:9.3f} {mb:7.1f} {worst:22.1f}")
    return 0
