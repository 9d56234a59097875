"""The golden files of route format 1 (tests/client/golden/format1.msgpack, written once by
golden/generate.py) read exactly: every record blob, and every record of the stored manifests and
chunks, through the same read path a store runs. A change to the format must keep them readable."""

from __future__ import annotations

import numpy as np
import pytest
from _golden import golden_array, load_golden

from routereplay.client import RouteRecord, decode_record
from routereplay.client import _transforms as X
from routereplay.client._frame import HEADER
from routereplay.client._layout import finish_read, plan_read


def _load() -> dict:
    return load_golden("format1.msgpack")


_arr = golden_array


def _expected(e: dict) -> RouteRecord:
    return RouteRecord(
        token_ids=_arr(e["token_ids"]), experts=_arr(e["experts"]), valid=_arr(e["valid"]),
        moe_layers=tuple(e["moe_layers"]), num_layers=e["num_layers"],
        num_experts=e["num_experts"], prompt_len=e["prompt_len"],
        num_cached_tokens=e["num_cached_tokens"], model=e["model"], metadata=e["metadata"],
        weight_versions=tuple(tuple(s) for s in e["weight_versions"]),
    )  # fmt: skip


def _same(got: RouteRecord, want: RouteRecord, canonical: bool) -> None:
    assert got.token_ids.tolist() == want.token_ids.tolist()
    assert got.valid.tolist() == want.valid.tolist()
    assert got.experts.dtype == want.experts.dtype
    rows = np.sort(want.experts, axis=2) if canonical else want.experts
    assert np.array_equal(got.experts, rows)
    for f in ("moe_layers", "num_layers", "num_experts", "prompt_len", "num_cached_tokens",
              "model", "metadata", "weight_versions"):  # fmt: skip
        assert getattr(got, f) == getattr(want, f), f


CANONICAL = {"wide-500"}  # written with canonical_order=True: rows come back sorted


def test_record_blobs_read_exactly() -> None:
    doc = _load()
    assert set(doc["records"]) == set(doc["expect"])
    for rid, blob in doc["records"].items():
        _same(decode_record(blob), _expected(doc["expect"][rid]), rid in CANONICAL)


@pytest.mark.parametrize("start", [0, 1, 130, 140])
def test_stored_records_read_exactly(start: int) -> None:
    doc = _load()
    ids = sorted(doc["manifests"])
    plan = plan_read(ids, [doc["manifests"][i] for i in ids], start)
    got = finish_read(plan, doc["chunks"])
    for rid, rec in zip(ids, got, strict=True):
        assert isinstance(rec, RouteRecord), (rid, rec)
        want = _expected(doc["expect"][rid])
        if start:
            want = want.rows(start)
        _same(rec, want, rid in CANONICAL)


def test_the_grpo_group_shares_its_prompt_chunks() -> None:
    doc = _load()
    plans = plan_read(
        ["grpo-0", "grpo-1", "grpo-2"], [doc["manifests"][f"grpo-{i}"] for i in range(3)]
    )
    firsts = {tuple(m.digests[:2]) for _, m, _ in plans.manifests}
    assert len(firsts) == 1  # 300 shared prompt tokens: two whole 128-token chunks, stored once


def test_the_golden_chunks_hold_every_transform_and_high_bit_layout() -> None:
    """What the file must keep covering: each row transform, each high-bit coding, canonical
    rows; read from the fixed chunk header (docs/CONTRACTS.md)."""
    doc = _load()
    seen = {(b[HEADER.size + 12], b[HEADER.size + 13]) for b in doc["chunks"].values()}
    xfs = {x for x, _ in seen}
    assert xfs == {X.XF_PLAIN, X.XF_DELTA, X.XF_GAPS, X.XF_KEEP, X.XF_TOKENS}
    assert {hp for _, hp in seen} == {0, 1, 2, 3}
    assert any(b[HEADER.size + 14] & 1 for b in doc["chunks"].values())  # canonical rows
    assert {e["experts"]["dtype"] for e in doc["expect"].values()} == {"|u1", "<u2"}
