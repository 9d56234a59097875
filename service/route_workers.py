"""Where a finished choice's route is built, checked, compressed, written and counted.

The serving process streams tokens under its GIL. A route's record building, digests, zstd,
Redis commands and expert counts, run there, cost it several times the CPU per token that
vLLM's own server spends (docs/benchmarks.md). ``--route-workers N`` runs them in ``N`` worker
processes fed the engine's arrays; ``0`` runs them in threads of the serving process. Both run
:func:`store_choice`, the one implementation of a choice's store, and send back a
:class:`StoreOutcome`: a few numbers and the counts, never the record.

A worker that dies (the OOM killer, a signal) fails the routes it held, each with the error,
and the pool is replaced for the next ones; shutdown waits for every route in flight.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import traceback
from collections import OrderedDict
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from routereplay.client import (
    EngineRoutes,
    ReadLimits,
    RouteError,
    RouteRecord,
    RouteStore,
    StoreAddress,
)

from .engine import ChoiceFinished
from .model_info import ModelInfo
from .routing_stats import VersionCounts, version_counts

__all__ = [
    "ChoiceJob",
    "RouteWorkerError",
    "RouteWorkers",
    "StoreOutcome",
    "build_record",
    "row_spans",
    "store_choice",
]

log = logging.getLogger("routereplay.service")

# Stores a worker keeps open, by address (a tenant's namespace is its own prefix).
_MAX_STORES = 256


class RouteWorkerError(RouteError):
    """The worker process storing a route exited before it answered."""


def row_spans(
    output_spans: list[tuple[str, int, int]] | None, prompt_len: int, num_rows: int
) -> list[tuple[str, int, int]]:
    """The engine's weight-version spans over output tokens, as spans over the record's rows.

    Output token ``i`` is sampled by the forward pass over position ``P + i - 1`` (``P`` the
    prompt length), which also routes row ``P + i - 1``; the prompt's rows are routed by the
    prefill that samples token 0. So rows ``[0, P)`` take token 0's version and row ``P + i``
    token ``i + 1``'s: output span ``[s, e)`` covers rows ``[P + s - 1, P + e - 1)``, the first
    one from row 0 and the last one to the end (the final row is never routed). Unknown -> [].
    """
    spans = [(v, s, e) for v, s, e in output_spans or () if e > s]
    if not spans:
        return []
    out = []
    for n, (v, s, e) in enumerate(spans):
        a = 0 if n == 0 else prompt_len + s - 1
        b = num_rows if n == len(spans) - 1 else prompt_len + e - 1
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], b)
        elif b > a:
            out.append((v, a, b))
    return out


def build_record(
    info: ModelInfo, fin: ChoiceFinished, prompt_token_ids: list[int], request_id: str
) -> RouteRecord:
    """The record of one choice: tokens ``[T]`` = prompt + completion, experts of MoE layers."""
    T = len(prompt_token_ids) + len(fin.output_token_ids)
    routes = EngineRoutes(
        fin.routed_experts, fin.routes_row_start, fin.routed_weights, fin.weights_dtype
    )
    return RouteRecord.from_engine(
        routes,
        np.asarray(prompt_token_ids + fin.output_token_ids, dtype=np.int64),
        prompt_len=len(prompt_token_ids),
        num_experts=info.num_experts,
        moe_layers=info.moe_layers,
        num_layers=info.num_layers,
        num_cached_tokens=min(fin.num_cached_tokens, len(prompt_token_ids)),
        model=info.name,
        metadata={"request_id": request_id, "choice": fin.index, "finish": fin.finish_reason},
        weight_versions=row_spans(fin.weight_versions, len(prompt_token_ids), T),
    )


@dataclass
class ChoiceJob:
    """What a worker needs to store one choice's route (pickled to a worker process)."""

    address: StoreAddress
    route_id: str
    info: ModelInfo
    fin: ChoiceFinished
    prompt_token_ids: list[int]
    request_id: str
    ttl_s: int | None
    deadline: float  # time.monotonic(): past it, no manifest is written
    count: bool  # the routing statistics are on: send the expert counts back
    limits: ReadLimits  # what a chunk the prefix-index fill reads may declare


@dataclass
class StoreOutcome:
    """What became of a job: stored (the handle's figures) or failed (the error)."""

    error: str | None = None  # "Type: detail" of a failed store
    error_type: str | None = None
    unexpected: str | None = None  # the traceback of an error that is a bug
    fill_error: str | None = None  # a prefix-index fill that failed (the route stored unfilled)
    fill_error_type: str | None = None
    rows_filled: int = 0
    bytes_written: int = 0
    num_valid_rows: int = 0
    weight_version: str | None = None
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)
    counts: VersionCounts | None = None


