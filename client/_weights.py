"""The ``weights`` plane: the routing weights an engine applied to the chosen experts, bit-exact
in the engine's dtype (docs/CONTRACTS.md, "Weights plane").

A plane holds the weights of a block's rows ``[M, T, K]`` (layer-major, like its ids) as::

    dtype u8 | coding u8 | raw_len u32 | zstd frame of raw_len bytes

Each value is stored as its bit pattern in the engine dtype (2 bytes for bfloat16 / float16),
slot by slot: for each slot k, its ``M * T`` values' most significant bytes, then the next
bytes, each byte plane its own zstd block (sign and exponent vary little, the low mantissa bits
are near random: apart, each gets its own code). Coding 1 stores slot k > 0 as the difference
from slot k - 1 (mod 2^bits): engines emit the top-k slots by descending score, so positive
weights fall slot by slot and the differences are small; coding 0 stores the values as they are,
for rows that do not fall.
"""

from __future__ import annotations

import struct

import numpy as np

from ._errors import RouteCorruptError, RouteShapeError
from ._zstd import compress, decompress_exact

__all__ = ["WEIGHTS", "WEIGHTS_DTYPES", "check_weights", "decode_weights", "encode_weights"]

# The plane's name: in a record's or manifest's plane list, a record's payload field, and a
# store chunk's extra section.
WEIGHTS = "weights"
# The dtype names a record may carry, and the code each is stored as.
WEIGHTS_DTYPES = {"bfloat16": 1, "float16": 2, "float32": 3}
_DTYPE_NAMES = {v: k for k, v in WEIGHTS_DTYPES.items()}
_WIDTH = {1: 2, 2: 2, 3: 4}
_HEAD = struct.Struct("<BBI")
_PLAIN, _SLOT_DELTA = 0, 1
# Coding 1 is worth it where most slots fall (an engine's sorted top-k); measured on softmax
# top-8 weights it takes ~20% off coding 0.
_FALLING = 0.75


def _bits(values: np.ndarray, code: int) -> np.ndarray:
    """The stored bit patterns of float32 ``values`` in the dtype ``code`` (exact values)."""
    if code == 1:  # bfloat16 is float32's high half
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    if code == 2:
        return values.astype(np.float16).view(np.uint16)
    return values.view(np.uint32)


def _values(bits: np.ndarray, code: int) -> np.ndarray:
    """float32 values of stored bit patterns (inverse of :func:`_bits`)."""
    if code == 1:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if code == 2:
        return bits.view(np.float16).astype(np.float32)
    return bits.view(np.float32)


def check_weights(weights: np.ndarray, dtype: str | None) -> None:
    """Raise :class:`RouteShapeError` unless ``weights`` (float32) hold only values of ``dtype``."""
    code = WEIGHTS_DTYPES.get(dtype)  # type: ignore[arg-type]
    if code is None:
        raise RouteShapeError(
            f"weights_dtype must be one of {sorted(WEIGHTS_DTYPES)}, got {dtype!r}"
        )
    if code == 3 or not weights.size:
        return
    u = weights.view(np.uint32)
    if code == 1:  # a bfloat16 value is a float32 whose low 16 bits are 0
        bad = (u & np.uint32(0xFFFF)) != 0
    else:
        bad = _values(_bits(weights, code), code).view(np.uint32) != u
    # Elementwise in the array's memory order (a stored record's weights are a strided view):
    # no copy, and the position is looked up only on failure.
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise RouteShapeError(
            f"weights{list(at)} = {float(weights[at])!r} is not exactly a {dtype} value"
        )


def encode_weights(weights_lm: np.ndarray, dtype: str) -> bytes:
    """The plane's bytes for layer-major float32 weights ``[M, T, K]`` stored as ``dtype``."""
    code = WEIGHTS_DTYPES[dtype]
    bits = _bits(np.asarray(weights_lm, dtype=np.float32), code)  # [M, T, K], any layout
    slots = np.ascontiguousarray(np.moveaxis(bits, 2, 0)).reshape(bits.shape[2], -1)  # [K, M*T]
    coding = _PLAIN
    if slots.shape[0] > 1 and slots.shape[1] and (slots[:-1] >= slots[1:]).mean() >= _FALLING:
        coding = _SLOT_DELTA
        slots = np.concatenate([slots[:1], slots[:-1] - slots[1:]])  # wraps: mod 2^bits
    width = _WIDTH[code]
    # Byte planes, most significant first: slot by slot, each plane its own zstd block.
    segments = [
        (slot >> (8 * j)).astype(np.uint8).tobytes() for slot in slots for j in range(width)[::-1]
    ]
    raw_len = slots.size * width
    return _HEAD.pack(code, coding, raw_len) + compress(segments)


def decode_weights(
    data: bytes | memoryview, shape: tuple[int, int, int], what: str
) -> tuple[np.ndarray, str]:
    """``(weights [M, T, K] float32, dtype name)`` from a plane's bytes, every size checked."""
    mv = memoryview(data)
    if len(mv) < _HEAD.size:
        raise RouteCorruptError(f"{what}: weights plane shorter than its header")
    code, coding, raw_len = _HEAD.unpack_from(mv)
    if code not in _DTYPE_NAMES or coding not in (_PLAIN, _SLOT_DELTA):
        raise RouteCorruptError(f"{what}: weights plane dtype {code} / coding {coding} unknown")
    width = _WIDTH[code]
    M, T, K = shape
    n = M * T * K
    if raw_len != n * width:
        raise RouteCorruptError(
            f"{what}: weights plane holds {raw_len} bytes, {n} weights need {n * width}"
        )
    raw = decompress_exact(mv[_HEAD.size :], raw_len, what, "weights plane") if raw_len else b""
    planes = np.frombuffer(raw, np.uint8).reshape(K, width, M * T)
    slots = np.empty((K, M * T), np.uint16 if width == 2 else np.uint32)
    for k in range(K):
        v = slots[k]
        v[:] = planes[k, 0]
        for j in range(1, width):  # shift in the next, less significant, byte
            v <<= 8
            v |= planes[k, j]
        if coding == _SLOT_DELTA and k:
            v[:] = slots[k - 1] - v  # slot k = slot k - 1 - its difference, mod 2^bits
    # A layer-major [M, T, K] view of the slot-major values: the record's rows are views too.
    bits = slots.reshape(K, M, T).transpose(1, 2, 0)
    return _values(bits, code), _DTYPE_NAMES[code]
