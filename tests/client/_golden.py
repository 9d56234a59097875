"""Reading the checked-in golden files (tests/client/golden/, written by generate.py)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np

GOLDEN_DIR = Path(__file__).with_name("golden")


def load_golden(name: str) -> dict:
    """The contents of ``golden/NAME``: records, manifests, chunks and what they hold."""
    return msgpack.unpackb((GOLDEN_DIR / name).read_bytes(), raw=False, strict_map_key=False)


def golden_array(a: dict) -> np.ndarray:
    """An array as generate.py stores it: ``{"data", "dtype", "shape"}``."""
    return np.frombuffer(a["data"], np.dtype(a["dtype"])).reshape(a["shape"])