class _Stores:
    """The stores one worker has open: one Redis client per server, one store per prefix."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[tuple, RouteStore] = {}
        self._stores: OrderedDict[tuple[StoreAddress, ReadLimits], RouteStore] = OrderedDict()

    def get(self, a: StoreAddress, limits: ReadLimits) -> RouteStore:
        with self._lock:
            st = self._stores.get((a, limits))
            if st is not None:
                self._stores.move_to_end((a, limits))
                return st
            server = (a.url, a.cluster, a.redis_kwargs)
            base = self._clients.get(server)
            if base is None:
                base = RouteStore.from_url(
                    a.url, cluster=a.cluster, prefix=a.prefix, ttl_s=a.ttl_s,
                    block_size=a.block_size, decode_threads=1, **dict(a.redis_kwargs),
                )  # fmt: skip
                self._clients[server] = base
            st = RouteStore(
                base.redis, prefix=a.prefix, ttl_s=a.ttl_s, block_size=a.block_size,
                decode_threads=1, limits=limits, where=base._where,
            )  # fmt: skip
            self._stores[a, limits] = st
            while len(self._stores) > _MAX_STORES:
                self._stores.popitem(last=False)
            return st


_STORES = _Stores()


def store_choice(job: ChoiceJob) -> StoreOutcome:
    """Build ``job``'s record, fill rows the engine did not return from the prefix index (best
    effort), store it whole and count it; never raises (failures -> the outcome)."""
    out = StoreOutcome()
    try:
        store = _STORES.get(job.address, job.limits)
        record = build_record(job.info, job.fin, job.prompt_token_ids, job.request_id)
        # The last sampled token never has a route; anything else missing (an engine that
        # returned rows from an offset, or skipped a cached prefix) is filled from the index.
        if not record.valid[:-1].all():
            record = _fill(store, record, job.deadline, out)
        result = store.put(job.route_id, record, ttl_s=job.ttl_s, deadline=job.deadline)
    except Exception as e:
        detail = str(e)
        out.error = f"{type(e).__name__}: {detail}" if detail else type(e).__name__
        out.error_type = type(e).__name__
        if not isinstance(e, (RouteError, TimeoutError)):  # a bug: keep the traceback
            out.unexpected = traceback.format_exc()
        return out
    out.bytes_written = result.bytes_written
    out.num_valid_rows = int(record.valid.sum())
    out.weight_version = record.weight_version
    out.weight_versions = list(record.weight_versions)
    if job.count:
        out.counts = version_counts(record)
    return out


def _fill(
    store: RouteStore, record: RouteRecord, deadline: float, out: StoreOutcome
) -> RouteRecord:
    """Rows the index cannot supply stay marked invalid, and a failing index lookup stores the
    record as it is rather than failing the route."""
    try:
        record, out.rows_filled = store.fill_from_prefix_index(record, deadline=deadline)
    except Exception as e:  # the put decides whether the route is stored
        out.fill_error, out.fill_error_type = repr(e), type(e).__name__
    return record


# How long the workers of a new pool may take to start together before the start fails.
_START_TIMEOUT_S = 120.0
# This worker's pool's start barrier (see RouteWorkers.start).
_barrier: Any = None  # a multiprocessing Barrier


def _worker_start(barrier: Any) -> None:
    global _barrier
    # Ctrl-C reaches the whole process group; the serving process drains its requests, whose
    # routes these workers are storing, before it stops them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _barrier = barrier


def _ready() -> int:
    """One start task: held until every worker of the pool holds one, so that the pool, which
    starts a process only while none is idle, starts one per task."""
    _barrier.wait(_START_TIMEOUT_S)
    return os.getpid()


class RouteWorkers:
    """The pool :func:`store_choice` runs in: ``processes`` worker processes, or threads of this
    process when ``processes`` is 0."""

    def __init__(self, processes: int) -> None:
        if processes < 0:
            raise ValueError(f"route workers must be >= 0, got {processes}")
        self.processes = processes
        self.replaced = 0  # pools replaced after a worker died
        self._pool = self._new()
        self._closed = False

    def _new(self) -> Executor:
        if self.processes == 0:
            return ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4), "route-store")
        # forkserver: the serving process runs threads (a fork would copy their locks); the
        # server process imports this module once, and each worker forks from it.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        barrier = ctx.Barrier(self.processes)
        return ProcessPoolExecutor(
            self.processes, mp_context=ctx, initializer=_worker_start, initargs=(barrier,)
        )

    def start(self) -> list[int]:
        """Start every worker now (blocking: call it from a thread), not on the first routes;
        returns their process ids (empty for threads), one per worker."""
        if self.processes == 0:
            return []
        futures = [self._pool.submit(_ready) for _ in range(self.processes)]
        pids = sorted({f.result() for f in futures})
        if len(pids) != self.processes:  # a worker took two start tasks: the barrier failed
            raise RouteWorkerError(f"{len(pids)} of {self.processes} route workers started")
        return pids

    async def run(self, job: ChoiceJob) -> StoreOutcome:
        """:func:`store_choice` of ``job`` in a worker; :class:`RouteWorkerError` if the worker
        died holding it (the pool is replaced for the next jobs)."""
        if self._closed:
            raise RouteWorkerError("the route workers are shut down")
        pool = self._pool
        try:
            return await asyncio.wrap_future(pool.submit(store_choice, job))
        except BrokenProcessPool as e:
            self._replace(pool)
            raise RouteWorkerError(f"the route worker exited: {e}") from None

    def _replace(self, broken: Executor) -> None:
        if self._pool is not broken or self._closed:
            return  # another job's failure replaced it already
        self.replaced += 1
        self._pool = self._new()
        broken.shutdown(wait=False)
        # The new workers start in a thread, not on the event loop that saw the old one die.
        threading.Thread(target=self._restart, name="route-workers-start", daemon=True).start()

    def _restart(self) -> None:
        try:
            self.start()
        except Exception:  # the next job finds the pool broken and reports it
            log.exception("restarting the route workers failed")

    async def aclose(self) -> None:
        """Wait for every route in flight, then stop the workers (off the event loop)."""
        self._closed = True
        await asyncio.to_thread(self._pool.shutdown, wait=True)
