"""Shared fixtures: real redis-server processes on free loopback ports (never the shared 6379)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from routereplay.local_redis import redis_cluster, redis_server

# The real-engine fixtures (tests/engines.py) are visible to every test: the session's engines
# start before the first test, whichever tier it is in.
pytest_plugins = ["engines"]

# Marks whose tests boot a real engine or Megatron: minutes each on a 2-core host, so they are
# slow as well, and `pytest -m "not slow"` is the edit-test loop.
_SLOW_MARKS = ("vllm", "megatron")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(m) for m in _SLOW_MARKS):
            item.add_marker(pytest.mark.slow)


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


@pytest.fixture()
def closing() -> Iterator[Callable[[Any], Any]]:
    """``closing(client) -> client``, closed when the test ends (clients a test opens inline)."""
    opened: list[Any] = []

    def add(client: Any) -> Any:
        opened.append(client)
        return client

    yield add
    for client in reversed(opened):
        client.close()
