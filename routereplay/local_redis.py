"""Private redis-server processes on free loopback ports.

Used by the service's embedded default (no Redis URL configured), the benchmarks and the tests.
Never touches a machine's shared Redis: every instance gets its own port and temporary working
directory, keeps nothing on disk, and is stopped on exit.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClusterNodes", "free_port", "redis_cluster", "redis_cluster_nodes", "redis_server"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found on PATH (.ci/run installs it with apt-get)")
    return path


def _wait_ping(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer PING within {timeout}s")


def _start(port: int, workdir: Path, *extra: str, binary: str | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            binary or _binary("redis-server"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--protected-mode",
            "no",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_ping(port)
    return proc


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()


@contextlib.contextmanager
def redis_server(
    maxmemory: str | None = None, binary: str | None = None, port: int | None = None
) -> Iterator[str]:
    """A standalone redis-server (``binary``, default the one on PATH) on ``port`` (default: a
    free one); yields its URL.

    ``maxmemory`` (e.g. ``"2gb"``) caps it and evicts the keys nearest their TTL first, so a
    long-running embedded service cannot grow without bound.
    """
    extra = ["--maxmemory", maxmemory, "--maxmemory-policy", "volatile-ttl"] if maxmemory else []
    with tempfile.TemporaryDirectory(prefix="rr-redis-") as d:
        port = port or free_port()
        proc = _start(port, Path(d), *extra, binary=binary)
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            _stop([proc])


@dataclass
class ClusterNodes:
    """A running local Redis Cluster: one node's URL and every node's process, by port."""

    url: str
    procs: dict[int, subprocess.Popen]

    def masters(self) -> list[int]:
        """Ports of the nodes that are masters now, as a live node sees the cluster."""
        for port, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            out = subprocess.run([_binary("redis-cli"), "-p", str(port), "cluster", "nodes"],
                                 capture_output=True, text=True, timeout=10).stdout  # fmt: skip
            return sorted(
                int(f[1].split("@")[0].rsplit(":", 1)[1])
                for f in (line.split() for line in out.splitlines())
                if len(f) > 2 and "master" in f[2] and "fail" not in f[2]
            )
        return []

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Return once every live node reports ``cluster_state:ok`` (after a failover: the
        replica promoted)."""
        live = [p for p, proc in self.procs.items() if proc.poll() is None]
        _wait_cluster_ok(live, timeout)


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[str]:
    """A Redis Cluster of ``masters`` masters (no replicas) on loopback; yields one node's URL."""
    with redis_cluster_nodes(masters) as cluster:
        yield cluster.url


@contextlib.contextmanager
def redis_cluster_nodes(
    masters: int = 3, replicas: int = 0, node_timeout_ms: int = 5000
) -> Iterator[ClusterNodes]:
    """A Redis Cluster of ``masters`` masters with ``replicas`` replicas each on loopback; a
    replica is promoted ``node_timeout_ms`` or so after its master stops answering."""
    n = masters * (1 + replicas)
    with tempfile.TemporaryDirectory(prefix="rr-cluster-") as d:
        ports: list[int] = []
        while len(ports) < n:
            p = _cluster_port()
            if p not in ports:
                ports.append(p)
        procs: dict[int, subprocess.Popen] = {}
        try:
            for p in ports:
                wd = Path(d) / str(p)
                wd.mkdir()
                # A replica's first sync starts at once (Redis waits 5 s for more replicas).
                flags = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                         "--cluster-node-timeout", str(node_timeout_ms),
                         "--repl-diskless-sync-delay", "0"]  # fmt: skip
                procs[p] = _start(p, wd, *flags)
            subprocess.run(
                [_binary("redis-cli"), "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                 "--cluster-replicas", str(replicas), "--cluster-yes"],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=60,
            )  # fmt: skip
            _wait_cluster_ok(ports)
            cluster = ClusterNodes(f"redis://127.0.0.1:{ports[0]}/0", procs)
            # A replica that never synced is not promoted: wait until each one has.
            _wait_replicas_synced([p for p in ports if p not in cluster.masters()])
            yield cluster
        finally:
            _stop(list(procs.values()))


def _wait_replicas_synced(ports: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    cli = _binary("redis-cli")
    while time.monotonic() < deadline:
        infos = [subprocess.run([cli, "-p", str(p), "info", "replication"], capture_output=True,
                                text=True).stdout for p in ports]  # fmt: skip
        if all("master_link_status:up" in info for info in infos):
            return
        time.sleep(0.1)
    raise RuntimeError("redis cluster replicas did not sync with their masters")


def _wait_cluster_ok(ports: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    cli = _binary("redis-cli")
    while time.monotonic() < deadline:
        ok = all(
            "cluster_state:ok"
            in subprocess.run(
                [cli, "-p", str(p), "cluster", "info"], capture_output=True, text=True
            ).stdout
            for p in ports
        )
        if ok:
            return
        time.sleep(0.2)
    raise RuntimeError("redis cluster did not reach cluster_state:ok")
