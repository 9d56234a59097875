"""Hostile bytes against every reader: seeded mutations of the golden files, and the crafted
inputs that amplify memory or CPU without a bound. Every failure must be a RouteError, and no
input of <= 64 KiB may take more than 0.2 s or 64 MiB (decoding allocates what its limits
allow, never what a few bytes declare).
"""

from __future__ import annotations

import random
import struct
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from routereplay.client import (
    RawBatch,
    ReadLimits,
    RouteCorruptError,
    RouteError,
    RouteLimitError,
    RouteRecord,
    decode_record,
    encode_record,
)
from routereplay.client import _transforms as X
from routereplay.client._body import encode_body
from routereplay.client._codec import body_fields
from routereplay.client._frame import HEADER, KIND_MANIFEST, KIND_RECORD, frame_map
from routereplay.client._layout import finish_read, plan_read

GOLDEN = Path(__file__).parent / "golden"
MAX_S = 0.2
MAX_BYTES = 64 << 20
# Values a field must never be trusted with: negative, huge, of another type.
HOSTILE: list[Any] = [
    -1, 0, 1, 255, 256, 65536, 1 << 26, 1 << 31, 1 << 32, 1 << 34, 1 << 62, True, 1.9, "0",
    None, b"\x00" * 16, [], {}, [1 << 26], [-1],
]  # fmt: skip


def _golden() -> list[dict[str, Any]]:
    files = sorted(GOLDEN.glob("format1*.msgpack"))
    assert len(files) >= 3
    return [msgpack.unpackb(f.read_bytes(), raw=False, strict_map_key=False) for f in files]


def _reframe(blob: bytes) -> bytes:
    """The blob with its length and checksum fields made to fit its payload again, so that a
    mutation reaches the checks past the frame."""
    magic, version, kind, res, _, _ = HEADER.unpack_from(blob)
    payload = blob[HEADER.size :]
    return HEADER.pack(magic, version, kind, res, len(payload), zlib.crc32(payload)) + payload


def _mutate(blob: bytes, rng: random.Random) -> bytes:
    b = bytearray(blob)
    op = rng.randrange(5)
    if op == 0:  # flip bits
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # set bytes to an extreme
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.choice((0, 0xFF, 0x7F, 0x80))
    elif op == 2:  # truncate
        del b[rng.randrange(len(b)) :]
    elif op == 3:  # a run of bytes copied elsewhere
        i, j = rng.randrange(len(b)), rng.randrange(len(b))
        n = rng.randint(1, 64)
        b[j : j + n] = b[i : i + n]
    else:  # bytes inserted
        i = rng.randrange(len(b))
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    out = bytes(b)
    return _reframe(out) if len(out) >= HEADER.size and rng.random() < 0.7 else out


def _with_field(blob: bytes, kind: int, key: str, value: Any) -> bytes:
    p = msgpack.unpackb(blob[HEADER.size :], raw=False)
    p[key] = value
    return frame_map(kind, p)


_CHUNK_FIELDS = struct.Struct("<IIHHBBBB16sII")  # the chunk's fixed header (client/_chunks.py)


def _with_chunk_field(blob: bytes, index: int, value: int) -> bytes:
    fields = list(_CHUNK_FIELDS.unpack_from(blob, HEADER.size))
    fmt = _CHUNK_FIELDS.format[1:].replace("16s", "")
    width = struct.calcsize("<" + fmt[index if index < 8 else index - 1])
    fields[index] = value % (1 << (8 * width))
    fixed = _CHUNK_FIELDS.pack(*fields)
    return _reframe(blob[: HEADER.size] + fixed + blob[HEADER.size + len(fixed) :])


_WORST = [0.0]


def _bounded(call: Callable[..., Any], *args: Any) -> Any:
    """Run one hostile input: its outcome (a value or a RouteError), within the time and
    memory bounds; any other exception fails the test."""
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    # CPU time of this thread (every read here decodes on it): what an input costs, whatever
    # else the host runs meanwhile.
    t0 = time.thread_time()
    try:
        out = call(*args)
    except RouteError as exc:
        out = exc
    took = time.thread_time() - t0
    _WORST[0] = max(_WORST[0], took)
    peak = tracemalloc.get_traced_memory()[1] - base
    assert took < MAX_S, f"{took:.3f} s"
    assert peak < MAX_BYTES, f"{peak} bytes"
    return out


