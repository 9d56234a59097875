"""What an API key entry is: ``TENANT:KEY`` or a bare ``KEY``, and which names are tenant names.

``settings.py`` checks ``--api-keys`` and ``--admin-keys`` entries as the settings are read;
``auth.py`` builds its key ring from them and checks an admin's ``?tenant=`` choice.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["TENANT_NAME", "parse_key_entry"]

TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A tenant name: it becomes part of a Redis key prefix (``<route-prefix>:t:<tenant>``)."""


def parse_key_entry(entry: str) -> tuple[str, str]:
    """``TENANT:KEY`` or ``KEY`` -> (tenant, key); a bare key's tenant is named after its hash.

    ValueError says what is wrong without the key itself (messages reach logs and terminals)."""
    entry = entry.strip()
    tenant, sep, key = entry.partition(":")
    if not sep:
        tenant, key = "k" + hashlib.sha256(entry.encode()).hexdigest()[:12], entry
    if not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"tenant name {tenant!r} must match [A-Za-z0-9_-]{{1,64}}")
    if len(key) < 16:
        raise ValueError(f"the key of tenant {tenant!r} is shorter than 16 characters")
    return tenant, key
