"""FastAPI dependencies: who is calling (``Authorization: Bearer <key>`` → tenant)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from tessera.auth import verify_key
from tessera.errors import APIError
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE, ApiKey

# One message for a missing, malformed, unknown or revoked key: the answer must not say which it was.
UNAUTHORIZED = (
    "invalid API key: send 'Authorization: Bearer <key>' with a valid, unrevoked Tessera key "
    "(tessera keys create makes one)"
)


@dataclass(frozen=True)
class Caller:
    tenant_id: str
    tenant_name: str
    key_id: str
    key_prefix: str


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def current_caller(request: Request) -> Caller:
    """The caller's tenant and key, or 401. Sync on purpose: FastAPI runs it in a thread, and a cache
    miss reads the database (and every call reads the shared key version from Redis)."""
    key = _verified_key(request)
    if not key.has_scope(SCOPE_INFERENCE):
        raise APIError(
            403, "this API key lacks the 'inference' scope; use an inference key", "permission_denied"
        )
    return _caller(key)


def require_admin(request: Request) -> Caller:
    """An admin-scoped caller, or 401 (no valid key) / 403 (a valid key without the admin scope)."""
    key = _verified_key(request)
    if not key.has_scope(SCOPE_ADMIN):
        raise APIError(
            403,
            "this API key lacks the 'admin' scope; use an admin key (tessera keys create --admin makes one)",
            "permission_denied",
        )
    return _caller(key)


def _verified_key(request: Request) -> ApiKey:
    raw = bearer_token(request.headers.get("authorization"))
    with request.app.state.sessions() as session:
        key = verify_key(session, raw, version=request.app.state.key_version)
    if key is None:
        raise APIError(401, UNAUTHORIZED, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return key


def _caller(key: ApiKey) -> Caller:
    return Caller(tenant_id=key.tenant_id, tenant_name=key.tenant.name, key_id=key.id, key_prefix=key.prefix)


CurrentCaller = Annotated[Caller, Depends(current_caller)]
AdminCaller = Annotated[Caller, Depends(require_admin)]
