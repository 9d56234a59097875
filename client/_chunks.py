"""Store chunks: their binary form, and decoding them in batches, each checked against its
content address (docs/CONTRACTS.md, "Chunk").

A chunk's payload starts with a fixed header (no map to parse per chunk: a training step's read
decodes ~1500 of them)::

    T u32 | E u32 | M u16 | K u16 | xf u8 | hp u8 | flags u8 | extra_planes u8
    | prev_chain 16 bytes | raw_len u32 | body_len u32 | body | extra plane sections

The one extra plane this library writes and reads is ``weights`` (``_weights``).

Decoding a batch: each chunk's frame and header are checked and its body decompressed (zstd
releases the GIL), then the bodies that need a ``keep`` join are joined in one numpy call per
shape, and each chunk's rows are hashed (BLAKE3 releases the GIL) and compared with its address.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Executor, Future
from typing import NamedTuple

import numpy as np

from ._address import chunk_digest, next_chain
from ._body import Block, BodyHead, Parsed, decompress, join_parsed, parse_body
from ._errors import RouteCorruptError, RouteError
from ._frame import HEADER, KIND_CHUNK, check_crc, check_header, check_short, frame
from ._weights import WEIGHTS, decode_weights

_CHUNK = struct.Struct("<IIHHBBBB16sII")
_HEAD = struct.Struct(HEADER.format + _CHUNK.format[1:])  # the frame's header, then the chunk's
_SECTION = struct.Struct("<I")
# What numpy and struct raise on bytes that slipped past a check: never out of a read, whose
# ids each get their own error.
MALFORMED = (ArithmeticError, IndexError, KeyError, TypeError, ValueError)
_CANONICAL = 1


class ChunkShape(NamedTuple):
    """The shape a chunk must declare: ``T`` rows of ``M`` layers x ``K`` ids below ``E``."""

    T: int
    M: int
    K: int
    E: int


def chunk_blob(
    head: BodyHead, body: bytes, prev_chain: bytes, extra: Sequence[tuple[str, bytes]] = ()
) -> bytes:
    """A chunk's blob: its header, body and ``extra`` plane sections (name, stored bytes)."""
    sections = sections_bytes(extra)
    fixed = _CHUNK.pack(
        head.T, head.E, head.M, head.K, head.xf, head.hp, _CANONICAL if head.canonical else 0,
        len(extra), prev_chain, head.raw_len, len(body),
    )  # fmt: skip
    return frame(KIND_CHUNK, fixed + body + sections)


def _section(name: str, data: bytes) -> bytes:
    raw = name.encode()
    return bytes([len(raw)]) + raw + _SECTION.pack(len(data)) + data


def sections_bytes(extra: Sequence[tuple[str, bytes]]) -> bytes:
    """The extra plane sections as stored (what a chunk's address covers)."""
    return b"".join(_section(name, data) for name, data in extra)


def _sections(data: memoryview, count: int, what: str) -> dict[str, memoryview]:
    """The ``count`` extra plane sections that ``data`` must be exactly, by name."""
    pos = 0
    out: dict[str, memoryview] = {}
    for _ in range(count):
        if pos >= len(data):
            raise RouteCorruptError(f"{what}: extra plane sections end early")
        name = bytes(data[pos + 1 : pos + 1 + data[pos]])
        pos += 1 + data[pos]
        if pos + 4 > len(data):
            raise RouteCorruptError(f"{what}: extra plane section truncated")
        (size,) = _SECTION.unpack_from(data, pos)
        out[name.decode("utf-8", "replace")] = data[pos + 4 : pos + 4 + size]
        pos += 4 + size
    if pos != len(data):
        raise RouteCorruptError(f"{what}: extra plane sections do not fill the chunk")
    return out


class _Pending:
    """A chunk whose body is parsed, waiting for its batch's joins and its address check."""

    __slots__ = ("crc", "digest", "extra", "parsed", "payload", "prev", "weights")

    def __init__(
        self, digest: bytes, parsed: Parsed, prev: bytes, extra: memoryview, payload, crc
    ) -> None:
        self.digest, self.parsed, self.prev, self.extra = digest, parsed, prev, extra
        self.payload, self.crc = payload, crc
        self.weights: memoryview | None = None


def _parse(digest: bytes, blob: bytes, what: str, want: ChunkShape | None) -> _Pending:
    mv = memoryview(blob)
    if len(mv) < _HEAD.size:
        if len(mv) < HEADER.size:
            check_short(mv, what)
        magic, version, kind, _, plen, _ = HEADER.unpack_from(mv)
        check_header(magic, version, kind, len(mv), plen, KIND_CHUNK, what)
        raise RouteCorruptError(f"{what}: payload shorter than a chunk header")
    f = _HEAD.unpack_from(mv)
    check_header(f[0], f[1], f[2], len(mv), f[4], KIND_CHUNK, what)
    T, E, M, K, xf, hp, flags, n_extra, prev, raw_len, body_len = f[6:]
    if flags & ~_CANONICAL:
        raise RouteCorruptError(f"{what}: unknown chunk flags {flags:#x}")
    if want is not None and (T, M, K, E) != want:
        raise RouteCorruptError(
            f"{what}: declares T={T}, M={M}, K={K}, E={E}; its manifest needs "
            f"T={want.T}, M={want.M}, K={want.K}, E={want.E}"
        )
    head = BodyHead(T, M, K, E, xf, hp, bool(flags), raw_len)
    head.check(what)
    end = _HEAD.size + body_len
    if end > len(mv):
        raise RouteCorruptError(f"{what}: body of {body_len} bytes runs past the chunk")
    extra = mv[end:]
    planes = _sections(extra, n_extra, what)
    parsed = parse_body(head, decompress(head, mv[_HEAD.size : end], what), what)
    p = _Pending(digest, parsed, prev, extra, mv[HEADER.size :], f[5])
    p.weights = planes.get(WEIGHTS)
    return p


