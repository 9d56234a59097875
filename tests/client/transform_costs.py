"""Stored size and decode time of each row transform on the same rows: what a writer's choice of
transform costs a reader. 4,096 tokens of 48 MoE layers x 128 experts x top-8 (``bench store``'s
skewed and uniform routes) as 128-token blocks (the store's chunks), each transform forced, then
the writer's own choice; decode is ``decode_body`` of every block, best of 3.

    .venv/bin/python tests/client/transform_costs.py
"""

import time

import numpy as np

from routereplay.bench.store import skewed_routes, uniform_routes
from routereplay.client import _body as B
from routereplay.client import _transforms as X

NAMES = {None: "writer's choice", X.XF_PLAIN: "plain", X.XF_DELTA: "delta", X.XF_KEEP: "keep",
         X.XF_TOKENS: "tokens"}  # fmt: skip


def measure(routes: np.ndarray, xf: int | None, E: int) -> tuple[float, float, list[int]]:
    T = routes.shape[0]
    tok, valid = np.arange(T, dtype=np.int64), np.ones(T, bool)
    blocks = []
    for s in range(0, T, 128):
        lm = np.ascontiguousarray(routes[s : s + 128].transpose(1, 0, 2))
        blocks.append(B.encode_body(tok[s : s + 128], lm, valid[s : s + 128], E, transform=xf))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for head, body in blocks:
            B.decode_body(head, body, "x")
        best = min(best, time.perf_counter() - t0)
    size = sum(len(body) for _, body in blocks)
    return size / T, best / routes.size * 1e9, [h.xf for h, _ in blocks]


def main() -> None:
    rng = np.random.default_rng(0)
    T, M, E, K = 4096, 48, 128, 8
    for name, routes in (("skewed", skewed_routes(rng, T, M, E, K)),
                         ("uniform", uniform_routes(rng, T, M, E, K))):  # fmt: skip
        for xf in NAMES:
            size, ns, chosen = measure(routes, xf, E)
            picked = sorted({NAMES[c] for c in chosen})
            print(f"{name:8s} {NAMES[xf]:16s} {size:6.1f} B/token  decode {ns:5.2f} ns/id  "
                  f"(blocks: {', '.join(picked)})")  # fmt: skip


if __name__ == "__main__":
    main()
