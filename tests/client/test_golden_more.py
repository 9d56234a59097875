"""The third golden file of route format 1 (tests/client/golden/format1-more.msgpack, written
once by ``golden/generate.py more``) reads exactly through the record and store read paths: the
ways of writing rows and weights the other two files lack (grouped high bits under plain and
tokens, packed bits and base-3 digits under keep, high-byte planes past 512 experts, float16
and float32 weights as values)."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from _golden import golden_array, load_golden

from routereplay.client import RouteRecord, decode_record
from routereplay.client import _transforms as X
from routereplay.client._frame import HEADER
from routereplay.client._layout import finish_read, plan_read


def _load() -> dict:
    return load_golden("format1-more.msgpack")


_arr = golden_array


def _same(got: RouteRecord, e: dict, start: int = 0) -> None:
    assert got.token_ids.tolist() == _arr(e["token_ids"])[start:].tolist()
    assert got.valid.tolist() == _arr(e["valid"])[start:].tolist()
    want = _arr(e["experts"])[start:]
    assert got.experts.dtype == want.dtype and np.array_equal(got.experts, want)
    assert got.num_experts == e["num_experts"] and got.moe_layers == tuple(e["moe_layers"])
    assert got.model == e["model"] and got.num_layers == e["num_layers"]
    if "weights" not in e:
        assert got.weights is None
        return
    assert got.weights_dtype == e["weights_dtype"]
    w = _arr(e["weights"])[start:]
    assert np.array_equal(got.weights.view(np.uint32), w.view(np.uint32))


def test_record_blobs_read_exactly() -> None:
    doc = _load()
    assert set(doc["records"]) == set(doc["expect"]) == set(doc["manifests"])
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


def _record_xf_hp(blob: bytes) -> tuple[int, int, int]:
    p = msgpack.unpackb(blob[HEADER.size :], raw=False)
    return p["E"], p["xf"], p["hp"]


def _chunk_xf_hp(blob: bytes) -> tuple[int, int, int]:
    E, _, _, xf, hp = struct.unpack_from("<IHHBB", blob, HEADER.size + 4)
    return E, xf, hp


# (row transform, high-bit coding) of uint16 ids the file must hold, as records and as chunks.
WIDE = {
    (X.XF_PLAIN, 2), (X.XF_TOKENS, 2), (X.XF_KEEP, 1), (X.XF_KEEP, 2), (X.XF_KEEP, 3),
    (X.XF_PLAIN, 0), (X.XF_KEEP, 0), (X.XF_TOKENS, 0),
}  # fmt: skip


def test_the_file_holds_what_the_others_lack() -> None:
    doc = _load()
    for seen in (
        {_record_xf_hp(b) for b in doc["records"].values()},
        {_chunk_xf_hp(b) for b in doc["chunks"].values()},
    ):
        assert {(xf, hp) for E, xf, hp in seen if E > 256} == WIDE
        assert {E for E, _, hp in seen if hp == 0 and E > 256} == {1000}  # past 512: high bytes
    weights = {}
    for rid, blob in doc["records"].items():
        p = msgpack.unpackb(blob[HEADER.size :], raw=False)
        if "weights" in p:
            weights[rid] = tuple(p["weights"][:2])  # (dtype, coding)
    # float16 and float32 as values (coding 0); K = 1 has no slot to difference.
    assert weights == {"fp16-values": (2, 0), "fp32-values": (3, 0), "fp32-k1": (3, 0)}
