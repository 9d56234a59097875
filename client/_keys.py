"""Redis key names and route ids: the one place that names keys.

Keys (``P`` is the store prefix, ``{...}`` a Redis Cluster hash tag):

- ``P:{<route id>}:m``    manifest of one record: metadata + ordered chunk addresses.
- ``P:c:{<address>}``     content-addressed chunk: ``block_size`` token rows (the last shorter).
- ``P:p:{<chain>}``       token-prefix index: the chain of a complete block whose rows are all
  valid -> the address of the chunk holding them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._errors import RouteShapeError

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_TTL_S", "KeySchema", "validate_route_id"]

# 128 tokens: the KV block size at which vLLM reports prefix-cache hits, so a cached prefix maps
# onto whole chunks; big enough that per-key overhead is < 1% of a chunk for real model shapes.
DEFAULT_BLOCK_SIZE = 128
DEFAULT_TTL_S = 24 * 3600

_ROUTE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def validate_route_id(route_id: str) -> str:
    """Return ``route_id`` if it is 1-128 chars of ``[A-Za-z0-9._:-]``; else RouteShapeError."""
    # Ids of dots only would be normalised away as URL path segments ("..").
    if (
        not isinstance(route_id, str)
        or not _ROUTE_ID.fullmatch(route_id)
        or not route_id.strip(".")
    ):
        raise RouteShapeError(
            f"invalid route id {route_id!r}: expected 1-128 characters from [A-Za-z0-9._:-], "
            "not only dots"
        )
    return route_id


@dataclass(frozen=True)
class KeySchema:
    """The one place that names Redis keys."""

    prefix: str = "rr"

    def manifest(self, route_id: str) -> str:
        return f"{self.prefix}:{{{route_id}}}:m"

    def manifest_pattern(self) -> str:
        """A Redis ``SCAN`` pattern matching every manifest under this prefix, and no other key
        (route ids hold no braces; the prefix's glob characters are escaped)."""
        prefix = re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix)
        return f"{prefix}:{{*}}:m"

    def route_id(self, manifest_key: str | bytes) -> str:
        """The route id a :meth:`manifest` key names."""
        key = manifest_key.decode() if isinstance(manifest_key, bytes) else manifest_key
        head, tail = f"{self.prefix}:{{", "}:m"
        if not (key.startswith(head) and key.endswith(tail)):
            raise ValueError(f"{key!r} is not a manifest key under prefix {self.prefix!r}")
        return key[len(head) : -len(tail)]

    def chunk(self, digest: bytes) -> str:
        return f"{self.prefix}:c:{{{digest.hex()}}}"

    def index(self, chain: bytes) -> str:
        return f"{self.prefix}:p:{{{chain.hex()}}}"

    def claim(self, name: str) -> str:
        """A lease on ``name`` (a request id in flight), held by one writer at a time."""
        return f"{self.prefix}:{{{name}}}:claim"

    def probe(self) -> str:
        """A scratch key writers set to learn whether Redis takes writes now."""
        return f"{self.prefix}:probe"
