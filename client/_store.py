"""RouteStore (sync) and AsyncRouteStore (asyncio): route records in Redis or Redis Cluster.

Each operation is written once, as a generator that yields batches of Redis commands and receives
their replies (``_put``, ``_get_many``, ``_fill``); the sync store runs it with blocking pipelines,
the async store awaits them, so the two mirror each other name for name with no copied logic.
Every batch goes through a non-transactional pipeline, which redis-py routes per slot on a
cluster, so one code path serves ``Redis`` and ``RedisCluster``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Self

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry as SyncRetry

from ._batch import RawBatch, resolve_results
from ._chunks import ChunkDecoder
from ._errors import (
    RouteConnectionError,
    RouteError,
    RouteStoreError,
    UnsupportedRedisError,
)
from ._keys import DEFAULT_BLOCK_SIZE, DEFAULT_TTL_S, KeySchema, validate_route_id
from ._layout import (
    PutPlan,
    PutResult,
    apply_fill,
    assemble_read,
    check_stop,
    plan_fill,
    plan_put,
    plan_read,
)
from ._limits import DEFAULT_LIMITS, ReadLimits
from ._record import RouteRecord
from ._threads import DecodePool, default_decode_threads

__all__ = [
    "MIN_REDIS_VERSION",
    "AsyncRouteStore",
    "RouteStore",
    "StoreAddress",
    "redis_versions",
]

# Connections a store opens to one Redis server at most (Redis's own limit is 10,000 clients).
MAX_CONNECTIONS = 512
_RESERVED_CONNECTIONS = 16  # of a cluster node's pool: for commands outside store operations

# The oldest Redis the store runs on: a put extends shared chunks' TTLs with EXPIRE ... GT (7.0).
MIN_REDIS_VERSION = (7, 0)

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# Records above this many raw bytes are encoded/decoded in a worker thread by AsyncRouteStore,
# so a long completion does not stall the event loop that serves other requests.
_OFFLOAD_BYTES = 256 * 1024
# Chunks per GET round trip of a read: while one batch's replies arrive, the decode threads
# work on the previous ones (~5 MB of replies per batch at a Qwen3-235B-like shape). The first
# batches are smaller (64, 128, then 256) so the decode threads start sooner (~5% off a 256k-token
# step's read, bench trainer), and so are the last ones (_batch_sizes) so they stop sooner.
_GET_BATCH = 256
_FIRST_GET_BATCH = 64


def _batch_sizes(n: int) -> list[int]:
    """How many of a read's ``n`` chunks each round trip asks for: growing from
    ``_FIRST_GET_BATCH`` to ``_GET_BATCH``, then halving what is left at the end (1503 chunks:
    64, 128, 256 x 4, 143, 72, 72). What is decoded after the last reply is that last batch and
    whatever is still queued: a whole last 256-chunk batch took 10 to 15 ms of a step's ~60 on
    8 decode threads of an H200 host, the batches of its size before it 4 to 7
    (docs/trainer.md)."""
    sizes: list[int] = []
    size = first = min(_FIRST_GET_BATCH, _GET_BATCH)
    left = n
    while left > 0:
        k = max(first, left // 2) if left < 2 * size else size
        if left - k < first // 2:  # no crumb of a batch left for a round trip of its own
            k = left  # (also where ``first`` alone is more than is left)
        sizes.append(k)
        left -= k
        size = min(2 * size, _GET_BATCH)
    return sizes


def _split_url(url: str, cluster: bool | None) -> tuple[str, bool]:
    scheme, _sep, rest = url.partition("://")
    if scheme in _CLUSTER_SCHEMES:
        return f"{_CLUSTER_SCHEMES[scheme]}://{rest}", True
    return url, bool(cluster)


@contextlib.contextmanager
def _redis_errors(where: str) -> Iterator[None]:
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise RouteConnectionError(f"redis {where}: {exc}") from exc
    except redis.exceptions.ClusterError as exc:
        raise RouteConnectionError(f"redis cluster {where}: {exc}") from exc
    except redis.ResponseError as exc:
        # OOM, READONLY replica, a server older than 7.0 (no EXPIRE ... GT). The server's message
        # can quote a whole command, chunk bytes included: keep its first line, shortened.
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RouteStoreError(
            f"redis {where} refused a command ({type(exc).__name__}): {first[:200]}"
        ) from exc


# How long a server found unsupported stays refused without a new ``INFO`` (an upgrade in place
# is seen within this; a lost connection checks again at once).
REFUSAL_CACHE_S = 5.0


def redis_versions(info: Any) -> list[str]:
    """``redis_version`` of each server in an ``INFO server`` reply: one dict for a standalone
    server, a dict of them (by node) for a cluster."""
    if isinstance(info, dict) and "redis_version" in info:
        return [str(info["redis_version"])]
    if isinstance(info, dict):
        return [v for node in info.values() for v in redis_versions(node)]
    return []


def check_redis_versions(versions: list[str], where: str) -> None:
    """Raise :class:`UnsupportedRedisError` naming the oldest server under ``MIN_REDIS_VERSION``."""
    if not versions:
        raise UnsupportedRedisError(f"redis {where}: INFO server reported no redis_version")
    oldest = min(versions, key=_version_key)
    if _version_key(oldest) < MIN_REDIS_VERSION:
        need = ".".join(map(str, MIN_REDIS_VERSION))
        raise UnsupportedRedisError(
            f"redis {where} is Redis {oldest}; routereplay needs Redis >= {need} (EXPIRE ... GT)"
        )


def _acl_denied(e: RouteStoreError) -> None:
    """None when Redis refused ``INFO`` to this user (an ACL); any other refusal re-raised."""
    if not isinstance(e.__cause__, redis.exceptions.NoPermissionError):
        raise e


def _version_key(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


# Compare-and-delete: release a lease only if this holder's token still holds it.
_RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)

# Take a free lease, or confirm one this token already holds: a claim retried after its reply
# was lost (the connection's Retry) finds its own token and succeeds, instead of reading as a
# conflict with itself.
_CLAIM = (
    "local held = redis.call('get', KEYS[1]) "
    "if held == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 1 end "
    "if held then return 0 end "
    "redis.call('set', KEYS[1], ARGV[1], 'px', ARGV[2]) return 1"
)

# Compare-and-extend: keep a lease alive only while this holder's token still holds it.
_RENEW = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
)

# A batch of commands: (pipeline method name, args, kwargs). An operation yields batches and is
# sent back each batch's replies; its return value is the operation's result.
Command = tuple[str, tuple[Any, ...], dict[str, Any]]
Op = Generator[list[Command], list[Any], Any]


@dataclass(frozen=True)
class StoreAddress:
    """What opens the same store in another process: :meth:`RouteStore.from_url`'s arguments
    (``redis_kwargs`` as sorted pairs, so an address is hashable)."""

    url: str
    cluster: bool
    prefix: str
    ttl_s: int
    block_size: int
    redis_kwargs: tuple[tuple[str, Any], ...] = ()

    def with_prefix(self, prefix: str) -> StoreAddress:
        return replace(self, prefix=prefix)


def _cmd(name: str, *args: Any, **kwargs: Any) -> Command:
    return (name, args, kwargs)


def chunk_ttl(ttl: int) -> int:
    """Chunks live longer than the manifests that name them: a put takes time between its chunk
    writes and its manifest write, and an LRU/TTL eviction policy takes the keys nearest their
    expiry first. The margin keeps "manifest present => chunks present" true under both."""
    return ttl + max(60, ttl // 10)


def _put(plan: PutPlan, ttl: int) -> Op:
    """Chunks first (NX), then index entries, then the manifest: no reader sees a partial one."""
    cttl = chunk_ttl(ttl)
    # EXPIRE before EXISTS: a chunk that EXISTS still sees was alive when EXPIRE extended it, so
    # it cannot expire between the check and our manifest (the reverse order has that window).
    replies = yield [
        c
        for key in plan.chunk_keys
        for c in (_cmd("expire", key, cttl, gt=True), _cmd("exists", key))
    ]
    missing = [i for i, e in enumerate(replies[1::2]) if not e]
    raced: list[int] = []
    written = 0
    if missing:
        replies = yield [
            _cmd("set", plan.chunk_keys[i], plan.chunk_blob(i), nx=True, ex=cttl) for i in missing
        ]
        raced = [i for i, ok in zip(missing, replies, strict=True) if not ok]
        written = sum(len(plan.chunk_blob(i)) for i in missing if i not in raced)
        if raced:  # a concurrent writer stored it first: make it outlive our manifest
            yield [_cmd("expire", plan.chunk_keys[i], cttl, gt=True) for i in raced]
    yield [
        *(_cmd("set", key, digest, ex=ttl) for key, digest in plan.index_entries),
        _cmd("set", plan.manifest_key, plan.manifest_blob, ex=ttl),
    ]
    return PutResult(
        route_id=plan.route_id,
        num_tokens=plan.record.num_tokens,
        chunks_total=len(plan.chunk_keys),
        chunks_written=len(missing) - len(raced),
        bytes_written=written + len(plan.manifest_blob),
        manifest_bytes=len(plan.manifest_blob),
    )


def _read(names: list[str], mget: bool) -> Generator[list[Command], list[Any], list[Any]]:
    """The values of keys ``names`` (None where absent) in one round trip: one MGET where all
    keys may be read together (standalone Redis; a cluster's keys live in many slots), else a
    GET each. Why MGET: Redis and redis-py then handle one reply, not one per key; reading a
    training step's chunks took ~40% less client time (bench trainer)."""
    if not names:
        return []
    if mget:
        return (yield [_cmd("mget", names)])[0]
    return (yield [_cmd("get", n) for n in names])


@dataclass(frozen=True)
class _Read:
    """What every read op of a store needs besides its ids."""

    keys: KeySchema
    start: int
    limits: ReadLimits
    mget: bool
    stop: int | None = None  # rows ``start..stop`` (None: to each record's end)


def _get_many(read: _Read, ids: list[str], pool: Executor | None, parts: int) -> Op:
    """One result per id (record, None, or that id's error); each shared chunk read once, in
    batches that decode (on ``pool``) while the next batch is read."""
    keys, mget = read.keys, read.mget
    blobs = yield from _read([keys.manifest(rid) for rid in ids], mget)
    plan = plan_read(ids, blobs, read.start, read.limits, stop=read.stop)
    shapes = plan.shapes()
    digests = list(shapes)
    dec = ChunkDecoder(pool, parts, shapes)
    i = 0
    for size in _batch_sizes(len(digests)):
        batch = digests[i : i + size]
        dec.add(batch, (yield from _read([keys.chunk(d) for d in batch], mget)))
        i += size
    # Records are assembled once every chunk is decoded, not as each one's chunks are: the
    # assembly is Python on this thread, and run during the last batches' decoding it held the
    # GIL that each decode call needs to hand back its chunks (on an H200 host, the first
    # calls of the last large batch took 6 to 9 ms instead of 1 to 3.5).
    dec.wait()
    return assemble_read(plan, dec)


def _raw_batch(read: _Read, ids: list[str], max_bytes: int) -> Op:
    """The stored bytes of ``ids`` (manifests and the distinct chunks rows ``start..`` need),
    undecoded, for a reader elsewhere to assemble and verify. Stops taking ids once the chunk
    bytes pass ``max_bytes`` (always taking the first), so memory stays bounded: those not
    taken are returned as ``deferred``. A manifest over the store's limits is that id's
    error: its chunks are not read."""
    keys, mget = read.keys, read.mget
    blobs = yield from _read([keys.manifest(rid) for rid in ids], mget)
    plan = plan_read(ids, blobs, read.start, read.limits)
    batch = RawBatch()
    for idx, rid in enumerate(ids):
        if blobs[idx] is None:
            batch.missing.append(rid)
        elif isinstance(plan.results[idx], RouteError):
            batch.errors[rid] = plan.results[idx]  # type: ignore[assignment]
    total = 0
    for n, (idx, m, needed) in enumerate(plan.manifests):
        if total > max_bytes and n > 0:
            batch.deferred.extend(m.route_id for _, m, _ in plan.manifests[n:])
            break
        new = [m.digests[i] for i in needed if m.digests[i] not in batch.chunks]
        new = list(dict.fromkeys(new))
        got = yield from _read([keys.chunk(d) for d in new], mget)
        for d, blob in zip(new, got, strict=True):
            batch.chunks[d] = blob
            total += len(blob or b"")
        batch.manifests[m.route_id] = blobs[idx]
    batch.num_bytes = total + sum(len(b) for b in batch.manifests.values())
    return batch


def _fill(keys: KeySchema, record: RouteRecord, block_size: int) -> Op:
    plan = plan_fill(keys, record, block_size)
    if not plan.blocks:
        return record, 0
    digests = yield [_cmd("get", key) for key in plan.index_keys]
    hits = [(i, bytes(d)) for i, d in zip(plan.blocks, digests, strict=True) if d]
    if not hits:
        return record, 0
    blobs = yield [_cmd("get", keys.chunk(d)) for _, d in hits]
    found = {i: (d, b) for (i, d), b in zip(hits, blobs, strict=True) if b is not None}
    return apply_fill(plan, found)


class _Common:
    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "rr",
        ttl_s: int = DEFAULT_TTL_S,
        block_size: int = DEFAULT_BLOCK_SIZE,
        decode_threads: int | None = None,
        limits: ReadLimits | None = None,
        where: str = "",
        max_operations: int | None = None,
    ) -> None:
        """``decode_threads``: threads that decode a read's chunks (default
        :func:`default_decode_threads`; 1 decodes on the calling thread). ``limits``: what one
        record may declare before a read allocates it (default :class:`ReadLimits`); a larger
        record is that id's :class:`RouteLimitError`. ``max_operations``: operations in flight
        at once, the others wait (a cluster client's per-node pools raise past their size
        instead of waiting; ``from_url`` sets it for a cluster)."""
        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {ttl_s}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if decode_threads is not None and decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {decode_threads}")
        self.redis = client
        self.keys = KeySchema(prefix)
        self.ttl_s = ttl_s
        self.block_size = block_size
        self.decode_threads = decode_threads or default_decode_threads()
        self.limits = limits or DEFAULT_LIMITS
        self._decoder = DecodePool(self.decode_threads)
        self._where = where or repr(client)
        # Set by the first successful server check (check_server, or the first operation);
        # None again after a lost connection: what answers next may be another server.
        self.server_versions: list[str] | None = None
        # A server found unsupported, and until when that answer stands without asking again.
        self._refused: tuple[str, float] | None = None
        self._slots = None if max_operations is None else self._slots_class(max_operations)
        self._closed = False
        # Set by from_url: how a worker process opens this store again (None: made from a client).
        self.address: StoreAddress | None = None

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Every Redis call: refused once the store is closed (redis-py would silently open
        new connections), redis-py's errors as the store's."""
        if self._closed:
            raise RouteStoreError(f"redis {self._where}: the store is closed")
        try:
            with _redis_errors(self._where):
                yield
        except RouteConnectionError:
            # Redis may come back as another server (a restart onto another image, a failover
            # to a replica of another release): check it again before the next operation.
            self.server_versions = None
            self._refused = None
            raise

    def _cached_refusal(self) -> None:
        """Raise the last server check's refusal while it is fresh (``REFUSAL_CACHE_S``), so a
        store on an unsupported Redis does not ask ``INFO`` again for every operation."""
        if self._refused is not None and time.monotonic() < self._refused[1]:
            raise UnsupportedRedisError(self._refused[0])

    def _decode_pool(self) -> ThreadPoolExecutor | None:
        return self._decoder.get()

    def _close_pool(self) -> None:
        self._decoder.close()

    # (standalone client class, cluster client class): redis-py's sync or asyncio ones.
    _clients: tuple[type, type]
    _blocking_pool: type  # redis-py's BlockingConnectionPool of the same flavour
    _retry: type  # redis-py's Retry of the same flavour

    @classmethod
    def _connection_defaults(cls) -> dict[str, Any]:
        """What a long-lived service needs from its Redis connections, unless the caller says
        otherwise: after a Redis restart every pooled connection is dead, and without retries
        each one failed the request that next used it (redis-py's ``from_url`` gives its
        connections no retries). A retried batch is safe: every command a store sends is
        idempotent or checked (``SET NX`` of content-addressed chunks, ``EXPIRE GT``, ``GET``).
        """
        return {
            "retry": cls._retry(
                ExponentialWithJitterBackoff(base=0.05, cap=1.0),
                retries=4,
                supported_errors=(redis.ConnectionError, redis.TimeoutError, TimeoutError),
            ),
            # PING a connection that sat idle this long before using it again.
            "health_check_interval": 10,
            "socket_connect_timeout": 2.0,
            "socket_timeout": 10.0,
            "socket_keepalive": True,
            # Connections per server (a cluster: per node). Each in-flight store operation
            # holds one; more than this wait (standalone) for a free one.
            "max_connections": MAX_CONNECTIONS,
        }

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "rr",
        ttl_s: int = DEFAULT_TTL_S,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cluster: bool | None = None,
        decode_threads: int | None = None,
        limits: ReadLimits | None = None,
        **redis_kwargs: Any,
    ) -> Self:
        """``redis://`` / ``rediss://``; ``redis+cluster://`` or ``cluster=True`` for a cluster.

        ``redis_kwargs`` go to redis-py's ``from_url`` (timeouts, pool size, TLS options).
        """
        url, is_cluster = _split_url(url, cluster)
        kwargs = {**cls._connection_defaults(), **redis_kwargs}
        max_operations = None
        if is_cluster:
            client = cls._clients[1].from_url(url, **kwargs)
            # An operation holds at most one connection per node: this many in flight never
            # exhaust a node's pool, which would raise "Too many connections" rather than wait.
            # The rest of the pool is left to the single commands (leases, probes).
            cap = int(kwargs["max_connections"])
            max_operations = max(1, cap - min(_RESERVED_CONNECTIONS, cap // 2))
        else:
            # A burst beyond the pool waits for a free connection (up to the socket timeout)
            # instead of failing: redis-py's plain pool raises "Too many connections" past its
            # limit (100 by default since redis-py 6), failing whatever write came next.
            kwargs.setdefault("timeout", kwargs["socket_timeout"])
            pool = cls._blocking_pool.from_url(url, **kwargs)
            client = cls._clients[0].from_pool(pool)
        store = cls(
            client, prefix=prefix, ttl_s=ttl_s, block_size=block_size,
            decode_threads=decode_threads, limits=limits, where=url,
            max_operations=max_operations,
        )  # fmt: skip
        store.address = StoreAddress(
            url, is_cluster, prefix, ttl_s, block_size, tuple(sorted(redis_kwargs.items()))
        )
        return store

    def _pipe(self, batch: list[Command]) -> Any:
        # RedisCluster pipelines are never transactional and take no such argument.
        if isinstance(self.redis, (RedisCluster, AsyncRedisCluster)):
            pipe = self.redis.pipeline()
        else:
            pipe = self.redis.pipeline(transaction=False)
        for name, args, kwargs in batch:
            getattr(pipe, name)(*args, **kwargs)
        return pipe

    def _put_op(
        self, route_id: str, record: RouteRecord, ttl_s: int | None, canonical_order: bool
    ) -> Op:
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1 second, got {ttl_s}")
        plan = plan_put(
            self.keys, route_id, record, self.block_size, canonical_order=canonical_order
        )
        return _put(plan, self.ttl_s if ttl_s is None else ttl_s)

    def _get_op(self, route_ids: Sequence[str], start: int, stop: int | None = None) -> Op:
        ids = [validate_route_id(r) for r in route_ids]
        check_stop(start, stop)  # before Redis is asked: no record makes such a window valid
        # A few tasks per thread per stage: even shares without a task per chunk.
        read = _Read(self.keys, start, self.limits, self._mget, stop)
        return _get_many(read, ids, self._decode_pool(), 2 * self.decode_threads)

    def _raw_op(self, route_ids: Sequence[str], start: int, max_bytes: int) -> Op:
        ids = [validate_route_id(r) for r in route_ids]
        return _raw_batch(_Read(self.keys, start, self.limits, self._mget), ids, max_bytes)

    def _record_versions(self, info: Any) -> list[str]:
        """Check and keep the versions of an ``INFO server`` reply (None: INFO denied)."""
        if info is None:
            self.server_versions = []  # an ACL without INFO: a write then says what failed
            return []
        try:
            check_redis_versions(versions := redis_versions(info), self._where)
        except UnsupportedRedisError as e:
            self._refused = (str(e), time.monotonic() + REFUSAL_CACHE_S)
            raise
        self._refused = None
        self.server_versions = versions
        return versions

    @property
    def _all_nodes(self) -> dict[str, Any]:
        # A cluster answers INFO from one node unless asked for all.
        if isinstance(self.redis, RedisCluster):
            return {"target_nodes": RedisCluster.ALL_NODES}
        if isinstance(self.redis, AsyncRedisCluster):
            return {"target_nodes": AsyncRedisCluster.ALL_NODES}
        return {}

    @property
    def _mget(self) -> bool:
        return not isinstance(self.redis, (RedisCluster, AsyncRedisCluster))

    def _manifest_key(self, route_id: str) -> str:
        return self.keys.manifest(validate_route_id(route_id))


class RouteStore(_Common):
    """Route records in Redis (standalone or cluster), synchronous.

    >>> store = RouteStore.from_url("redis://127.0.0.1:6390/0")
    >>> store.put("req-1-0", record)
    >>> store.get_many(["req-1-0", "req-2-0"])
    """

    _clients = (redis.Redis, RedisCluster)
    _blocking_pool = redis.BlockingConnectionPool
    _retry = SyncRetry

    def check_server(self) -> list[str]:
        """The Redis versions of the server (every node of a cluster); raises
        :class:`UnsupportedRedisError` for one older than ``MIN_REDIS_VERSION``. Runs by itself
        before the store's first operation."""
        try:
            with self._guard():
                info = self.redis.info("server", **self._all_nodes)
        except RouteStoreError as e:
            info = _acl_denied(e)
        return self._record_versions(info)

    _slots_class = threading.BoundedSemaphore

    def _run(self, op: Op, deadline: float | None = None) -> Any:
        if self._slots is None:
            return self._run_now(op, deadline)
        with self._slots:
            return self._run_now(op, deadline)

    def _run_now(self, op: Op, deadline: float | None = None) -> Any:
        if self.server_versions is None:
            self._cached_refusal()
            self.check_server()
        with self._guard():
            try:
                batch = next(op)
                while True:
                    if batch and deadline is not None and time.monotonic() > deadline:
                        # Checked before every batch, the manifest's last: an operation past
                        # its deadline writes no manifest, so a put reported late is not stored.
                        raise TimeoutError("the operation's deadline passed")
                    batch = op.send(self._pipe(batch).execute() if batch else [])
            except StopIteration as done:
                return done.value

    def ping(self) -> bool:
        with self._guard():
            return bool(self.redis.ping())

    def close(self) -> None:
        """Close the connections and the decode threads; every later call raises
        :class:`RouteStoreError`. Closing twice is harmless."""
        self._closed = True
        self._close_pool()
        self.redis.close()

    def __enter__(self) -> RouteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def put(
        self,
        route_id: str,
        record: RouteRecord,
        *,
        ttl_s: int | None = None,
        canonical_order: bool = False,
        deadline: float | None = None,
    ) -> PutResult:
        """Store ``record`` under ``route_id``: chunks first (NX), the manifest last.

        A reader sees either no manifest or a manifest whose chunks all exist. Chunks that
        already exist (shared prefixes) are not sent again; their TTL is extended to at least
        ``ttl_s`` so they outlive the new manifest. ``canonical_order=True`` stores each row's
        experts sorted (replay ignores their order) for a smaller encoding. ``deadline`` (a
        ``time.monotonic()`` value): past it no further batch is sent and the put raises
        ``TimeoutError`` with no manifest written.
        """
        return self._run(self._put_op(route_id, record, ttl_s, canonical_order), deadline)

    def get(self, route_id: str, *, start: int = 0, stop: int | None = None) -> RouteRecord:
        """The record stored under ``route_id``, rows ``start..stop`` (``stop`` None: to its end
        T; past T: clipped to T); RouteNotFoundError if none."""
        return self.get_many([route_id], start=start, stop=stop)[0]  # type: ignore[return-value]

    def get_many(
        self,
        route_ids: Sequence[str],
        *,
        start: int = 0,
        stop: int | None = None,
        missing_ok: bool = False,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Records for ``route_ids`` in order; each distinct chunk is fetched and decoded once,
        and checked against its content address.

        Each record holds rows ``start..stop`` (``stop`` None: to its end; past its end: clipped
        to it), as ``rows(start, stop)`` of the whole record would, read from only the chunks
        that hold them. A ``start`` past a record's end is that id's :class:`RouteShapeError`;
        a ``stop`` not past ``start`` raises it before Redis is asked.

        Unknown ids raise :class:`RouteNotFoundError`, or give None with ``missing_ok=True`` (a
        record whose chunk was evicted counts as missing). A record whose bytes fail a check
        raises :class:`RouteCorruptError`; with ``return_exceptions=True`` each failing id's error
        takes its place in the list instead and the other records are returned.
        """
        ids = list(route_ids)
        results = self._run(self._get_op(ids, start, stop))
        return resolve_results(
            ids, results, missing_ok=missing_ok, return_exceptions=return_exceptions
        )

    def get_raw(
        self, route_ids: Sequence[str], *, start: int = 0, max_bytes: int = 1 << 62
    ) -> RawBatch:
        """The stored bytes of ``route_ids``, undecoded (what ``POST /v1/routes:batch`` sends)."""
        return self._run(self._raw_op(route_ids, start, max_bytes))

    def exists(self, route_id: str) -> bool:
        with self._guard():
            return bool(self.redis.exists(self._manifest_key(route_id)))

    def delete(self, route_id: str) -> bool:
        """Delete the manifest; shared chunks stay until their TTL (other records may use them)."""
        with self._guard():
            return bool(self.redis.delete(self._manifest_key(route_id)))

    def fill_from_prefix_index(
        self, record: RouteRecord, *, deadline: float | None = None
    ) -> tuple[RouteRecord, int]:
        """Fill invalid rows of complete blocks from chunks that other records stored for the
        same token prefix and model shape. Returns the record (a new one if rows were filled) and
        the number of rows filled. ``deadline``: as :meth:`put`'s."""
        return self._run(_fill(self.keys, record, self.block_size), deadline)


class AsyncRouteStore(_Common):
    """Route records in Redis (standalone or cluster), asyncio. Mirrors :class:`RouteStore`.

    Large records are encoded and decoded in a worker thread so a long completion does not stall
    the event loop that serves other requests.
    """

    _clients = (aioredis.Redis, AsyncRedisCluster)
    _blocking_pool = aioredis.BlockingConnectionPool
    _retry = AsyncRetry

    async def check_server(self) -> list[str]:
        """See :meth:`RouteStore.check_server`."""
        try:
            with self._guard():
                info = await self.redis.info("server", **self._all_nodes)
        except RouteStoreError as e:
            info = _acl_denied(e)
        return self._record_versions(info)

    _slots_class = asyncio.Semaphore

    async def _run(self, op: Op, big: bool = False) -> Any:
        if self._slots is None:
            return await self._run_now(op, big)
        async with self._slots:
            return await self._run_now(op, big)

    async def _run_now(self, op: Op, big: bool = False) -> Any:
        # The operation's CPU work (encoding, decoding) runs between yields, i.e. inside send():
        # for big records that step goes to a worker thread. StopIteration cannot cross a
        # coroutine or a thread, so advance() turns it into a plain return value.
        def advance(value: Any) -> tuple[bool, Any]:
            try:
                return False, op.send(value)
            except StopIteration as done:
                return True, done.value

        if self.server_versions is None:
            self._cached_refusal()
            await self.check_server()
        with self._guard():
            value: Any = None
            while True:
                done, out = await asyncio.to_thread(advance, value) if big else advance(value)
                if done:
                    return out
                value = await self._pipe(out).execute() if out else []

    async def ping(self) -> bool:
        with self._guard():
            return bool(await self.redis.ping())

    async def claim(self, name: str, token: str, ttl_s: float) -> bool:
        """Take the lease on ``name`` for ``ttl_s`` unless another holder has it: the same name
        claimed through any replica sharing this Redis is refused. Idempotent for one
        ``token`` (a retried claim whose first reply was lost holds the lease)."""
        with self._guard():
            key = self.keys.claim(name)
            return bool(await self.redis.eval(_CLAIM, 1, key, token, int(ttl_s * 1000)))

    async def release(self, name: str, token: str) -> bool:
        """Give the lease back if ``token`` still holds it (a lapsed lease another writer took
        is left alone)."""
        with self._guard():
            return bool(await self.redis.eval(_RELEASE, 1, self.keys.claim(name), token))

    async def renew(self, name: str, token: str, ttl_s: float) -> bool:
        """Extend the lease on ``name`` to ``ttl_s`` from now if ``token`` still holds it; False
        when it lapsed (and maybe went to another holder)."""
        with self._guard():
            key = self.keys.claim(name)
            return bool(await self.redis.eval(_RENEW, 1, key, token, int(ttl_s * 1000)))

    async def delete_many(self, route_ids: Sequence[str]) -> int:
        """Delete the manifests of ``route_ids``; returns how many existed."""
        keys = [self._manifest_key(r) for r in route_ids]
        if not keys:
            return 0
        with self._guard():
            return sum(await self._pipe([_cmd("delete", k) for k in keys]).execute())

    async def check_writable(self) -> None:
        """Raise unless Redis takes the store's writes now: a supported server (checked as
        before an operation) that takes a 10 s scratch key. PING answers while ``maxmemory``
        refuses every write, or a replica is read-only."""
        if self.server_versions is None:
            self._cached_refusal()
            await self.check_server()
        with self._guard():
            await self.redis.set(self.keys.probe(), b"1", px=10_000)

    async def close(self) -> None:
        """See :meth:`RouteStore.close`."""
        self._closed = True
        self._close_pool()
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncRouteStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def put(
        self,
        route_id: str,
        record: RouteRecord,
        *,
        ttl_s: int | None = None,
        canonical_order: bool = False,
    ) -> PutResult:
        """See :meth:`RouteStore.put`."""
        big = record.experts.nbytes > _OFFLOAD_BYTES
        if big:
            op = await asyncio.to_thread(self._put_op, route_id, record, ttl_s, canonical_order)
        else:
            op = self._put_op(route_id, record, ttl_s, canonical_order)
        return await self._run(op, big)

    async def get(self, route_id: str, *, start: int = 0, stop: int | None = None) -> RouteRecord:
        """See :meth:`RouteStore.get`."""
        got = await self.get_many([route_id], start=start, stop=stop)
        return got[0]  # type: ignore[return-value]

    async def get_many(
        self,
        route_ids: Sequence[str],
        *,
        start: int = 0,
        stop: int | None = None,
        missing_ok: bool = False,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """See :meth:`RouteStore.get_many`."""
        ids = list(route_ids)
        results = await self._run(self._get_op(ids, start, stop), True)
        return resolve_results(
            ids, results, missing_ok=missing_ok, return_exceptions=return_exceptions
        )

    async def get_raw(
        self, route_ids: Sequence[str], *, start: int = 0, max_bytes: int = 1 << 62
    ) -> RawBatch:
        """See :meth:`RouteStore.get_raw`."""
        return await self._run(self._raw_op(route_ids, start, max_bytes))

    async def exists(self, route_id: str) -> bool:
        with self._guard():
            return bool(await self.redis.exists(self._manifest_key(route_id)))

    async def delete(self, route_id: str) -> bool:
        with self._guard():
            return bool(await self.redis.delete(self._manifest_key(route_id)))

    async def fill_from_prefix_index(self, record: RouteRecord) -> tuple[RouteRecord, int]:
        """See :meth:`RouteStore.fill_from_prefix_index`."""
        big = record.experts.nbytes > _OFFLOAD_BYTES
        return await self._run(_fill(self.keys, record, self.block_size), big)