def _finish(p: _Pending, lm: np.ndarray, what: str) -> Block:
    """Check the chunk's rows against its address; the block, its chain and largest id kept."""
    parsed = p.parsed
    chain = next_chain(p.prev, parsed.token_bytes)
    if chunk_digest(chain, parsed.valid, lm, p.extra) != p.digest:
        raise RouteCorruptError(
            f"{what}: content does not match its address (a chunk stored under another chunk's "
            "key, or altered bytes)"
        )
    top = int(lm.max()) if lm.size else -1
    blk = Block(parsed.token_ids, lm, parsed.valid, parsed.head.canonical, p.prev, chain, top)
    if p.weights is not None:  # decoded once its bytes are known to be the address's
        blk.weights, blk.weights_dtype = decode_weights(p.weights, lm.shape, what)
    return blk


def _named(p: _Pending | None, blob: bytes, exc: RouteCorruptError, what: str) -> RouteError:
    """A failed chunk's error, named as altered bytes where its checksum says so."""
    try:
        if p is not None:
            check_crc(p.payload, p.crc, what)
        elif len(blob) >= HEADER.size:
            crc = HEADER.unpack_from(blob)[5]
            check_crc(memoryview(blob)[HEADER.size :], crc, what)
    except RouteCorruptError as crc_exc:
        return crc_exc
    return exc


def decode_chunks(
    items: Sequence[tuple[bytes, bytes | None]], shapes: Mapping[bytes, ChunkShape] | None = None
) -> list[Block | RouteError | None]:
    """Decode ``(address, blob)`` pairs (None: no blob) into checked blocks, or each chunk's
    error. ``shapes``: the shape each chunk must declare (see :class:`ChunkShape`), checked
    before it is decompressed. A bad chunk never fails the others."""
    out: list[Block | RouteError | None] = [None] * len(items)
    pending: list[tuple[int, _Pending]] = []
    for i, (digest, blob) in enumerate(items):
        if blob is None:
            continue
        what = f"chunk {digest.hex()}"
        try:
            pending.append((i, _parse(digest, blob, what, shapes and shapes.get(digest))))
        except RouteCorruptError as exc:
            out[i] = _named(None, blob, exc, what)
        except RouteError as exc:
            out[i] = exc
        except MALFORMED as exc:
            out[i] = RouteCorruptError(f"{what}: malformed: {exc!r}")
    whats = [f"chunk {p.digest.hex()}" for _, p in pending]
    rows = join_parsed([p.parsed for _, p in pending], whats)
    for (i, p), lm, what in zip(pending, rows, whats, strict=True):
        try:
            if isinstance(lm, RouteCorruptError):
                raise lm
            out[i] = _finish(p, lm, what)
        except RouteCorruptError as exc:
            out[i] = _named(p, b"", exc, what)
        except MALFORMED as exc:
            out[i] = RouteCorruptError(f"{what}: malformed: {exc!r}")
    return out


def _split(items: list, parts: int) -> list[list]:
    k = -(-len(items) // max(1, parts))
    return [items[i : i + k] for i in range(0, len(items), k)] if items else []


class ChunkDecoder(Mapping[bytes, "Block | RouteError | None"]):
    """Decodes chunks (checked against their addresses) as their bytes arrive; a mapping from
    address to the decoded :class:`Block`, the chunk's error, or None (no bytes).

    With a thread pool each batch is split among its workers, so chunks decode in parallel
    (zstd, BLAKE3 and numpy's large loops release the GIL) while the caller waits on Redis for
    the next batch; looking a chunk up waits only for the part holding it, and :meth:`wait`
    for every part. Without a pool, chunks decode on the caller's thread as they are added.
    """

    def __init__(
        self,
        pool: Executor | None = None,
        parts: int = 1,
        shapes: Mapping[bytes, ChunkShape] | None = None,
    ) -> None:
        self.pool = pool
        self.parts = parts
        self.shapes = shapes
        self._done: dict[bytes, Block | RouteError | None] = {}
        self._pending: dict[bytes, Future[list[Block | RouteError | None]]] = {}
        self._members: dict[Future[list[Block | RouteError | None]], list[bytes]] = {}

    def add(self, digests: Sequence[bytes], blobs: Sequence[bytes | None]) -> None:
        items = list(zip(digests, blobs, strict=True))
        if self.pool is None or len(items) < 2:
            self._done.update(zip(digests, decode_chunks(items, self.shapes), strict=True))
            return
        for part in _split(items, self.parts):
            fut = self.pool.submit(decode_chunks, part, self.shapes)
            self._members[fut] = [d for d, _ in part]
            self._pending.update((d, fut) for d, _ in part)

    def wait(self) -> None:
        """Return once every chunk added so far is decoded."""
        if self._members:
            futures.wait(list(self._members))

    def __getitem__(self, digest: bytes) -> Block | RouteError | None:
        if digest not in self._done:
            fut = self._pending[digest]  # KeyError: a chunk never added
            self._done.update(zip(self._members.pop(fut), fut.result(), strict=True))
        return self._done[digest]

    def take(self, digests: Sequence[bytes]) -> list[Block | RouteError | None]:
        """``[self[d] for d in digests]`` with one dictionary lookup each once decoded."""
        done = self._done
        for d in digests:
            if d not in done:
                self[d]  # waits for the part holding it
        return [done[d] for d in digests]

    def __iter__(self) -> Iterator[bytes]:
        yield from self._done
        yield from (d for d in self._pending if d not in self._done)

    def __len__(self) -> int:
        return len(self._done) + sum(1 for d in self._pending if d not in self._done)
