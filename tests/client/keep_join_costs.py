"""The keep join's cost per id and the alternatives numpy offers, on one batch of bench store's
skewed routes (4,096 tokens of 48 MoE layers x 128 experts x top-8 as 32 store chunks, joined in
one call as get_many joins a step's chunks): the join with its token-by-token prefix count, the
same join with numpy's cumsum along each stream, and a join without a rank (a delta scattered
at each change, then a wrapping cumsum); then the numpy steps they are made of. Best of 5.

    .venv/bin/python tests/client/keep_join_costs.py
"""

import time
from collections.abc import Callable
from unittest import mock

import numpy as np

from routereplay.bench.store import skewed_routes
from routereplay.client import _transforms as X


def per_id(fn: Callable[[], object], n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e9


def delta_scatter_join(masks: np.ndarray, values: np.ndarray, shape: tuple) -> np.ndarray:
    """No rank: each change's difference from the previous id, scattered at its position, then
    one wrapping uint8 cumsum (every stream starts with a change, so streams need no reset)."""
    G, M, T, K = shape
    bits = np.unpackbits(masks, count=G * M * K * T)
    d = np.zeros(bits.size, np.uint8)
    diffs = np.empty_like(values)
    diffs[0] = values[0]
    np.subtract(values[1:], values[:-1], out=diffs[1:])
    d[np.flatnonzero(bits)] = diffs
    ids = np.cumsum(d, dtype=np.uint8)
    return np.ascontiguousarray(ids.reshape(G * M, K, T).transpose(0, 2, 1)).reshape(shape)


def main() -> None:
    rng = np.random.default_rng(0)
    T, M, E, K, B = 4096, 48, 128, 8, 128
    routes = skewed_routes(rng, T, M, E, K)
    blocks = [np.ascontiguousarray(routes[s : s + B].transpose(1, 0, 2)) for s in range(0, T, B)]
    splits = [X._keep_split(b) for b in blocks]
    masks = np.packbits(np.concatenate([c.reshape(-1) for c, _ in splits]))
    values = np.concatenate([v for _, v in splits])
    lengths = np.array([v.size for _, v in splits])
    shape, n = (len(blocks), M, B, K), routes.size
    want = np.stack(blocks)
    print(f"{len(blocks)} blocks of {B} tokens, {n:,} ids, {values.size / n:.2f} of them changes")
    join = lambda: X.keep_join(masks, values, shape, lengths)  # noqa: E731
    assert np.array_equal(join(), want)
    print(f"keep_join, token-by-token prefix count  {per_id(join, n):5.2f} ns/id")
    with mock.patch.object(X, "_TOKEN_MAJOR_MIN_STREAMS", 1 << 62):
        assert np.array_equal(join(), want)
        print(f"keep_join, cumsum along each stream      {per_id(join, n):5.2f} ns/id")
    scatter = lambda: delta_scatter_join(masks, values, shape)  # noqa: E731
    assert np.array_equal(scatter(), want)
    print(f"delta scattered + wrapping cumsum        {per_id(scatter, n):5.2f} ns/id")
    bits = np.unpackbits(masks, count=n)
    streams = bits.reshape(-1, B)
    for name, fn in [
        ("unpackbits", lambda: np.unpackbits(masks, count=n)),
        ("cumsum along each stream (uint8)", lambda: np.cumsum(streams, axis=1, dtype=np.uint8)),
        ("token-by-token prefix count", lambda: X._token_prefix_count(streams)),
        ("bits made token-major (a copy)", lambda: np.ascontiguousarray(streams.T)),
        ("flatnonzero of the bits", lambda: np.flatnonzero(bits)),
    ]:
        print(f"  {name:34s} {per_id(fn, n):5.2f} ns/id")


if __name__ == "__main__":
    main()
