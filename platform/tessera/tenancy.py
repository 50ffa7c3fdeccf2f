"""Tenants and their API keys: the operations the CLI and the admin API share.

Each function is one unit of work: it validates, writes and commits (or rolls back and raises). Every change to a
tenant or a key writes an audit event in the same transaction (``tessera.audit``), naming its actor: the admin
API passes ``key:<prefix>``, and a caller that names none is the local operator (``cli:<user>``). Errors are
``tessera.errors`` ``ServiceError``s whose message says what was wrong and what to do: ``NotFound`` (HTTP 404),
``Conflict`` (409), ``InvalidConfig`` (422).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.pagination import Page, keyset, offset_page
from tessera import auth
from tessera.audit import audit
from tessera.db import commit_unique
from tessera.errors import Conflict, InvalidConfig, NotFound
from tessera.models import SCOPE_INFERENCE, SCOPES, ApiKey, Tenant, new_id, utcnow

TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def key_state(key: ApiKey) -> dict[str, Any]:
    """What the audit log records of a key: never its secret, hash or salt."""
    return {
        "name": key.name,
        "scopes": key.scope_list,
        "expires_at": key.expires_at,
        "revoked_at": key.revoked_at,
    }


# --- tenants ---------------------------------------------------------------------------------------------


def create_tenant(session: Session, name: str, *, actor: str | None = None) -> Tenant:
    if not TENANT_NAME_RE.match(name):
        raise InvalidConfig(
            f"invalid tenant name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise Conflict(f"tenant {name!r} already exists")
    tenant = Tenant(id=new_id(), name=name)  # the id now, for the audit event
    session.add(tenant)
    audit(
        session,
        actor=actor,
        action="create",
        target_type="tenant",
        target=name,
        tenant_id=tenant.id,
        after={"name": name, "disabled": False},
    )
    commit_unique(session, f"tenant {name!r} already exists")
    return tenant


def get_tenant(session: Session, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}; `tessera tenants list` shows them")
    return tenant


def list_tenants(session: Session, *, limit: int | None = None, offset: int = 0) -> list[Tenant]:
    return offset_page(session, select(Tenant).order_by(Tenant.created_at, Tenant.id), limit, offset)


def set_tenant_disabled(
    session: Session,
    name: str,
    disabled: bool,
    *,
    version: auth.KeyVersion | None = None,
    actor: str | None = None,
) -> Tenant:
    """Disable (or re-enable) a tenant: its keys stop (or start again) authenticating, in every API process
    sharing ``version`` (default: the settings' Redis) by their next request. Audited when it changes."""
    tenant = get_tenant(session, name)
    if tenant.disabled != disabled:
        audit(
            session,
            actor=actor,
            action="suspend" if disabled else "restore",
            target_type="tenant",
            target=name,
            tenant_id=tenant.id,
            before={"disabled": tenant.disabled},
            after={"disabled": disabled},
        )
    tenant.disabled = disabled
    session.commit()
    auth.key_cache.invalidate(tenant_id=tenant.id)
    if disabled:  # only valid keys are cached: enabling has nothing to drop
        auth.announce_key_change(version)
    return tenant


# --- API keys --------------------------------------------------------------------------------------------


def create_key(
    session: Session,
    tenant: str,
    *,
    scopes: Iterable[str] = (SCOPE_INFERENCE,),
    name: str = "",
    expires_at: datetime | None = None,
    actor: str | None = None,
) -> tuple[ApiKey, str]:
    """A new key for the tenant named ``tenant``, valid until ``expires_at`` (default: until revoked); returns
    the stored key and the raw secret key, which is never stored and cannot be recovered: hand it to the
    user now."""
    if expires_at is not None and expires_at.tzinfo is None:
        raise InvalidConfig(f"expires_at {expires_at.isoformat()} has no time zone; give an aware time (UTC)")
    if expires_at is not None and expires_at <= utcnow():
        raise InvalidConfig(f"expires_at {expires_at.isoformat()} is in the past; give a future time")
    scope_list = list(dict.fromkeys(scopes))
    unknown = [s for s in scope_list if s not in SCOPES]
    if unknown or not scope_list:
        raise InvalidConfig(f"invalid scopes {scope_list!r}: choose from {', '.join(SCOPES)}")
    if len(name) > 100:
        raise InvalidConfig(f"key name is {len(name)} characters; at most 100 are allowed")
    owner = get_tenant(session, tenant)
    for _ in range(5):  # 36^8 ≈ 2.8e12 prefixes: a collision is rare, but retry if one happens
        new = auth.generate_key()
        if session.scalar(select(ApiKey.id).where(ApiKey.prefix == new.prefix)) is None:
            break
    key = ApiKey(
        tenant_id=owner.id,
        prefix=new.prefix,
        hash=new.hash,
        salt=new.salt,
        scopes=",".join(scope_list),
        name=name,
        expires_at=expires_at,
    )
    session.add(key)
    audit(
        session,
        actor=actor,
        action="create",
        target_type="key",
        target=key.prefix,
        tenant_id=owner.id,
        after=key_state(key),
    )
    commit_unique(session, "key prefix collision; try again")
    return key, new.raw


def list_keys(session: Session, tenant: str, *, limit: int | None = None, offset: int = 0) -> list[ApiKey]:
    owner = get_tenant(session, tenant)
    query = select(ApiKey).where(ApiKey.tenant_id == owner.id).order_by(ApiKey.created_at, ApiKey.id)
    return offset_page(session, query, limit, offset)


def get_key(session: Session, prefix: str) -> ApiKey:
    """The key with this prefix, given bare (``ab12cd34``), as ``tsk_ab12cd34`` or as the whole key."""
    prefix = auth.parse_prefix(prefix) or prefix.removeprefix(auth.KEY_PREFIX)
    key = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
    if key is None:
        raise NotFound(f"no API key with prefix {prefix!r}; `tessera keys list --tenant NAME` shows them")
    return key


def revoke_key(
    session: Session, prefix: str, *, version: auth.KeyVersion | None = None, actor: str | None = None
) -> ApiKey:
    """Revoke a key: it stops authenticating at once in this process, and by their next request in every API
    process sharing ``version`` (default: the settings' Redis). Revoking a revoked key changes nothing."""
    key = get_key(session, prefix)
    if key.revoked_at is None:
        before = key_state(key)
        key.revoked_at = utcnow()
        audit(
            session,
            actor=actor,
            action="revoke",
            target_type="key",
            target=key.prefix,
            tenant_id=key.tenant_id,
            before=before,
            after=key_state(key),
        )
        session.commit()
    # After the commit: invalidating earlier would let a concurrent verify re-cache the still-valid row.
    auth.key_cache.invalidate(prefix=key.prefix)
    auth.announce_key_change(version)
    return key


_UNCHANGED: Any = object()


def update_key(
    session: Session,
    prefix: str,
    *,
    name: str | None = None,
    expires_at: datetime | None = _UNCHANGED,
    version: auth.KeyVersion | None = None,
    actor: str | None = None,
) -> ApiKey:
    """Rename a key or change its expiry (``None``: never expires; a time: an aware future time). An expiry
    change is audited as ``expiry``, a rename as ``update``; a change that changes nothing writes nothing.
    Every API process applies a new expiry by its next request."""
    key = get_key(session, prefix)
    if name is not None and len(name) > 100:
        raise InvalidConfig(f"key name is {len(name)} characters; at most 100 are allowed")
    if expires_at is not _UNCHANGED and expires_at is not None:
        if expires_at.tzinfo is None:
            raise InvalidConfig(
                f"expires_at {expires_at.isoformat()} has no time zone; give an aware time (UTC)"
            )
        if expires_at <= utcnow():
            raise InvalidConfig(f"expires_at {expires_at.isoformat()} is in the past; give a future time")
    if key.revoked_at is not None:
        raise Conflict(f"key {key.prefix!r} is revoked; create a new key instead")
    before = key_state(key)
    if name is not None:
        key.name = name
    if expires_at is not _UNCHANGED:
        key.expires_at = expires_at
    after = key_state(key)
    if after == before:
        return key
    action = "expiry" if after["expires_at"] != before["expires_at"] else "update"
    changed = [k for k in after if after[k] != before[k]]
    audit(
        session,
        actor=actor,
        action=action,
        target_type="key",
        target=key.prefix,
        tenant_id=key.tenant_id,
        before={k: before[k] for k in changed},
        after={k: after[k] for k in changed},
    )
    session.commit()
    auth.key_cache.invalidate(prefix=key.prefix)
    auth.announce_key_change(version)
    return key


# --- pages -----------------------------------------------------------------------------------------------


def tenants_page(session: Session, *, cursor: str | None = None, limit: int = 50) -> Page[Tenant]:
    return keyset(session, select(Tenant), (Tenant.created_at, Tenant.id), cursor, limit)


def keys_page(session: Session, tenant: str, *, cursor: str | None = None, limit: int = 50) -> Page[ApiKey]:
    owner = get_tenant(session, tenant)
    query = select(ApiKey).where(ApiKey.tenant_id == owner.id)
    return keyset(session, query, (ApiKey.created_at, ApiKey.id), cursor, limit)
