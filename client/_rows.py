"""Copying runs of layer-major expert rows into a step's targets, without the GIL where the
client's compiled kernel is built. A module of its own, with no Redis import, so that the
trainer adapter can use it where only the codec is installed (tests/gpu/_common.sh)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

try:  # the compiled kernel (client/_ckernel.c); optional
    from ._ckernel import copy_runs as _copy_runs
except ImportError:  # not built, or built from an older source
    _copy_runs = None

__all__ = ["copy_row_runs"]

Run = tuple[np.ndarray | tuple[np.ndarray, ...], int, int, int, int, int, int]


def copy_row_runs(out: np.ndarray, runs: Sequence[Run]) -> list[int]:
    """Copy ``src[c0 : c0 + n, x : y, :]`` to ``out[o : o + n, s : s + y - x, :]`` for each run
    ``(src, c0, n, x, y, o, s)`` of ``out`` ``[M, N, K]`` (C-contiguous ids). ``src`` may be a
    tuple of arrays holding a record's rows one after another from row 0 (its chunks,
    :meth:`RouteRecord.layer_major_parts`): ``x : y`` are then rows of the record, and the
    kernel cuts the run at the parts' bounds (one job per span instead of one per chunk).

    Every run is checked before any byte is copied (ValueError naming the first that does not
    fit), then all are copied in one stretch without the GIL: numpy's copies take the GIL back
    between runs, and threads splitting ~2000 of them did not get past ~2x. Returns the indices
    of the runs left to the caller: sources whose rows of one layer are not contiguous (a
    record's token-major rows) or hold other ids, and every run where the kernel is not built.
    """
    if _copy_runs is None:
        return list(range(len(runs)))
    _, N, K = out.shape
    return _copy_runs(out, runs, N, K, out.itemsize)
