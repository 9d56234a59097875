"""How tests/client/golden/format1.msgpack was written (route format 1). Never regenerate it
for a format change: the file is what readers must keep reading (tests/client/test_golden.py).

Contents: whole-record blobs, and a store's manifests and chunks for a GRPO group sharing a
prompt (uint8 ids, a weight update inside one sample) and for records of 384 experts (uint16
ids), with chunks re-encoded under every row transform and high-bit layout; beside each, the
rows it must decode to.

``generate.py weights`` wrote tests/client/golden/format1-weights.msgpack the same way (never
regenerated either): records with the optional weights plane in bfloat16 (a GRPO group sharing
its prompt's chunks, slots in and out of score order), float16 and float32.

``generate.py more`` wrote tests/client/golden/format1-more.msgpack (never regenerated either):
the ways of writing rows and weights the two files above lack, each record blob and every
chunk of its record forced to one row transform and high-bit coding (grouped high bits under
plain and tokens, packed bits and base-3 digits under keep, uint16 high-byte planes past 512
experts under plain, keep and tokens), and float16 and float32 weights as values (coding 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np

from routereplay.bench.store import skewed_routes, softmax_routes, uniform_routes
from routereplay.client import RouteRecord, _codec, _layout, encode_record
from routereplay.client import _transforms as X
from routereplay.client._body import encode_body
from routereplay.client._chunks import chunk_blob
from routereplay.client._frame import HEADER
from routereplay.client._keys import KeySchema
from routereplay.client._layout import plan_put


def _arr(a: np.ndarray) -> dict:
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def _expect(r: RouteRecord) -> dict:
    return {
        "token_ids": _arr(r.token_ids), "experts": _arr(r.experts), "valid": _arr(r.valid),
        "moe_layers": list(r.moe_layers), "num_layers": r.num_layers,
        "num_experts": r.num_experts, "prompt_len": r.prompt_len,
        "num_cached_tokens": r.num_cached_tokens, "model": r.model, "metadata": r.metadata,
        "weight_versions": [list(s) for s in r.weight_versions],
    }  # fmt: skip


def _record(experts: np.ndarray, tokens: np.ndarray, E: int, **kw) -> RouteRecord:
    valid = np.ones(len(tokens), bool)
    valid[-1] = False
    ex = experts.copy()
    ex[-1] = 0
    M = experts.shape[1]
    return RouteRecord(token_ids=tokens, experts=ex, valid=valid, moe_layers=tuple(range(1, M + 1)),
                       num_layers=M + 1, num_experts=E, model="golden", **kw)  # fmt: skip


def records() -> dict[str, RouteRecord]:
    rng = np.random.default_rng(20261127)
    prompt = rng.integers(0, 50_000, 300)
    out = {}
    for i, n in enumerate((200, 90, 170)):  # a GRPO group: one prompt, three completions
        tok = np.concatenate([prompt, rng.integers(0, 50_000, n)])
        ex = skewed_routes(rng, len(tok), 4, 128, 8)
        ex[:300] = out["grpo-0"].experts[:300] if i else ex[:300]  # the prompt routed alike
        wv = (("v1", 0, 350), ("v2", 350, len(tok))) if i == 1 else (("v1", 0, len(tok)),)
        out[f"grpo-{i}"] = _record(ex, tok, 128, prompt_len=300, num_cached_tokens=256,
                                   weight_versions=wv, metadata={"sample": i})  # fmt: skip
    tok = rng.integers(0, 50_000, 260)
    out["wide-skewed"] = _record(skewed_routes(rng, 260, 3, 384, 4), tok, 384)
    out["wide-uniform"] = _record(uniform_routes(rng, 260, 3, 384, 4), tok, 384)
    out["wide-500"] = _record(uniform_routes(rng, 140, 2, 500, 2), tok[:140], 500)
    table = np.argsort(rng.random((20, 6, 128)), axis=2)[:, :, :2].astype(np.uint8)
    rep = rng.integers(0, 20, 256)
    out["tokens-order"] = _record(table[rep], rep, 128)
    return out


# Chunks re-encoded under a forced row transform (and high-bit layout), so that the file holds
# every way format 1 writes rows, whatever the writer's heuristics choose for these routes.
FORCED = {
    "grpo-0": [X.XF_PLAIN, X.XF_DELTA, X.XF_KEEP],
    "wide-uniform": [X.XF_PLAIN, X.XF_DELTA, X.XF_TOKENS],
    "wide-500": [X.XF_GAPS],
}


def store_blobs(recs: dict[str, RouteRecord]) -> tuple[dict, dict]:
    keys = KeySchema("golden")
    manifests: dict[str, bytes] = {}
    chunks: dict[bytes, bytes] = {}
    for rid, r in recs.items():
        plan = plan_put(keys, rid, r, 128, canonical_order=rid == "wide-500")
        manifests[rid] = plan.manifest_blob
        for i, key in enumerate(plan.chunk_keys):
            digest = bytes.fromhex(key.split("{")[1].rstrip("}"))
            blob = plan.chunk_blob(i)
            forced = FORCED.get(rid, [])
            if i < len(forced):
                a, b = plan.spans[i]
                head, body = encode_body(
                    r.token_ids[a:b], plan.block_rows[i], r.valid[a:b], r.num_experts,
                    canonical_order=plan.canonical, presorted=True, transform=forced[i],
                )  # fmt: skip
                blob = chunk_blob(head, body, plan.prev_chains[i])
            chunks.setdefault(digest, blob)
    return manifests, chunks


def main(path: str) -> None:
    recs = records()
    # The high-bit layouts forced per record as the writer's thresholds allow.
    with_grouped = {
        "wide-skewed": (X, "_GROUPED_GAIN", 10.0),
        "wide-uniform": (X, "_TRITS_GAIN", 2.0),
    }
    blobs = {}
    manifests: dict[str, bytes] = {}
    chunks: dict[bytes, bytes] = {}
    for rid in recs:
        mod, name, value = with_grouped.get(rid, (X, "_GROUPED_GAIN", X._GROUPED_GAIN))
        old = getattr(mod, name)
        setattr(mod, name, value)
        try:
            blobs[rid] = encode_record(recs[rid], canonical_order=rid == "wide-500")
            m, c = store_blobs({rid: recs[rid]})
        finally:
            setattr(mod, name, old)
        manifests.update(m)
        for d, b in c.items():
            chunks.setdefault(d, b)
    doc = {
        "records": blobs,
        "manifests": manifests,
        "chunks": chunks,
        "expect": {rid: _expect(r) for rid, r in recs.items()},
    }
    Path(path).write_bytes(msgpack.packb(doc, use_bin_type=True))


# ---------------------------------------------------------------------------------------------
# format1-weights.msgpack: records with the optional weights plane (run with ``weights``)
# ---------------------------------------------------------------------------------------------
def _expect_weights(r: RouteRecord) -> dict:
    return {**_expect(r), "weights": _arr(r.weights), "weights_dtype": r.weights_dtype}


def _with_weights(experts: np.ndarray, w: np.ndarray, tokens: np.ndarray, E: int, dtype: str,
                  **kw) -> RouteRecord:  # fmt: skip
    r = _record(experts, tokens, E, **kw)
    w = w.copy()
    w[-1] = 0
    if dtype == "float16":
        w = w.astype(np.float16).astype(np.float32)
    elif dtype == "float32":
        w = w * np.float32(1.0009765625)  # off the bf16 grid: the low mantissa bytes in use
    return dataclasses.replace(r, weights=w.astype(np.float32), weights_dtype=dtype)


def weight_records() -> dict[str, RouteRecord]:
    rng = np.random.default_rng(20261128)
    prompt = rng.integers(0, 50_000, 300)
    p_ex, p_w = softmax_routes(rng, 300, 4, 128, 8)
    out = {}
    for i, n in enumerate((200, 90)):  # a GRPO group: the prompt's ids and weights alike
        tok = np.concatenate([prompt, rng.integers(0, 50_000, n)])
        c_ex, c_w = softmax_routes(rng, n, 4, 128, 8)
        out[f"bf16-grpo-{i}"] = _with_weights(
            np.concatenate([p_ex, c_ex]), np.concatenate([p_w, c_w]), tok, 128, "bfloat16",
            prompt_len=300, num_cached_tokens=256, metadata={"sample": i},
        )  # fmt: skip
    ex, w = softmax_routes(rng, 260, 3, 384, 4)
    out["fp32-wide"] = _with_weights(ex, w, rng.integers(0, 50_000, 260), 384, "float32")
    ex, w = softmax_routes(rng, 150, 2, 64, 6)
    out["fp16"] = _with_weights(ex, w, rng.integers(0, 50_000, 150), 64, "float16")
    # Slots out of score order (the plain coding): ids and weights permuted alike.
    perm = rng.permuted(np.tile(np.arange(6), (150, 2, 1)), axis=2)
    out["bf16-unsorted"] = _with_weights(np.take_along_axis(ex, perm, 2),
                                         np.take_along_axis(w, perm, 2),
                                         rng.integers(0, 50_000, 150), 64, "bfloat16")  # fmt: skip
    return out


def main_weights(path: str) -> None:
    recs = weight_records()
    manifests, chunks = store_blobs(recs)
    doc = {
        "records": {rid: encode_record(r) for rid, r in recs.items()},
        "manifests": manifests,
        "chunks": chunks,
        "expect": {rid: _expect_weights(r) for rid, r in recs.items()},
    }
    Path(path).write_bytes(msgpack.packb(doc, use_bin_type=True))


# ---------------------------------------------------------------------------------------------
# format1-more.msgpack: the remaining ways of writing rows and weights (run with ``more``)
# ---------------------------------------------------------------------------------------------
# The writer's thresholds that make it pick each high-bit coding of 257 to 512 experts (hp 0:
# none to force, ids of uint8 or of more than 512 experts).
_HP_GAINS = {0: {}, 1: {"_TRITS_GAIN": 0.0, "_GROUPED_GAIN": 0.0},
             2: {"_TRITS_GAIN": 0.0, "_GROUPED_GAIN": 1e9}, 3: {"_TRITS_GAIN": 1e9}}  # fmt: skip


@contextlib.contextmanager
def _forced(xf: int | None, hp: int) -> Iterator[None]:
    """The writer (encode_record, and plan_put's chunks) forced to row transform ``xf`` (None:
    its own choice) and high-bit coding ``hp``."""
    saved = [(X, k, getattr(X, k)) for k in _HP_GAINS[hp]]
    saved += [(m, "encode_body", m.encode_body) for m in (_codec, _layout)]
    try:
        for k, v in _HP_GAINS[hp].items():
            setattr(X, k, v)
        if xf is not None:
            for m in (_codec, _layout):
                m.encode_body = functools.partial(encode_body, transform=xf)
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


# rid: (experts, row transform, high-bit coding, top-k); 300 rows: chunks of 128, 128 and 44.
MORE_IDS = {
    "e400-plain-hp2": (400, X.XF_PLAIN, 2, 4),
    "e400-tokens-hp2": (400, X.XF_TOKENS, 2, 2),
    "e512-keep-hp1": (512, X.XF_KEEP, 1, 4),
    "e300-keep-hp3": (300, X.XF_KEEP, 3, 4),
    "e257-keep-hp2": (257, X.XF_KEEP, 2, 4),
    "e1000-plain": (1000, X.XF_PLAIN, 0, 4),
    "e1000-keep": (1000, X.XF_KEEP, 0, 4),
    "e1000-tokens": (1000, X.XF_TOKENS, 0, 2),
}


def more_records() -> dict[str, tuple[RouteRecord, int | None, int]]:
    """rid: (record, forced row transform or None, forced high-bit coding)."""
    rng = np.random.default_rng(20261129)
    out: dict[str, tuple[RouteRecord, int | None, int]] = {}
    for rid, (E, xf, hp, K) in MORE_IDS.items():
        tok = rng.integers(0, 50_000, 300)
        out[rid] = (_record(skewed_routes(rng, 300, 3, E, K), tok, E), xf, hp)
    # Weights as values (coding 0): slots out of score order, ids and weights permuted alike.
    for rid, dtype, K in (("fp16-values", "float16", 6), ("fp32-values", "float32", 6),
                          ("fp32-k1", "float32", 1)):  # fmt: skip
        ex, w = softmax_routes(rng, 150, 2, 64, K)
        perm = rng.permuted(np.tile(np.arange(K), (150, 2, 1)), axis=2)
        r = _with_weights(np.take_along_axis(ex, perm, 2), np.take_along_axis(w, perm, 2),
                          rng.integers(0, 50_000, 150), 64, dtype)  # fmt: skip
        out[rid] = (r, None, 0)
    return out


def _xf_hp(blob: bytes) -> tuple[int, int]:
    """(row transform, high-bit coding) of a record or chunk blob."""
    if blob[5] == 1:
        p = msgpack.unpackb(blob[HEADER.size :], raw=False)
        return p["xf"], p["hp"]
    return struct.unpack_from("<BB", blob, HEADER.size + 12)


def main_more(path: str) -> None:
    keys = KeySchema("golden")
    doc: dict = {"records": {}, "manifests": {}, "chunks": {}, "expect": {}}
    for rid, (r, xf, hp) in more_records().items():
        with _forced(xf, hp):
            blob = encode_record(r)
            plan = plan_put(keys, rid, r, 128)
            blobs = [plan.chunk_blob(i) for i in range(len(plan.chunk_keys))]
        for b in [blob, *blobs]:  # the writer took what it was forced to
            assert xf is None or _xf_hp(b) == (xf, hp), (rid, _xf_hp(b))
        doc["records"][rid] = blob
        doc["manifests"][rid] = plan.manifest_blob
        for key, b in zip(plan.chunk_keys, blobs, strict=True):
            doc["chunks"].setdefault(bytes.fromhex(key.split("{")[1].rstrip("}")), b)
        doc["expect"][rid] = _expect(r) if r.weights is None else _expect_weights(r)
    Path(path).write_bytes(msgpack.packb(doc, use_bin_type=True))


if __name__ == "__main__":
    if sys.argv[1:2] == ["weights"]:
        here = Path(__file__).with_name("format1-weights.msgpack")
        main_weights(sys.argv[2] if len(sys.argv) > 2 else str(here))
    elif sys.argv[1:2] == ["more"]:
        here = Path(__file__).with_name("format1-more.msgpack")
        main_more(sys.argv[2] if len(sys.argv) > 2 else str(here))
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("format1.msgpack")))
