"""``routereplay bench store``: storage size, codec speed and prefix dedupe, against peers' formats.

Peers ship routes inline in the OpenAI response: vLLM as base64 of an ``.npy`` of
``[T - 1, num_layers, K]`` uint8/uint16 (dense layers included), SGLang as base64 of int32. Both
are computed here, in the same run, from the same routes.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from routereplay.client import (
    DEFAULT_BLOCK_SIZE,
    RouteRecord,
    RouteStore,
    decode_record,
    encode_record,
    expert_dtype,
)
from routereplay.local_redis import redis_server


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    first_dense: int
    num_experts: int
    top_k: int

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_dense, self.num_layers))


SHAPES = [
    Shape("Qwen3-30B-A3B", 48, 0, 128, 8),
    Shape("DeepSeek-V3", 61, 3, 256, 8),
    # More than 256 experts: uint16 ids, the codec's low-byte and high-byte planes.
    Shape("Kimi-K2", 61, 1, 384, 8),
]


# ---------------------------------------------------------------------------------------------
# route generators
# ---------------------------------------------------------------------------------------------
def uniform_routes(rng: np.random.Generator, T: int, M: int, E: int, K: int) -> np.ndarray:
    """Each row: K distinct experts drawn uniformly (the hardest case for any codec)."""
    out = np.empty((T, M, K), dtype=expert_dtype(E))
    step = max(1, (1 << 22) // (M * E))
    for a in range(0, T, step):
        b = min(a + step, T)
        keys = rng.random(((b - a) * M, E), dtype=np.float32)
        out[a:b] = np.argpartition(keys, K, axis=1)[:, :K].reshape(b - a, M, K)
    return out


# The skewed workload's model (also bench trainer's --routes skewed).
SKEW_ZIPF_S = 1.1
SKEW_KEEP = 0.5


def skewed_routes(
    rng: np.random.Generator,
    T: int,
    M: int,
    E: int,
    K: int,
    *,
    zipf_s: float = SKEW_ZIPF_S,
    keep: float = SKEW_KEEP,
) -> np.ndarray:
    """Zipf expert popularity per layer; each slot keeps the previous token's expert with
    probability ``keep`` (neighbouring tokens share experts), else draws a new distinct one.
    ``[T, M, K]``: one sequence of :func:`skewed_routes_many`."""
    return skewed_routes_many(rng, [T], M, E, K, zipf_s=zipf_s, keep=keep)[0]


def skewed_routes_many(
    rng: np.random.Generator,
    lengths: Sequence[int],
    M: int,
    E: int,
    K: int,
    *,
    zipf_s: float = SKEW_ZIPF_S,
    keep: float = SKEW_KEEP,
) -> list[np.ndarray]:
    """:func:`skewed_routes` for sequences of ``lengths`` under one router (one popularity order
    per layer), ``[n, M, K]`` each. Stepped through tokens with every sequence, layer and slot
    at once, so a 256k-token batch (bench trainer) takes seconds."""
    w = 1.0 / np.arange(1, E + 1) ** zipf_s
    cdf = np.cumsum(w / w.sum())
    perms = np.argsort(rng.random((M, E)), axis=1)  # popularity order per layer
    S, L = len(lengths), max(lengths, default=0)
    out = np.empty((L, S, M, K), dtype=expert_dtype(E))
    layer = np.broadcast_to(np.arange(M)[None, :, None], (S, M, K))

    def draw(idx: tuple[np.ndarray, ...]) -> np.ndarray:
        ranks = np.minimum(np.searchsorted(cdf, rng.random(len(idx[0]))), E - 1)
        return perms[layer[idx], ranks]

    # Slot j comes before slot k: what a sequential draw without replacement would compare
    # with. When two fresh slots draw the same id, only the later one draws again (both
    # redrawing would favour the less popular experts: the rows came out ~1.5% more costly to
    # code than the model's entropy allows for).
    earlier = np.tri(K, K, -1, dtype=bool)  # earlier[k, j]: j < k
    row = np.zeros((S, M, K), np.int64)
    fresh = np.ones((S, M, K), bool)  # the first token draws every slot
    for t in range(L):
        while True:  # draw the fresh slots until none repeats a kept or earlier slot's id
            idx = np.nonzero(fresh)
            if not len(idx[0]):
                break
            row[idx] = draw(idx)
            same = row[:, :, :, None] == row[:, :, None, :]  # [S, M, k, j]
            fresh &= (same & (earlier | ~fresh[:, :, None, :])).any(axis=3)
        out[t] = row
        fresh = rng.random((S, M, K)) >= keep
    return [np.ascontiguousarray(out[:n, i]) for i, n in enumerate(lengths)]


def skewed_entropy_bits(E: int, zipf_s: float = SKEW_ZIPF_S, keep: float = SKEW_KEEP) -> float:
    """Approximate entropy per expert id of :func:`skewed_routes`: the keep/draw choice plus a
    Zipf draw when drawn (the distinctness exclusion is ignored, a slight overestimate)."""
    w = 1.0 / np.arange(1, E + 1) ** zipf_s
    w /= w.sum()
    h_zipf = float(-(w * np.log2(w)).sum())
    h_keep = -(keep * math.log2(keep) + (1 - keep) * math.log2(1 - keep))
    return h_keep + (1 - keep) * h_zipf


def bf16_values(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even) as torch does, as float32."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    b = (b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return b.view(np.float32)


def softmax_routes(
    rng: np.random.Generator, T: int, M: int, E: int, K: int, logit_std: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """``(experts, weights)`` ``[T, M, K]`` as a Qwen3-MoE router computes them: softmax of
    gaussian logits over E experts in float32, the top K by score (descending: the engine's slot
    order), renormalised to sum to 1 (norm_topk_prob), then cast to bfloat16 (values float32)."""
    experts = np.empty((T, M, K), dtype=expert_dtype(E))
    weights = np.empty((T, M, K), dtype=np.float32)
    step = max(1, (1 << 22) // (M * E))
    for a in range(0, T, step):
        b = min(a + step, T)
        logits = rng.normal(0.0, logit_std, ((b - a) * M, E)).astype(np.float32)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        top = np.argpartition(-p, K - 1, axis=1)[:, :K]
        w = np.take_along_axis(p, top, 1)
        order = np.argsort(-w, axis=1, kind="stable")
        top, w = np.take_along_axis(top, order, 1), np.take_along_axis(w, order, 1)
        w /= w.sum(axis=1, keepdims=True)
        experts[a:b] = top.reshape(b - a, M, K)
        weights[a:b] = bf16_values(w).reshape(b - a, M, K)
    return experts, weights


def make_record(
    shape: Shape,
    experts: np.ndarray,
    tokens: np.ndarray,
    prompt_len: int,
    weights: np.ndarray | None = None,
) -> RouteRecord:
    valid = np.ones(tokens.shape[0], bool)
    valid[-1] = False
    ex = experts.copy()
    ex[-1] = 0
    w = None
    if weights is not None:
        w = weights.copy()
        w[-1] = 0
    return RouteRecord(
        token_ids=tokens,
        experts=ex,
        valid=valid,
        moe_layers=shape.moe_layers,
        num_layers=shape.num_layers,
        num_experts=shape.num_experts,
        prompt_len=prompt_len,
        model=shape.name,
        weights=w,
        weights_dtype=None if w is None else "bfloat16",
    )


# ---------------------------------------------------------------------------------------------
# peers' inline formats
# ---------------------------------------------------------------------------------------------
def vllm_inline(rec: RouteRecord) -> bytes:
    """vLLM's ``routed_experts``: base64 of ``np.save`` of ``[T-1, num_layers, K]``."""
    full = np.zeros((rec.num_tokens - 1, rec.num_layers, rec.top_k), dtype=rec.experts.dtype)
    full[:, list(rec.moe_layers)] = rec.experts[:-1]
    buf = io.BytesIO()
    np.save(buf, full)
    return base64.b64encode(buf.getvalue())


