"""The ``weights`` plane: the routing weights an engine applied to the chosen experts, bit-exact
in the engine's dtype (docs/CONTRACTS.md, "Weights plane").

A plane holds the weights of a block's rows layer-major ``[M, T, K]``, like its ids, as::

    dtype u8 | coding u8 | raw_len u32 | zstd frame of raw_len bytes

The values are stored in their engine dtype (2 bytes for bfloat16 / float16) split into byte
planes, most significant byte first: a weight's sign and exponent vary little and compress
well apart from its mantissa bits, which are near random.
"""

from __future__ import annotations

import struct

import numpy as np

from ._errors import RouteCorruptError, RouteShapeError
from ._zstd import compress, zd

__all__ = ["WEIGHTS_DTYPES", "check_weights", "decode_weights", "encode_weights"]

# The dtype names a record may carry, and the code each is stored as.
WEIGHTS_DTYPES = {"bfloat16": 1, "float16": 2, "float32": 3}
_DTYPE_NAMES = {v: k for k, v in WEIGHTS_DTYPES.items()}
_WIDTH = {1: 2, 2: 2, 3: 4}
_HEAD = struct.Struct("<BBI")
_BYTE_PLANES = 0  # coding 0: byte planes, most significant first, one zstd frame


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
    back = _values(_bits(weights, code), code)
    bad = np.flatnonzero(back.view(np.uint32) != weights.view(np.uint32))
    if bad.size:
        v = float(weights.reshape(-1)[bad[0]])
        raise RouteShapeError(f"weights hold {v!r}, which is not exactly a {dtype} value")


def encode_weights(weights_lm: np.ndarray, dtype: str) -> bytes:
    """The plane's bytes for layer-major float32 weights ``[M, T, K]`` stored as ``dtype``."""
    code = WEIGHTS_DTYPES[dtype]
    bits = _bits(np.ascontiguousarray(weights_lm, dtype=np.float32), code).reshape(-1)
    width = _WIDTH[code]
    # Byte planes, most significant first: row j of the [width, n] transpose is byte width-1-j.
    planes = bits.view(np.uint8).reshape(-1, width)[:, ::-1].T
    segments = [np.ascontiguousarray(p).tobytes() for p in planes]
    raw_len = sum(len(s) for s in segments)
    return _HEAD.pack(code, _BYTE_PLANES, raw_len) + compress(segments)


def decode_weights(
    data: bytes | memoryview, shape: tuple[int, int, int], what: str
) -> tuple[np.ndarray, str]:
    """``(weights [M, T, K] float32, dtype name)`` from a plane's bytes, every size checked."""
    mv = memoryview(data)
    if len(mv) < _HEAD.size:
        raise RouteCorruptError(f"{what}: weights plane shorter than its header")
    code, coding, raw_len = _HEAD.unpack_from(mv)
    if code not in _DTYPE_NAMES or coding != _BYTE_PLANES:
        raise RouteCorruptError(f"{what}: weights plane dtype {code} / coding {coding} unknown")
    width = _WIDTH[code]
    n = shape[0] * shape[1] * shape[2]
    if raw_len != n * width:
        raise RouteCorruptError(
            f"{what}: weights plane holds {raw_len} bytes, {n} weights need {n * width}"
        )
    body = mv[_HEAD.size :]
    try:
        raw = zd().decompress(body, max_output_size=raw_len) if raw_len else b""
    except Exception as exc:  # zstandard.ZstdError, or a size claim it cannot allocate
        raise RouteCorruptError(f"{what}: weights plane is corrupted: {exc}") from exc
    if len(raw) != raw_len:
        raise RouteCorruptError(f"{what}: weights plane holds {len(raw)} bytes, not {raw_len}")
    planes = np.frombuffer(raw, np.uint8).reshape(width, n)
    le = np.ascontiguousarray(planes[::-1].T)  # back to little-endian values
    bits = le.view(np.uint16 if width == 2 else np.uint32).reshape(shape)
    return _values(bits, code), _DTYPE_NAMES[code]
