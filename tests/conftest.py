"""Shared fixtures: real redis-server processes on free loopback ports (never the shared 6379)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from routereplay.client._local_redis import redis_cluster, redis_server


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a private standalone redis-server for the whole test session."""
    with redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """URL of one node of a private 3-master Redis Cluster for the whole test session."""
    with redis_cluster(3) as url:
        yield url