def sglang_inline(rec: RouteRecord) -> bytes:
    full = np.zeros((rec.num_tokens - 1, rec.num_layers, rec.top_k), dtype=np.int32)
    full[:, list(rec.moe_layers)] = rec.experts[:-1]
    return base64.b64encode(full.tobytes())


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------
def _best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bound_bits(shape: Shape, ordered: bool) -> float:
    E, K = shape.num_experts, shape.top_k
    if ordered:
        return sum(math.log2(E - i) for i in range(K))
    return math.log2(math.comb(E, K))


def bench_sizes_and_speed(rng: np.random.Generator, T: int, repeat: int) -> None:
    print(f"\n== Size per token and codec speed (one record of {T} tokens, one core) ==")
    hdr = (
        f"{'shape':14s} {'routes':8s} {'order':7s} {'B/token':>8s} {'xbound':>7s} "
        f"{'/raw u8':>8s} {'vs vLLM':>8s} {'vs SGL':>8s} {'enc MB/s':>9s} {'dec MB/s':>9s} "
        f"{'vs zstd':>8s} {'enc x':>6s} {'dec x':>6s}"
    )
    print(hdr)
    for shape in SHAPES:
        M = len(shape.moe_layers)
        tokens = rng.integers(0, 151_000, T)
        for kind in ("uniform", "skewed"):
            if kind == "uniform":
                ex = uniform_routes(rng, T, M, shape.num_experts, shape.top_k)
            else:
                ex = skewed_routes(rng, T, M, shape.num_experts, shape.top_k)
            rec = make_record(shape, ex, tokens, T // 2)
            raw_u8 = M * shape.top_k  # MoE rows only, uint8 (vLLM's array adds dense layers)
            vllm_b = len(vllm_inline(rec)) / T
            sgl_b = len(sglang_inline(rec)) / T
            raw_bytes = rec.experts.nbytes
            # Baseline in the same run: plain zstd (level 1) of the same [T, M, K] array, as a
            # peer storing the array compressed would; its speed on one core.
            zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
            arr = rec.experts.tobytes()
            z = zc.compress(arr)
            tz_e = _best(lambda c=zc, a=arr: c.compress(a), repeat)
            tz_d = _best(lambda d=zd, b=z: d.decompress(b), repeat)
            no_tok = dataclasses.replace(rec, token_ids=np.zeros(T, np.int64))
            for canon in (False, True):
                blob = encode_record(rec, canonical_order=canon)
                # Route bytes: the same record with zeroed token ids (which then cost a few
                # bytes), so compressed token ids are neither counted nor over-subtracted.
                route_b = len(encode_record(no_tok, canonical_order=canon)) / T
                per_tok = len(blob) / T
                if kind == "uniform":
                    bound = bound_bits(shape, not canon) * M / 8
                else:
                    bound = skewed_entropy_bits(shape.num_experts) * M * shape.top_k / 8
                te = _best(lambda r=rec, c=canon: encode_record(r, canonical_order=c), repeat)
                td = _best(lambda b=blob: decode_record(b), repeat)
                xb = f"{route_b / bound:7.3f}"
                print(
                    f"{shape.name:14s} {kind:8s} {'sorted' if canon else 'exact':7s} "
                    f"{per_tok:8.1f} {xb} {route_b / raw_u8:8.3f} {vllm_b / per_tok:7.1f}x "
                    f"{sgl_b / per_tok:7.1f}x {raw_bytes / te / 1e6:9.0f} "
                    f"{raw_bytes / td / 1e6:9.0f} {len(z) / T / route_b:7.2f}x "
                    f"{tz_e / te:6.2f} {tz_d / td:6.2f}"
                )
        skew_b = skewed_entropy_bits(shape.num_experts) * M * shape.top_k / 8
        print(
            f"{'':14s} raw uint8 {raw_u8} B/token (MoE rows"
            + ("" if shape.num_experts <= 256 else f"; stored raw as uint16: {2 * raw_u8}")
            + f"); vLLM inline {vllm_b:.0f} B/token; "
            f"SGLang inline {sgl_b:.0f} B/token\n{'':14s} bounds: uniform "
            f"{bound_bits(shape, True) * M / 8:.1f} ordered, "
            f"{bound_bits(shape, False) * M / 8:.1f} sorted; skewed workload entropy "
            f"~{skew_b:.1f} B/token ({skew_b / raw_u8:.3f} of raw)"
        )
    print(
        "B/token = whole stored blob incl. 4 B/token of token ids; xbound and /raw u8 count route"
        " bytes only; xbound = route bytes / the workload's bound (uniform: information bound of"
        " the order kept; skewed: the generator's entropy, ordered); 'vs' = peer inline bytes /"
        " ours. skewed = Zipf(1.1) expert popularity per layer, each slot keeps the previous"
        " token's expert with p = 0.5. Baseline in the same run: 'vs zstd' = plain zstd (level 1)"
        " bytes of the same [T, M, K] array / our route bytes; 'enc x', 'dec x' = our speed /"
        " plain zstd's (our decode includes the crc32 check, the row transform and, for plain"
        " rows, a copy out of zstd's read-only output; records are token-major views of"
        " layer-major rows)."
    )


def _store_bytes(store: RouteStore, route_id: str, rec: RouteRecord) -> int:
    """Bytes of the record's store chunks: what its put writes, manifest aside (no chunk of
    another record is shared: every record here has its own tokens, or its own weights)."""
    put = store.put(route_id, rec)
    assert put.chunks_written == put.chunks_total, "a chunk was shared"
    return put.bytes_written - put.manifest_bytes


def bench_weights(rng: np.random.Generator, T: int, repeat: int, logit_std: float) -> None:
    print(
        f"\n== Routing weights plane (one record of {T} tokens; bf16 weights: softmax of "
        f"N(0, {logit_std}^2) logits, top-k, renormalised) =="
    )
    print(
        f"{'shape':14s} {'ids B/tok':>9s} {'+w B/tok':>9s} {'w B/tok':>8s} {'w raw':>6s} "
        f"{'w /raw':>7s} {'bits/w':>7s} {'store ids':>9s} {'store +w':>9s} "
        f"{'enc ms':>7s} {'enc+w ms':>8s} {'dec ms':>7s} {'dec+w ms':>8s}"
    )
    with redis_server() as url, RouteStore.from_url(url, prefix="w", ttl_s=3600) as store:
        for shape in SHAPES:
            _weights_row(store, shape, rng, T, repeat, logit_std)
    print(
        "ids / +w B/tok = record blob bytes per token without / with the weights plane (token ids"
        " included); w B/tok = their difference; w raw = 2*K*M (the bf16 weights uncompressed);"
        " bits/w = stored bits per weight; store = bytes per token of the record's store chunks"
        f" (block {DEFAULT_BLOCK_SIZE}, manifest aside); enc/dec = one record, best of {repeat}."
    )


def _weights_row(
    store: RouteStore,
    shape: Shape,
    rng: np.random.Generator,
    T: int,
    repeat: int,
    logit_std: float,
) -> None:
    """One shape's row of the weights table."""
    M, K = len(shape.moe_layers), shape.top_k
    ex, w = softmax_routes(rng, T, M, shape.num_experts, K, logit_std)
    rec = make_record(shape, ex, rng.integers(0, 151_000, T), T // 2, w)
    ids = dataclasses.replace(rec, weights=None, weights_dtype=None)
    b_ids, b_w = encode_record(ids), encode_record(rec)
    raw_w = 2 * K * M  # bf16 bytes per token
    w_tok = (len(b_w) - len(b_ids)) / T
    times = [_best(lambda r=r: encode_record(r), repeat) for r in (ids, rec)] + [
        _best(lambda b=b: decode_record(b), repeat) for b in (b_ids, b_w)
    ]
    print(
        f"{shape.name:14s} {len(b_ids) / T:9.1f} {len(b_w) / T:9.1f} {w_tok:8.1f} "
        f"{raw_w:6d} {w_tok / raw_w:7.3f} {8 * w_tok / (K * M):7.2f} "
        f"{_store_bytes(store, f'{shape.name}-ids', ids) / T:9.1f} "
        f"{_store_bytes(store, f'{shape.name}-w', rec) / T:9.1f} "
        + " ".join(f"{t * 1e3:{8 if i % 2 else 7}.1f}" for i, t in enumerate(times))
    )


def bench_dedupe(rng: np.random.Generator, url: str, prompt: int, completion: int) -> None:
    print("\n== Prefix dedupe in the Redis store (bytes written vs each request stored whole) ==")
    shape = SHAPES[0]
    M = len(shape.moe_layers)
    store = RouteStore.from_url(url, prefix=f"bench{rng.integers(1 << 30)}")
    try:
        # (a) GRPO group: n samples of one prompt.
        n = 8
        p_tok = rng.integers(0, 151_000, prompt)
        p_rows = skewed_routes(rng, prompt, M, shape.num_experts, shape.top_k)
        whole = dedup = 0
        for i in range(n):
            c_rows = skewed_routes(rng, completion, M, shape.num_experts, shape.top_k)
            tok = np.concatenate([p_tok, rng.integers(0, 151_000, completion)])
            rec = make_record(shape, np.concatenate([p_rows, c_rows]), tok, prompt)
            whole += len(encode_record(rec))
            dedup += store.put(f"grpo-{i}", rec).bytes_written
        print(
            f"GRPO group n={n}, prompt {prompt}, completions {completion}: "
            f"{dedup / 1e6:.2f} MB vs {whole / 1e6:.2f} MB whole = {dedup / whole:.3f}x"
        )
        # (b) multi-turn: turn j re-sends everything before it and adds `completion` tokens.
        turns = 10
        total = completion * turns
        tok = rng.integers(0, 151_000, total)
        rows = skewed_routes(rng, total, M, shape.num_experts, shape.top_k)
        whole = dedup = 0
        for j in range(1, turns + 1):
            end = j * completion
            rec = make_record(shape, rows[:end], tok[:end], end - completion // 2)
            whole += len(encode_record(rec))
            dedup += store.put(f"turn-{j}", rec).bytes_written
        print(
            f"{turns}-turn trajectory, {completion} new tokens per turn: "
            f"{dedup / 1e6:.2f} MB vs {whole / 1e6:.2f} MB whole = {dedup / whole:.3f}x"
        )
        # fetch cost of the trajectory's last turn plus the whole GRPO group in one batch
        ids = [f"grpo-{i}" for i in range(n)] + [f"turn-{turns}"]
        t = statistics.median(_time(lambda: store.get_many(ids)) for _ in range(3))
        toks = n * (prompt + completion) + total
        print(f"get_many of {len(ids)} records ({toks} tokens): {t * 1e3:.1f} ms")
    finally:
        store.close()


def _redis_cpu_and_memory(r: object) -> tuple[float, int]:
    info = r.info()  # type: ignore[attr-defined]
    return info["used_cpu_user"] + info["used_cpu_sys"], info["used_memory"]


def bench_redis_capacity(
    rng: np.random.Generator, groups: int, group_size: int, prompt: int, completion: int
) -> None:
    """What one Redis node pays per stored token: memory (keys, chunks, manifests, index) and
    server CPU, for GRPO groups of the Qwen3-30B-A3B shape, against the peer baseline of storing
    vLLM's inline route blob under the request id (a plain ``SET ... EX``), in the same run on a
    fresh private redis-server each. Redis runs commands on one thread: tokens per Redis CPU
    second is what one cluster master absorbs at 100% of a core."""
    print(
        f"\n== Redis cost per stored token: {groups} GRPO groups x {group_size} samples, prompt "
        f"{prompt} + completion {completion} tokens, {SHAPES[0].name} shape =="
    )
    shape = SHAPES[0]
    M = len(shape.moe_layers)
    records = []
    for _ in range(groups):
        p_tok = rng.integers(0, 151_000, prompt)
        p_rows = skewed_routes(rng, prompt, M, shape.num_experts, shape.top_k)
        for _ in range(group_size):
            tok = np.concatenate([p_tok, rng.integers(0, 151_000, completion)])
            rows = np.concatenate(
                [p_rows, skewed_routes(rng, completion, M, shape.num_experts, shape.top_k)]
            )
            records.append(make_record(shape, rows, tok, prompt))
    tokens = sum(r.num_tokens for r in records)
    inline = [vllm_inline(r) for r in records]
    rows = []
    for name in ("routereplay", "vLLM inline blob (SET)"):
        with redis_server() as url:
            store = RouteStore.from_url(url, prefix="cap", ttl_s=3600)
            try:
                cpu0, mem0 = _redis_cpu_and_memory(store.redis)
                t0 = time.perf_counter()
                for i, rec in enumerate(records):
                    if name == "routereplay":
                        store.put(f"cap-{i}", rec)
                    else:
                        store.redis.set(f"peer:{{cap-{i}}}", inline[i], ex=3600)
                wall = time.perf_counter() - t0
                cpu1, mem1 = _redis_cpu_and_memory(store.redis)
            finally:
                store.close()
        cpu = cpu1 - cpu0
        rows.append((name, (mem1 - mem0) / tokens, cpu / tokens * 1e6, tokens / cpu, tokens / wall))
    print(
        f"{'store':24s} {'mem B/token':>12s} {'redis CPU us/token':>19s} "
        f"{'tokens per redis CPU-s':>23s} {'one writer tokens/s':>20s}"
    )
    for name, mem, us, per_cpu_s, per_wall in rows:
        print(f"{name:24s} {mem:12.1f} {us:19.3f} {per_cpu_s:23,.0f} {per_wall:20,.0f}")
    ours, peer = rows
    print(
        f"peer/ours: memory {peer[1] / ours[1]:.1f}x, Redis CPU {peer[2] / ours[2]:.1f}x. "
        "mem = used_memory growth / tokens stored (keys and allocator overhead included); "
        "tokens = prompt + completion of every sample; one writer = this process putting "
        "records one after another (route encoding included), not a Redis limit."
    )


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="routereplay bench store", description=__doc__)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per record for size/speed")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--completion", type=int, default=1024)
    p.add_argument(
        "--redis-url",
        default=None,
        help="Redis for the dedupe part; by default a private redis-server on a free port",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--capacity-groups", type=int, default=8, help="GRPO groups for the Redis cost part"
    )
    p.add_argument(
        "--weights",
        action="store_true",
        help="measure only the routing weights plane (bf16 weights beside the ids)",
    )
    p.add_argument("--logit-std", type=float, default=1.0, help="router logit spread for --weights")
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    if args.weights:
        bench_weights(rng, args.tokens, args.repeat, args.logit_std)
        return 0
    bench_sizes_and_speed(rng, args.tokens, args.repeat)
    if args.redis_url:
        bench_dedupe(rng, args.redis_url, args.prompt, args.completion)
    else:
        with redis_server() as url:
            bench_dedupe(rng, url, args.prompt, args.completion)
    if args.capacity_groups:
        bench_redis_capacity(rng, args.capacity_groups, 8, args.prompt, args.completion)
    return 0
