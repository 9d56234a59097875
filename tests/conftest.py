"""Shared fixtures: real redis-server processes on free loopback ports (never the shared 6379)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from routereplay.local_redis import redis_cluster, redis_server

# The real-engine fixtures (tests/engines.py) are visible to every test: the shared engines
# start early, beside the first tests that do not need them.
pytest_plugins = ["engines"]

# Marks whose tests boot a real engine or Megatron: minutes each on a 2-core host, so they are
# slow as well, and `pytest -m "not slow"` is the edit-test loop.
_SLOW_MARKS = ("vllm", "megatron")


# The run is split over pytest-xdist workers (``-n 2 --dist loadgroup``, pyproject.toml) by
# module: a module's own engines and fixtures live in one worker. The modules that use the
# run's shared engines (tests/engines.py) form one group, so one worker runs them all and
# those engines start once; it goes first, and the other worker takes the remaining modules,
# the heaviest tiers first, so that both finish near the same time.
SHARED_ENGINES_GROUP = "shared-engines"
_FIRST_TIERS = ("tests/service/", "tests/trainer/")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from engines import uses_shared_engines  # here: the plugin is registered (and rewritten)

    for item in items:
        if any(item.get_closest_marker(m) for m in _SLOW_MARKS):
            item.add_marker(pytest.mark.slow)
    shared = {_module(i) for i in items if uses_shared_engines(i)}
    for item in items:
        m = _module(item)
        item.add_marker(pytest.mark.xdist_group(SHARED_ENGINES_GROUP if m in shared else m))

    def rank(item: pytest.Item) -> int:
        m = _module(item)
        if m in shared:
            return 0
        return next((1 + k for k, t in enumerate(_FIRST_TIERS) if m.startswith(t)), 9)

    items.sort(key=rank)  # stable: within a rank, collection order


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


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
