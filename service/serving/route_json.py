"""A route record as ``RouteJSON`` bytes, rendered with the GIL free where it can be.

The integer and boolean lists (token ids, expert ids, validity) are written by numpy as
fixed-width fields (numbers right-aligned in spaces, which JSON allows between values), so a
page of a long route is a few array copies that release the GIL rather than millions of Python
objects built and printed under it: the event loop that serves every stream keeps running while
a route renders in a worker. The routing weights, floats whose exact values matter, are printed by
Python's ``repr`` a few rows at a time.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from routereplay.client import RouteRecord

__all__ = ["route_json"]

_SPACE, _COMMA, _OPEN, _CLOSE = (ord(c) for c in " ,[]")
_BOOLS = np.frombuffer(b"false true", dtype=np.uint8).reshape(2, 5)
# Weight rows printed per step: each step holds the GIL for a few milliseconds.
_FLOAT_STEP_ROWS = 64


def _digits(a: np.ndarray) -> np.ndarray:
    """Integers ``a >= 0`` as ASCII fields ``[..., w]``: right-aligned in spaces, ``w``
    the widest number's digits."""
    v = a.astype(np.int64)
    w = len(str(int(v.max()) if v.size else 0))
    out = np.empty((*v.shape, w), dtype=np.uint8)
    rest = v.copy()
    for j in range(w - 1, -1, -1):
        out[..., j] = rest % 10 + ord("0")
        rest //= 10
        if j < w - 1:  # a leading zero is a space
            out[..., j][v < 10 ** (w - 1 - j)] = _SPACE
    return out


def _join(fields: np.ndarray) -> np.ndarray:
    """Fields ``[..., n, w]`` -> one JSON list per leading index: ``[..., n * (w + 1) + 1]``."""
    *lead, n, w = fields.shape
    if n == 0:
        return np.broadcast_to(np.array([_OPEN, _CLOSE], dtype=np.uint8), (*lead, 2)).copy()
    out = np.empty((*lead, n, w + 1), dtype=np.uint8)
    out[..., :w] = fields
    out[..., w] = _COMMA
    flat = out.reshape(*lead, n * (w + 1))
    body = np.empty((*lead, n * (w + 1) + 1), dtype=np.uint8)
    body[..., 0] = _OPEN
    body[..., 1:] = flat
    body[..., -1] = _CLOSE  # the last comma's place
    return body


def _int_list(a: np.ndarray) -> bytes:
    """Integers ``a >= 0`` (any shape; a record holds no negative one) as their nested JSON
    list."""
    text = _digits(a)
    while text.ndim > 1:
        text = _join(text)
    return text.tobytes()


def _float_list(a: np.ndarray) -> bytes:
    """Floats as Python prints them (the shortest text that reads back the same value)."""
    steps = (
        json.dumps(a[i : i + _FLOAT_STEP_ROWS].tolist())[1:-1]
        for i in range(0, len(a), _FLOAT_STEP_ROWS)
    )
    return ("[" + ",".join(steps) + "]").encode()


def route_json(route_id: str, rec: RouteRecord) -> bytes:
    """``rec`` as ``RouteJSON``'s body (run it in a worker thread: its cost grows with the
    route)."""
    head: dict[str, Any] = {
        "route_id": route_id,
        "model": rec.model,
        "moe_layers": list(rec.moe_layers),
        "num_layers": rec.num_layers,
        "num_experts": rec.num_experts,
        "prompt_len": rec.prompt_len,
        "num_cached_tokens": rec.num_cached_tokens,
        "metadata": rec.metadata,
        "weight_versions": [list(span) for span in rec.weight_versions],
    }
    lists = {
        "token_ids": _int_list(rec.token_ids),
        "experts": _int_list(rec.experts),
        "valid": _join(_BOOLS[rec.valid.astype(np.intp)]).tobytes(),
    }
    if rec.weights is not None:
        # The routing weights' exact values (float32 holds every bf16/fp16 one) and their dtype.
        head["weights_dtype"] = rec.weights_dtype
        lists["weights"] = _float_list(rec.weights)
    parts = [json.dumps(head)[:-1].encode()]
    parts += [b", " + json.dumps(k).encode() + b": " + v for k, v in lists.items()]
    return b"".join(parts) + b"}"