@pytest.fixture
def traced() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def _read(manifest: bytes, chunks: dict[bytes, bytes | None]) -> list[Any]:
    """One id read from its manifest and chunk bytes, as stores and RoutesClient read."""
    results = finish_read(plan_read(["r"], [manifest]), chunks)
    assert all(r is None or isinstance(r, (RouteRecord, RouteError)) for r in results)
    return results


def _decode_with(blob: bytes, key: str, value: Any) -> RouteRecord:
    return decode_record(_with_field(blob, KIND_RECORD, key, value))


def _as_id(manifest: bytes, route_id: str) -> bytes:
    return _with_field(manifest, KIND_MANIFEST, "id", "r") if route_id != "r" else manifest


def test_mutated_records_fail_as_route_errors_within_bounds(traced: None) -> None:
    rng = random.Random(38)
    cases = 0
    for g in _golden():
        for blob in g["records"].values():
            for _ in range(60):
                _bounded(decode_record, _mutate(blob, rng))
                cases += 1
            for key in ("T", "M", "K", "E", "xf", "hp", "raw", "canon", "body", "moe", "L",
                        "pl", "nc", "model", "meta", "wv", "planes", "weights"):  # fmt: skip
                for value in HOSTILE:
                    out = _bounded(_decode_with, blob, key, value)
                    assert isinstance(out, (RouteRecord, RouteError))
                    cases += 1
    assert cases > 2000


def test_mutated_reads_fail_as_route_errors_within_bounds(traced: None) -> None:
    rng = random.Random(39)
    for g in _golden():
        chunks = g["chunks"]
        for rid, manifest in list(g["manifests"].items())[:6]:
            manifest = _as_id(manifest, rid)
            assert isinstance(_read(manifest, chunks)[0], RouteRecord)
            for _ in range(20):
                _bounded(_read, _mutate(manifest, rng), chunks)
            for key in ("T", "M", "K", "E", "bs", "chunks", "id", "moe", "pl", "wv", "planes"):
                for value in HOSTILE:
                    bad = _with_field(manifest, KIND_MANIFEST, key, value)
                    _bounded(_read, bad, chunks)
            digest = msgpack.unpackb(manifest[HEADER.size :], raw=False)["chunks"][0]
            for _ in range(20):
                hostile = {**chunks, digest: _mutate(chunks[digest], rng)}
                _bounded(_read, manifest, hostile)
            for index in (0, 1, 2, 3, 4, 5, 6, 7, 9, 10):
                for value in (0, 1, 255, 65535, (1 << 32) - 1, 1 << 20):
                    bad = _with_chunk_field(chunks[digest], index, value)
                    _bounded(_read, manifest, {**chunks, digest: bad})


def test_mutated_batch_responses_fail_as_route_errors_within_bounds(traced: None) -> None:
    rng = random.Random(40)
    g = _golden()[0]
    packed = RawBatch(manifests=dict(g["manifests"]), chunks=dict(g["chunks"])).pack()
    assert len(packed) <= 64 << 10
    for _ in range(300):
        _bounded(RawBatch.unpack, _mutate(packed, rng))


# ---------------------------------------------------------------------------------------------
# the crafted inputs, one by one
# ---------------------------------------------------------------------------------------------
def _keep_record(T: int, M: int, K: int, E: int) -> tuple[bytes, int]:
    """A valid record of constant routes under the ``keep`` transform: a few hundred bytes
    for megabytes of rows. (blob, bytes of its ids)."""
    ex = np.zeros((T, M, K), np.uint8 if E <= 256 else np.uint16)
    ex[:] = np.arange(K, dtype=ex.dtype)
    rec = RouteRecord(token_ids=np.zeros(T, np.int64), experts=ex, valid=np.ones(T, bool),
                      moe_layers=tuple(range(M)), num_layers=M, num_experts=E)  # fmt: skip
    p = msgpack.unpackb(encode_record(rec)[HEADER.size :], raw=False)
    head, body = encode_body(rec.token_ids, rec.layer_major(), rec.valid, E, transform=X.XF_KEEP)
    return frame_map(KIND_RECORD, {**p, **body_fields(head), "body": body}), ex.nbytes


