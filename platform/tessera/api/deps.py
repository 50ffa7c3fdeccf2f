"""FastAPI dependencies: who is calling (``Authorization: Bearer <key>``, or the web UI's session cookie → tenant).

The cookie (``api/web.py`` signs it in) names a server-side session; a request that changes something with
it must also send the session's CSRF token in ``X-CSRF-Token``, equal to the ``tessera_csrf`` cookie
(double submit), since a browser attaches cookies on its own."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select
from sqlalchemy.orm import Session, joinedload
from starlette.concurrency import run_in_threadpool

from tessera.auth import MISS, cached_key, key_shaped, verify_in_database
from tessera.errors import APIError
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE, ApiKey, utcnow

SESSION_COOKIE = "tessera_session"
CSRF_COOKIE = "tessera_csrf"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# One message for a missing, malformed, unknown or revoked key: the answer must not say which it was.
UNAUTHORIZED = (
    "invalid API key: send 'Authorization: Bearer <key>' with a valid, unrevoked Tessera key "
    "(tessera keys create makes one)"
)
SESSION_ENDED = (
    "your web session has ended (signed out, expired, or its key was revoked): sign in again at /signin"
)
CSRF_FAILED = (
    "missing or wrong CSRF token: a request made with the session cookie that changes something must send "
    "the page's token (the tessera_csrf cookie) in the X-CSRF-Token header"
)


@dataclass(frozen=True)
class WebSession:
    """A signed-in browser: the key it signed in with (by prefix, never the key) and its CSRF token."""

    key_prefix: str
    tenant_id: str
    csrf: str


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


async def current_caller(request: Request) -> Caller:
    """The caller's tenant and key, or 401. A key verified under the current key version (one async Redis
    read) is answered from this process's cache on the event loop; a cache miss and a session cookie read
    the database, in a thread."""
    key = await _verified_key(request)
    if not key.has_scope(SCOPE_INFERENCE):
        raise APIError(
            403, "this API key lacks the 'inference' scope; use an inference key", "permission_denied"
        )
    return _caller(key)


async def require_admin(request: Request) -> Caller:
    """An admin-scoped caller, or 401 (no valid key) / 403 (a valid key without the admin scope)."""
    key = await _verified_key(request)
    if not key.has_scope(SCOPE_ADMIN):
        raise APIError(
            403,
            "this API key lacks the 'admin' scope; use an admin key (tessera keys create --admin makes one)",
            "permission_denied",
        )
    return _caller(key)


async def _verified_key(request: Request) -> ApiKey:
    header = request.headers.get("authorization")
    if header is None and SESSION_COOKIE in request.cookies:
        return await run_in_threadpool(_cookie_key, request)
    raw = bearer_token(header)
    if not key_shaped(raw):  # no Redis read, no database read
        raise APIError(401, UNAUTHORIZED, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    version = request.app.state.key_version
    # Read before the database (see verify_key), and only once: the cache and the database answer for it.
    current = b"" if version is None else await version.acurrent()
    key = cached_key(raw, current)
    if key is MISS:
        key = await run_in_threadpool(_verify_in_database, request, raw, current)
    if key is None:
        raise APIError(401, UNAUTHORIZED, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return key


def _verify_in_database(request: Request, raw: str, current: bytes | None) -> ApiKey | None:
    with request.app.state.sessions() as session:
        return verify_in_database(session, raw, current)


def _cookie_key(request: Request) -> ApiKey:
    with request.app.state.sessions() as session:
        current = session_key(request, session)
    if current is None:
        raise APIError(401, SESSION_ENDED, "invalid_session")
    web, key = current
    if request.method not in SAFE_METHODS and not _csrf_ok(request, web):
        raise APIError(403, CSRF_FAILED, "csrf_failed")
    return key


def _csrf_ok(request: Request, web: WebSession) -> bool:
    header = request.headers.get(CSRF_HEADER, "")
    cookie = request.cookies.get(CSRF_COOKIE, "")
    return bool(header) and same_token(header, cookie) and same_token(header, web.csrf)


def same_token(given: str, expected: str) -> bool:
    """A constant-time comparison of a token the client sent (any text: compare_digest refuses non-ASCII
    strings, so both are compared as UTF-8 bytes)."""
    return hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    )


def session_key(request: Request, session: Session) -> tuple[WebSession, ApiKey] | None:
    """The web session the request's cookie names and its key, if both are still valid: the key is read
    again on every request, so a revoked or expired key, or a suspended tenant, ends its sessions at once.
    The key comes back detached from ``session`` with its tenant loaded."""
    sessions = getattr(request.app.state, "web_sessions", None)
    cookie = request.cookies.get(SESSION_COOKIE)
    web = sessions.load(cookie) if sessions is not None and cookie else None
    if web is None:
        return None
    key = session.scalars(
        select(ApiKey).options(joinedload(ApiKey.tenant)).where(ApiKey.prefix == web.key_prefix)
    ).one_or_none()
    if key is None or key.revoked_at is not None or key.tenant.disabled:
        return None
    if key.expires_at is not None and key.expires_at <= utcnow():
        return None
    session.expunge(key.tenant)
    session.expunge(key)
    return web, key


def _caller(key: ApiKey) -> Caller:
    return Caller(tenant_id=key.tenant_id, tenant_name=key.tenant.name, key_id=key.id, key_prefix=key.prefix)


CurrentCaller = Annotated[Caller, Depends(current_caller)]
AdminCaller = Annotated[Caller, Depends(require_admin)]
