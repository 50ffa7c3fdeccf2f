"""The audit log of tenant, key and quota changes: ``audit`` adds an event to the session of the change it
describes (committed with it, or not at all), naming its actor (``key:<prefix>`` from the admin API,
``cli:<user>`` from the CLI); ``audit_events_page`` reads the log back, newest first.
"""

from __future__ import annotations

import getpass
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.pagination import InvalidCursor, Page, keyset
from tessera.errors import InvalidConfig, NotFound
from tessera.models import AUDIT_TARGET_TYPES, AuditEvent, Tenant


def local_actor() -> str:
    """The actor of a change made on this host without an API key (the CLI): ``cli:<login name>``."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no login name in this environment (e.g. a bare container)
        return "cli"


def audit(
    session: Session,
    *,
    actor: str | None,
    action: str,
    target_type: str,
    target: str,
    tenant_id: str | None,
    before: Mapping[str, Any] | None = None,
    after: Mapping[str, Any] | None = None,
) -> AuditEvent:
    """Add one audit event to ``session``; it is committed with the change it describes, or not at all.
    ``before``/``after`` hold plain values only (datetimes as ISO strings); callers never pass secrets."""
    if target_type not in AUDIT_TARGET_TYPES:
        raise InvalidConfig(
            f"invalid audit target type {target_type!r}: one of {', '.join(AUDIT_TARGET_TYPES)}"
        )
    event = AuditEvent(
        tenant_id=tenant_id,
        actor=actor or local_actor(),
        action=action,
        target_type=target_type,
        target=target,
        before=None if before is None else _plain(before),
        after=None if after is None else _plain(after),
    )
    session.add(event)
    return event


def audit_events_page(
    session: Session,
    *,
    tenant: str | None = None,
    target_type: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> Page[AuditEvent]:
    """Tenant, key and quota changes, newest first, optionally of one tenant (by name) and one target type.
    The log outlives what it describes, but a filter by a tenant that does not exist is ``NotFound``."""
    query = select(AuditEvent)
    if tenant is not None:
        tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == tenant))
        if tenant_id is None:
            raise NotFound(f"no tenant named {tenant!r}; `tessera tenants list` shows them")
        query = query.where(AuditEvent.tenant_id == tenant_id)
    if target_type is not None:
        if target_type not in AUDIT_TARGET_TYPES:
            raise InvalidCursor(
                f"invalid target_type {target_type!r}: choose from {', '.join(AUDIT_TARGET_TYPES)}"
            )
        query = query.where(AuditEvent.target_type == target_type)
    return keyset(session, query, (AuditEvent.id,), cursor, limit, descending=True)


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in values.items()}