def test_a_small_keep_record_takes_about_its_own_size(traced: None) -> None:
    blob, size = _keep_record(32768, 64, 8, 64)  # 16 MiB of ids in ~2 KB
    assert len(blob) < 4096 and size == 16 << 20
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    rec = decode_record(blob)
    peak = tracemalloc.get_traced_memory()[1] - base
    assert rec.experts.nbytes == size
    assert peak < 3 * size, f"{peak / size:.1f}x the record"


def test_a_record_over_the_limits_is_refused_before_it_is_allocated(traced: None) -> None:
    blob, size = _keep_record(32768, 64, 8, 64)
    for limits, name in ((ReadLimits(max_rows=32767), "max_rows"), (ReadLimits(max_bytes=size),
                                                                     "max_bytes")):  # fmt: skip
        out = _bounded(lambda lim=limits: decode_record(blob, limits=lim))
        assert isinstance(out, RouteLimitError) and name in str(out)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20


def _manifest(g: dict[str, Any]) -> tuple[str, bytes]:
    rid, blob = next(iter(g["manifests"].items()))
    return rid, blob


@pytest.mark.parametrize(
    "fields",
    [{"chunks": [1 << 26]}, {"chunks": [1 << 34]}, {"chunks": [b"short"]}, {"M": -1},
     {"T": 0, "chunks": [], "M": -1}, {"T": "0"}, {"M": 1.9}, {"K": True},
     {"wv": [[None, 0, 1]]}, {"id": None}],
)  # fmt: skip
def test_a_malformed_manifest_is_its_own_ids_error(traced: None, fields: dict[str, Any]) -> None:
    g = _golden()[0]
    (rid, good), (other, fine) = list(g["manifests"].items())[:2]
    p = msgpack.unpackb(good[HEADER.size :], raw=False)
    bad = frame_map(KIND_MANIFEST, {**p, **fields})
    results = _bounded(lambda: finish_read(plan_read([rid, other], [bad, fine]), g["chunks"]))
    assert isinstance(results[0], RouteCorruptError), results[0]
    assert isinstance(results[1], RouteRecord)  # one bad record never fails the others


def test_a_batch_response_cannot_declare_memory(traced: None) -> None:
    for body in (
        {"manifests": {"r": 1 << 28}, "chunks": {}, "missing": []},
        {"manifests": {}, "chunks": {b"\x00" * 16: 1 << 28}, "missing": []},
        {"manifests": {}, "chunks": {1 << 28: None}, "missing": []},
        {"manifests": {}, "chunks": {}, "missing": [1 << 28]},
    ):
        packed = msgpack.packb(body, use_bin_type=True)
        assert len(packed) < 64
        out = _bounded(lambda b=packed: RawBatch.unpack(b))
        assert isinstance(out, RouteCorruptError)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20


def test_a_chunk_must_declare_the_shape_its_manifest_needs(traced: None) -> None:
    g = _golden()[0]
    rid, manifest = _manifest(g)
    digest = msgpack.unpackb(manifest[HEADER.size :], raw=False)["chunks"][0]
    for index, value in ((0, 1 << 20), (2, 4000), (3, 200), (1, 65536)):  # T, M, K, E
        chunks = {**g["chunks"], digest: _with_chunk_field(g["chunks"][digest], index, value)}
        (out,) = _bounded(lambda c=chunks: finish_read(plan_read([rid], [manifest]), c))
        assert isinstance(out, RouteCorruptError) and "its manifest needs" in str(out), out


def test_a_manifest_field_is_its_exact_type_not_a_lookalike() -> None:
    g = _golden()[0]
    (rid, good), (other, fine) = list(g["manifests"].items())[:2]
    p = msgpack.unpackb(good[HEADER.size :], raw=False)
    for key in ("T", "M", "K", "E", "bs", "pl", "nc"):
        for lookalike in (str(p[key]), p[key] + 0.5, float(p[key])):
            bad = frame_map(KIND_MANIFEST, {**p, key: lookalike})
            got = finish_read(plan_read([rid, other], [bad, fine]), g["chunks"])
            assert isinstance(got[0], RouteCorruptError) and repr(key) in str(got[0]), got[0]
            assert isinstance(got[1], RouteRecord)
