"""Ctrl-C stops the service, and the service stops what it started: the engine, a private Redis.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the service, vLLM's engine
core and its worker, and the private redis-server, all at once. Were they to take it, a Ctrl-C
during the engine's start would kill the worker or the engine core mid-import (tracebacks,
"Engine core initialization failed", exit status 3); later, the engine core would begin its own
teardown and the service's SIGTERM a moment after would kill it halfway, once vLLM has reset its
handlers (a forced kill, leaked shared memory, an orphaned worker); and the redis-server would quit
while requests still drain, failing their routes.

So these processes start with SIGINT blocked. A blocked signal stays blocked across fork and exec,
from the child's first instruction on (an ignored one would be undone by the handlers vLLM
installs): they stop when the service stops them (SIGTERM, through ``AsyncLLM.shutdown``, the
redis-server after the drain), as after a signal to the service alone (``kill -INT``, ``docker
stop``). A Ctrl-C pressed while the engine starts reaches the service when the start returns.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from multiprocessing import resource_tracker

__all__ = ["sigint_blocked"]


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread, and in every process started inside the block."""
    # multiprocessing starts its resource tracker at the first spawn and unblocks SIGINT in the
    # calling thread when it has (bpo-33613): start it before blocking.
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        # A SIGINT that came meanwhile is delivered here, to this process's own handler.
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
