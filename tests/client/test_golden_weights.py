"""The golden file of route format 1 with the weights plane (tests/client/golden/
format1-weights.msgpack, written once by ``golden/generate.py weights``) reads exactly, weights
bit for bit, through the record and store read paths; a reader that ignores the optional plane
reads its ids."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from _golden import golden_array, load_golden

from routereplay.client import RouteRecord, _codec, _layout, decode_record
from routereplay.client._chunks import _CHUNK
from routereplay.client._frame import HEADER
from routereplay.client._layout import finish_read, plan_read


def _load() -> dict:
    return load_golden("format1-weights.msgpack")


_arr = golden_array


def _same(got: RouteRecord, e: dict, start: int = 0) -> None:
    assert got.token_ids.tolist() == _arr(e["token_ids"])[start:].tolist()
    assert got.valid.tolist() == _arr(e["valid"])[start:].tolist()
    assert np.array_equal(got.experts, _arr(e["experts"])[start:])  # slot order kept
    assert got.weights_dtype == e["weights_dtype"]
    want = _arr(e["weights"])[start:]
    assert np.array_equal(got.weights.view(np.uint32), want.view(np.uint32))
    assert got.moe_layers == tuple(e["moe_layers"]) and got.num_experts == e["num_experts"]


def test_record_blobs_read_exactly() -> None:
    doc = _load()
    assert set(doc["records"]) == set(doc["expect"])
    for rid, blob in doc["records"].items():
        _same(decode_record(blob), doc["expect"][rid])


@pytest.mark.parametrize("start", [0, 1, 130, 140])
def test_stored_records_read_exactly(start: int) -> None:
    doc = _load()
    ids = sorted(doc["manifests"])
    got = finish_read(plan_read(ids, [doc["manifests"][i] for i in ids], start), doc["chunks"])
    for rid, rec in zip(ids, got, strict=True):
        assert isinstance(rec, RouteRecord), (rid, rec)
        _same(rec, doc["expect"][rid], start)


def test_the_grpo_group_shares_its_prompt_chunks_weights_included() -> None:
    doc = _load()
    ids = ["bf16-grpo-0", "bf16-grpo-1"]
    plan = plan_read(ids, [doc["manifests"][i] for i in ids])
    assert len({tuple(m.digests[:2]) for _, m, _ in plan.manifests}) == 1


def _weights_header(blob: bytes) -> tuple[int, int]:
    """(dtype, coding) of a chunk's weights section, read from the fixed layout."""
    body_len = struct.unpack_from("<I", blob, HEADER.size + 36)[0]
    pos = HEADER.size + _CHUNK.size + body_len
    assert blob[HEADER.size + 15] == 1  # one extra section
    name_len = blob[pos]
    assert blob[pos + 1 : pos + 1 + name_len] == b"weights"
    pos += 1 + name_len + 4
    return blob[pos], blob[pos + 1]


def test_the_golden_chunks_hold_every_dtype_and_coding() -> None:
    seen = {_weights_header(b) for b in _load()["chunks"].values()}
    assert {d for d, _ in seen} == {1, 2, 3}  # bfloat16, float16, float32
    assert {c for _, c in seen} == {0, 1}  # values as they are, slot differences


def test_a_reader_without_the_weights_plane_reads_the_ids(monkeypatch) -> None:
    monkeypatch.setattr(_codec, "KNOWN_PLANES", frozenset({"ids"}))
    monkeypatch.setattr(_codec, "weights_plane", lambda p, what: None)
    doc = _load()
    for rid, blob in doc["records"].items():
        rec = decode_record(blob)
        assert rec.weights is None
        assert np.array_equal(rec.experts, _arr(doc["expect"][rid]["experts"]))


def test_a_store_reader_without_the_weights_plane_reads_the_ids(monkeypatch) -> None:
    monkeypatch.setattr(_codec, "KNOWN_PLANES", frozenset({"ids"}))
    monkeypatch.setattr(_layout, "weights_plane", lambda p, what: None)
    doc = _load()
    ids = sorted(doc["manifests"])
    got = finish_read(plan_read(ids, [doc["manifests"][i] for i in ids], 130), doc["chunks"])
    for rid, rec in zip(ids, got, strict=True):
        assert rec.weights is None
        assert np.array_equal(rec.experts, _arr(doc["expect"][rid]["experts"])[130:])
