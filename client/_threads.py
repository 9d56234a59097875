"""How many threads the client's and the adapter's parallel parts use. A module of its own, with
no Redis import, so that the trainer adapter can use it where only the codec is installed (the
GPU checks stage that subset: tests/gpu/_common.sh)."""

from __future__ import annotations

import os

__all__ = ["default_decode_threads"]


def default_decode_threads() -> int:
    """Decode threads a store uses unless told: the CPUs this process may run on, up to 8
    (a trainer host runs one reader per GPU; on a 16-core host 8 threads decode a 256k-token
    step's chunks faster than 4, docs/benchmarks.md)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))
