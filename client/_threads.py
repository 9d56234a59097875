"""How many threads the client's and the adapter's parallel parts use. A module of its own, with
no Redis import, so that the trainer adapter can use it where only the codec is installed (the
GPU checks stage that subset: tests/gpu/_common.sh)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["DecodePool", "default_decode_threads"]


def default_decode_threads() -> int:
    """Decode threads a store uses unless told: the CPUs this process may run on, up to 8
    (a trainer host runs one reader per GPU; on a 16-core host 8 threads decode a 256k-token
    step's chunks faster than 4, docs/benchmarks.md)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


class DecodePool:
    """The decode threads of one reader (a store, an HTTP client): started on the first read,
    so a writer never starts them; None with fewer than 2 threads (decode on the caller's)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor | None:
        if self.threads < 2:
            return None
        with self._lock:
            # A forked child (a DataLoader worker, say) inherits the pool object but none of its
            # threads: work submitted there would never run, so the child makes its own.
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(
                    self.threads, thread_name_prefix="routereplay-decode"
                )
                self._pid = os.getpid()
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
