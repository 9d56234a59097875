"""docs/CONTRACTS.md ("Route format 1") is enough to read route format 1: a reader written from
that page alone, with numpy, msgpack, zstandard and blake3 and nothing of routereplay, decodes
every golden file (record blobs, and manifests with their chunks, every chunk's address and
token chain checked) to the rows the files expect and to what routereplay decodes.

The reader is the first half of this file; only the tests below it import routereplay.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import msgpack
import numpy as np
import pytest
import zstandard

# ---------------------------------------------------------------------------------------------
# The reader: docs/CONTRACTS.md, "Route format 1", and nothing else
# ---------------------------------------------------------------------------------------------
RECORD, CHUNK, MANIFEST = 1, 2, 3
PLAIN, DELTA, GAPS, KEEP, TOKENS = 0, 1, 2, 3, 4
WEIGHT_DTYPES = {1: "bfloat16", 2: "float16", 3: "float32"}


class SpecError(Exception):
    """A blob that breaks the spec."""


def H(data: bytes) -> bytes:
    return blake3.blake3(data).digest(16)


def unframe(blob: bytes, kind: int, check_crc: bool = True) -> bytes:
    """The payload of a frame of ``kind``."""
    if len(blob) < 16:
        raise SpecError("shorter than a frame header")
    magic, version, got, _, plen, crc = struct.unpack_from("<4sBBHII", blob)
    if magic != b"RRTE" or version != 1 or got != kind or len(blob) != 16 + plen:
        raise SpecError(f"bad frame: {magic!r} version {version} kind {got} length {plen}")
    payload = blob[16:]
    if check_crc and zlib.crc32(payload) != crc:
        raise SpecError("checksum mismatch")
    return payload


def unpack_bits(data: bytes, n: int) -> np.ndarray:
    """The first ``n`` bits of a packed sequence (most significant bit first), as bool."""
    if len(data) != (n + 7) // 8:
        raise SpecError(f"{len(data)} bytes for {n} packed bits")
    bits = np.unpackbits(np.frombuffer(data, np.uint8), count=n).astype(bool)
    return bits


def unzstd(frame: bytes, size: int) -> bytes:
    raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    if len(raw) != size:
        raise SpecError(f"zstd frame holds {len(raw)} bytes, not {size}")
    return raw


def high_bit_order(low: np.ndarray, limit: int, hp: int, segments: list[int]) -> np.ndarray:
    """Positions of the values with a stored high bit, in the order of their bits: value order
    (hp 1), or per segment the values of low byte 0, then 1, ... each in value order (hp 2)."""
    has_bit = low < limit
    if hp == 1:
        return np.flatnonzero(has_bit)
    order = []
    start = 0
    for size in segments:
        seg_low = low[start : start + size]
        for byte in range(limit):
            order.append(np.flatnonzero((seg_low == byte) & has_bit[start : start + size]) + start)
        start += size
    return np.concatenate(order) if order else np.zeros(0, np.intp)


def read_values(data: bytes, n: int, E: int, hp: int, segments: list[int]) -> np.ndarray:
    """``n`` values of ``bits`` 8 or 16 that ``data`` must hold exactly (uint8 or uint16)."""
    if E <= 256:
        if hp != 0 or len(data) != n:
            raise SpecError(f"uint8 rows: hp {hp}, {len(data)} bytes for {n} values")
        return np.frombuffer(data, np.uint8)
    low = np.frombuffer(data[:n], np.uint8)
    rest = data[n:]
    values = low.astype(np.uint16)
    if hp == 0:
        if len(rest) != n:
            raise SpecError("high byte plane of the wrong size")
        values |= np.frombuffer(rest, np.uint8).astype(np.uint16) << 8
    elif hp == 3:
        if len(rest) != (n + 4) // 5 or (low >= 128).any():
            raise SpecError("base-3 digits of the wrong size, or a low byte of 128 or more")
        packed = np.frombuffer(rest, np.uint8).astype(np.uint16)
        digits = (packed[:, None] // np.array([81, 27, 9, 3, 1], np.uint16)) % 3
        values |= digits.reshape(-1)[:n] << 7
    else:
        order = high_bit_order(low, E - 256, hp, segments)
        values[order] |= unpack_bits(rest, order.size).astype(np.uint16) << 8
    return values


def undo_transform(xf: int, values: np.ndarray, M: int, T: int, K: int) -> np.ndarray:
    """Layer-major ids ``[M, T, K]`` from the values of row transform ``xf`` (not keep)."""
    if xf == TOKENS:
        return values.reshape(T, M, K).transpose(1, 0, 2)
    v = values.reshape(M, T, K)
    if xf == PLAIN:
        return v
    if xf == DELTA:  # wrapping sums in the values' own width: mod 2^bits
        return np.cumsum(v, axis=1, dtype=v.dtype)
    if xf == GAPS:
        ids = v.copy()
        for j in range(1, K):
            ids[..., j] = ids[..., j - 1] + ids[..., j] + v.dtype.type(1)
        return ids
    raise SpecError(f"unknown row transform {xf}")


def decode_rows(rows: bytes, M: int, T: int, K: int, E: int, xf: int, hp: int) -> np.ndarray:
    """Layer-major ids ``[M, T, K]`` from a body's rows."""
    if xf != KEEP:
        segments = [M * T * K] if xf == TOKENS else [T * K] * M
        values = read_values(rows, M * T * K, E, hp, segments)
        return undo_transform(xf, values, M, T, K)
    n_bits = M * K * T
    change = unpack_bits(rows[: (n_bits + 7) // 8], n_bits)
    streams = change.reshape(M * K, T)
    if T and not streams[:, 0].all():
        raise SpecError("a keep stream without its first id")
    per_layer = change.reshape(M, K * T).sum(axis=1).tolist()
    values = read_values(rows[(n_bits + 7) // 8 :], int(change.sum()), E, hp, per_layer)
    # Each kept id repeats until the next set bit: position i takes the id of the last set bit.
    ids = values[np.cumsum(change) - 1] if n_bits else values[:0]
    return ids.reshape(M, K, T).transpose(0, 2, 1)


def decode_body(head: dict, frame: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids [T] int64, valid [T] bool, ids [M, T, K]) of a body."""
    T, M, K, E, xf, hp = (head[k] for k in ("T", "M", "K", "E", "xf", "hp"))
    packed_high = 256 < E <= 512 and xf in (PLAIN, KEEP, TOKENS)
    if (hp and not packed_high) or (hp == 3 and E > 384):
        raise SpecError(f"hp {hp} with E {E} under transform {xf}")
    raw = unzstd(frame, head["raw"])
    vb = (T + 7) // 8
    tokens = np.frombuffer(raw[: 4 * T], "<u4").astype(np.int64)
    valid = np.unpackbits(np.frombuffer(raw[4 * T : 4 * T + vb], np.uint8), count=T)
    ids = decode_rows(raw[4 * T + vb :], M, T, K, E, xf, hp)
    if ids.size and int(ids.max()) >= E:
        raise SpecError(f"expert id {int(ids.max())} >= E {E}")
    return tokens, valid.astype(bool), ids


def decode_weights(data: bytes, M: int, T: int, K: int) -> tuple[np.ndarray, str]:
    """(weights [M, T, K] float32, dtype name) of a weights plane."""
    code, coding, raw_len = struct.unpack_from("<BBI", data)
    width = 4 if code == 3 else 2
    if code not in WEIGHT_DTYPES or coding not in (0, 1) or raw_len != M * T * K * width:
        raise SpecError(f"weights plane: dtype {code}, coding {coding}, {raw_len} bytes")
    planes = np.frombuffer(unzstd(data[6:], raw_len), np.uint8).reshape(K, width, M * T)
    bits = np.zeros((K, M * T), np.uint32)
    for byte in range(width):  # most significant byte first
        bits = (bits << 8) | planes[:, byte]
    if coding == 1:  # v[k] = w[k-1] - w[k] mod 2^b, so w[k] = w[k-1] - v[k]
        for k in range(1, K):
            bits[k] = (bits[k - 1] - bits[k]) & ((1 << (8 * width)) - 1)
    bits = bits.reshape(K, M, T).transpose(1, 2, 0)
    if code == 1:
        values = (bits << 16).view(np.float32)
    elif code == 2:
        values = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    else:
        values = bits.view(np.float32)
    return values, WEIGHT_DTYPES[code]


@dataclass
class Read:
    """A decoded record: ``ids`` and ``weights`` token-major ``[T, M, K]``."""

    tokens: np.ndarray
    valid: np.ndarray
    ids: np.ndarray
    fields: dict
    weights: np.ndarray | None = None
    weights_dtype: str | None = None
    chunks_read: list[bytes] = field(default_factory=list)


def weights_dtype(fields: dict) -> str | None:
    """The dtype the ``planes`` list gives the weights plane; None: no weights plane."""
    for plane in fields["planes"]:
        if plane["required"] and plane["name"] not in ("ids", "weights"):
            raise SpecError(f"requires the unknown plane {plane['name']!r}")
    named = [x["dtype"] for x in fields["planes"] if x["name"] == "weights"]
    return named[0] if named else None


def read_record(blob: bytes) -> Read:
    p = msgpack.unpackb(unframe(blob, RECORD), raw=False)
    tokens, valid, ids = decode_body(p, p["body"])
    out = Read(tokens, valid, ids.transpose(1, 0, 2), p)
    dtype = weights_dtype(p)
    if dtype is not None:
        w, got = decode_weights(p["weights"], p["M"], p["T"], p["K"])
        if got != dtype:
            raise SpecError(f"weights stored as {got}, planes say {dtype}")
        out.weights, out.weights_dtype = w.transpose(1, 0, 2), dtype
    return out


def chain_seed(m: dict) -> bytes:
    version = m["wv"][0][0] if m.get("wv") else None
    shape = [m["model"], m["E"], m["K"], m["moe"], m["bs"], version]
    return H(b"routereplay-chain-1" + msgpack.packb(shape))


@dataclass
class Chunk:
    tokens: np.ndarray
    valid: np.ndarray
    ids: np.ndarray  # [M, T, K]
    E: int
    prev_chain: bytes
    chain: bytes
    sections: dict[str, bytes]


def read_sections(data: bytes, count: int) -> dict[str, bytes]:
    out, pos = {}, 0
    for _ in range(count):
        name_len = data[pos]
        name = data[pos + 1 : pos + 1 + name_len].decode()
        (size,) = struct.unpack_from("<I", data, pos + 1 + name_len)
        pos += 1 + name_len + 4
        out[name] = data[pos : pos + size]
        pos += size
    if pos != len(data):
        raise SpecError("extra sections do not fill the chunk")
    return out


def read_chunk(blob: bytes, address: bytes) -> Chunk:
    """A chunk, checked against its address (its checksum is not what makes it valid)."""
    payload = unframe(blob, CHUNK, check_crc=False)
    T, E, M, K, xf, hp, flags, n_extra, prev, raw, body_len = struct.unpack_from(
        "<IIHHBBBB16sII", payload
    )
    if flags & ~1:
        raise SpecError(f"unknown chunk flags {flags}")
    head = {"T": T, "M": M, "K": K, "E": E, "xf": xf, "hp": hp, "raw": raw}
    tokens, valid, ids = decode_body(head, payload[40 : 40 + body_len])
    extra = payload[40 + body_len :]
    chain = H(prev + tokens.astype("<u4").tobytes())
    rows = np.ascontiguousarray(ids).astype("<u1" if E <= 256 else "<u2").tobytes()
    if H(rows + chain + np.packbits(valid).tobytes() + extra) != address:
        raise SpecError(f"chunk {address.hex()}: content does not match its address")
    return Chunk(tokens, valid, ids, E, prev, chain, read_sections(extra, n_extra))


def read_stored(route_id: str, manifest: bytes, chunks: dict[bytes, bytes]) -> Read:
    """A record from its manifest and chunks (addresses, token chain and shapes checked)."""
    m = msgpack.unpackb(unframe(manifest, MANIFEST), raw=False)
    if m["id"] != route_id or len(m["chunks"]) != -(-m["T"] // m["bs"]):
        raise SpecError(f"manifest of {m['id']!r}, read as {route_id!r}, or chunks miscounted")
    dtype = weights_dtype(m)
    parts: list[Chunk] = []
    prev = chain_seed(m)
    for i, address in enumerate(m["chunks"]):
        c = read_chunk(chunks[address], address)
        want = (m["M"], min(m["bs"], m["T"] - i * m["bs"]), m["K"])
        if c.prev_chain != prev or c.ids.shape != want or c.E != m["E"]:
            raise SpecError(f"chunk {i} does not continue the chain, or is not {want}, E {m['E']}")
        prev = c.chain
        parts.append(c)
    ids = np.concatenate([c.ids for c in parts], axis=1).transpose(1, 0, 2)
    out = Read(np.concatenate([c.tokens for c in parts]), np.concatenate([c.valid for c in parts]),
               ids, m, chunks_read=list(m["chunks"]))  # fmt: skip
    if dtype is not None:
        planes = [decode_weights(c.sections["weights"], *c.ids.shape) for c in parts]
        if any(got != dtype for _, got in planes):
            raise SpecError(f"a chunk's weights are not the manifest's {dtype}")
        out.weights = np.concatenate([w for w, _ in planes], axis=1).transpose(1, 0, 2)
        out.weights_dtype = dtype
    return out


# ---------------------------------------------------------------------------------------------
# The tests: the reader against the golden files' expectations and routereplay's decode
# ---------------------------------------------------------------------------------------------
GOLDEN = Path(__file__).with_name("golden")
FILES = ["format1.msgpack", "format1-weights.msgpack", "format1-more.msgpack"]


def _load(name: str) -> dict:
    return msgpack.unpackb((GOLDEN / name).read_bytes(), raw=False, strict_map_key=False)


def _arr(a: dict) -> np.ndarray:
    return np.frombuffer(a["data"], np.dtype(a["dtype"])).reshape(a["shape"])


def _same_as_expected(got: Read, e: dict, canonical: bool) -> None:
    assert np.array_equal(got.tokens, _arr(e["token_ids"]))
    assert np.array_equal(got.valid, _arr(e["valid"]))
    want = _arr(e["experts"])
    want = np.sort(want, axis=2) if canonical else want
    assert got.ids.dtype == want.dtype and np.array_equal(got.ids, want)
    f = got.fields
    assert (f["moe"], f["L"], f["E"]) == (e["moe_layers"], e["num_layers"], e["num_experts"])
    assert (f["pl"], f["nc"], f["model"]) == (e["prompt_len"], e["num_cached_tokens"], e["model"])
    assert f.get("meta", {}) == e["metadata"] and f.get("wv", []) == e["weight_versions"]
    if "weights" in e:
        assert got.weights_dtype == e["weights_dtype"]
        assert np.array_equal(got.weights.view(np.uint32), _arr(e["weights"]).view(np.uint32))
    else:
        assert got.weights is None


def _same_as_routereplay(got: Read, rec) -> None:
    assert np.array_equal(got.tokens, rec.token_ids) and np.array_equal(got.valid, rec.valid)
    assert got.ids.dtype == rec.experts.dtype and np.array_equal(got.ids, rec.experts)
    assert got.weights_dtype == rec.weights_dtype
    if rec.weights is not None:
        assert np.array_equal(got.weights.view(np.uint32), rec.weights.view(np.uint32))


@pytest.mark.parametrize("name", FILES)
def test_the_spec_reader_reads_every_record_blob(name: str) -> None:
    from routereplay.client import decode_record

    doc = _load(name)
    for rid, blob in doc["records"].items():
        got = read_record(blob)
        _same_as_expected(got, doc["expect"][rid], got.fields["canon"])
        _same_as_routereplay(got, decode_record(blob))


@pytest.mark.parametrize("name", FILES)
def test_the_spec_reader_reads_every_stored_record_and_chunk(name: str) -> None:
    from routereplay.client._layout import finish_read, plan_read

    doc = _load(name)
    ids = sorted(doc["manifests"])
    theirs = finish_read(plan_read(ids, [doc["manifests"][i] for i in ids]), doc["chunks"])
    read: set[bytes] = set()
    for rid, rec in zip(ids, theirs, strict=True):
        got = read_stored(rid, doc["manifests"][rid], doc["chunks"])
        _same_as_expected(got, doc["expect"][rid], got.fields["canon"])
        _same_as_routereplay(got, rec)
        read.update(got.chunks_read)
    assert read == set(doc["chunks"])  # every chunk of the file, its address checked


def _one_chunk() -> tuple[bytes, bytes]:
    doc = _load("format1-weights.msgpack")
    address = msgpack.unpackb(unframe(doc["manifests"]["fp16"], MANIFEST))["chunks"][0]
    return address, doc["chunks"][address]


def test_a_chunk_with_a_wrong_checksum_and_its_address_reads_in_both() -> None:
    from routereplay.client._chunks import decode_chunks

    address, blob = _one_chunk()
    bad = blob[:12] + bytes([blob[12] ^ 0xFF]) + blob[13:]  # the CRC's first byte
    with pytest.raises(SpecError, match="checksum"):
        unframe(bad, CHUNK)
    read_chunk(bad, address)
    (block,) = decode_chunks([(address, bad)])
    assert np.array_equal(block.experts, read_chunk(blob, address).ids)


def test_an_unknown_extra_section_is_hashed_with_its_header_and_skipped() -> None:
    """A chunk with one more section, addressed as the spec says, reads in both readers."""
    from routereplay.client._chunks import decode_chunks

    address, blob = _one_chunk()
    section = bytes([5]) + b"later" + struct.pack("<I", 3) + b"abc"
    payload = bytearray(blob[16:] + section)
    payload[15] += 1  # n_extra
    grown = struct.pack("<4sBBHII", b"RRTE", 1, CHUNK, 0, len(payload), zlib.crc32(payload))
    grown += bytes(payload)
    c = read_chunk(blob, address)
    rows = np.ascontiguousarray(c.ids).astype("<u1").tobytes()
    extra = bytes(payload[40 + struct.unpack_from("<I", payload, 36)[0] :])
    address = H(rows + c.chain + np.packbits(c.valid).tobytes() + extra)
    assert read_chunk(grown, address).sections["later"] == b"abc"
    (block,) = decode_chunks([(address, grown)])
    assert np.array_equal(block.experts, c.ids) and block.weights is not None
