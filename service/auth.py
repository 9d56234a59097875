"""API keys, tenants and the admin scope.

With no key configured the service is open (the embedded default on loopback): completions,
routes and metrics need no key and every route lives in one namespace, but the RL control API
stays closed unless ``--unsafe-no-auth`` opens it too. With keys (``--api-keys``,
``--api-keys-file``, ``--admin-keys``, ``--admin-keys-file``; entries ``TENANT:KEY`` or a bare
``KEY``), every endpoint but ``/health`` needs ``Authorization: Bearer <key>``, and each key's
tenant owns a route namespace: its routes, request ids and prefix index live under the Redis
prefix ``<route-prefix>:t:<tenant>``, so one tenant can neither read, delete nor overwrite
another's routes (a reused ``X-Request-Id`` lands in the caller's own namespace). Admin keys also
reach any tenant's routes (``?tenant=``) and the RL control endpoints.

Keys are compared in constant time: the presented key's SHA-256 is compared with every
configured key's SHA-256 with ``hmac.compare_digest``, without stopping at a match.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import InvalidRequestError, ServiceError
from .key_entries import TENANT_NAME, parse_key_entry
from .settings import Settings

__all__ = [
    "AuthenticationError",
    "Caller",
    "KeyRing",
    "PermissionDeniedError",
    "Principal",
    "parse_key_entry",
    "principal",
]


class AuthenticationError(ServiceError):
    status_code = 401
    type = "authentication_error"
    default_code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class PermissionDeniedError(ServiceError):
    status_code = 403
    type = "permission_error"
    default_code = "permission_denied"


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``tenant`` None means the service runs without keys (one namespace)."""

    tenant: str | None
    admin: bool

    def namespace(self, tenant: str | None = None) -> str | None:
        """The tenant whose routes a request reaches (``tenant``: an admin's choice)."""
        if tenant is None or tenant == self.tenant:
            return self.tenant
        if not self.admin:
            raise PermissionDeniedError(
                f"tenant: {tenant!r} is not yours; only an admin key reaches other tenants' routes",
                param="tenant",
            )
        if not TENANT_NAME.fullmatch(tenant):
            raise InvalidRequestError(
                f"tenant: {tenant[:70]!r} is not a tenant name ([A-Za-z0-9_-]{{1,64}})",
                param="tenant",
            )
        return tenant


OPEN = Principal(tenant=None, admin=False)  # no keys: routes and completions, never the RL API
UNSAFE_OPEN = Principal(tenant=None, admin=True)  # no keys and --unsafe-no-auth


def _parse_entry(entry: str, where: str) -> tuple[str, str]:
    try:
        return parse_key_entry(entry)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _entries(inline: list[str], file: Path | None, what: str) -> list[tuple[str, str]]:
    out = [_parse_entry(e, f"--{what}") for e in inline if e.strip()]
    if file is not None:
        for n, line in enumerate(file.read_text().splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(_parse_entry(line, f"{file}:{n}"))
    return out


class KeyRing:
    """The configured keys: SHA-256 of each, with its tenant and scope."""

    def __init__(self, entries: list[tuple[str, str, bool]], unsafe_open: bool = False) -> None:
        self._keys = [
            (hashlib.sha256(key.encode()).digest(), tenant, admin) for tenant, key, admin in entries
        ]
        self._open = UNSAFE_OPEN if unsafe_open else OPEN

    @classmethod
    def from_settings(cls, s: Settings) -> KeyRing:
        user = _entries([k.get_secret_value() for k in s.api_keys], s.api_keys_file, "api-keys")
        admin = _entries(
            [k.get_secret_value() for k in s.admin_keys], s.admin_keys_file, "admin-keys"
        )
        entries = [(t, k, False) for t, k in user] + [(t, k, True) for t, k in admin]
        return cls(entries, unsafe_open=s.unsafe_no_auth)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller behind an ``Authorization`` header; 401 unless it holds a known key."""
        if not self.enabled:
            return self._open
        if not authorization:
            raise AuthenticationError("missing credentials: send Authorization: Bearer <API key>")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError("Authorization must be 'Bearer <API key>'")
        digest = hashlib.sha256(token.strip().encode()).digest()
        found: Principal | None = None
        for key, tenant, admin in self._keys:
            # No early exit: the time taken does not depend on which key (if any) matched.
            if hmac.compare_digest(digest, key):
                found = Principal(tenant, admin)
        if found is None:
            raise AuthenticationError("invalid API key")
        return found


# Declared for the OpenAPI document (a "Bearer" security scheme on every protected endpoint);
# the header itself is checked by KeyRing.authenticate.
_bearer = HTTPBearer(auto_error=False, description="an API key (--api-keys / --admin-keys)")


def principal(
    request: Request,
    _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None,
) -> Principal:
    """FastAPI dependency: the authenticated caller (401 for a missing or unknown key)."""
    keys: KeyRing = request.app.state.keys
    return keys.authenticate(request.headers.get("authorization"))


Caller = Annotated[Principal, Depends(principal)]
