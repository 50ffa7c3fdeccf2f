"""Where quota limits are configured: a tenant's limits and a key's override in the database (shared by the CLI
and the admin API), and the short-lived cached lookup the gateway turns into ``tessera.quotas`` scopes.

A key's override replaces only the limits it sets; the gateway enforces the tenant's limits over all its keys
and, for a key with an override, the merged limits over that key alone.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from datetime import datetime, timezone

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from billing.schema import Rollup
from tessera import tenancy
from tessera.audit import audit
from tessera.errors import InvalidConfig, NotFound
from tessera.limits import LIMITS, Limits, Scope
from tessera.loading_cache import LoadingCache
from tessera.models import ApiKey, QuotaLimits, Tenant

CACHE_TTL_S = 1.0  # an admin's change reaches every API process within about this long
MAX_LIMIT = 10**15  # Redis' Lua numbers are doubles: stay far below 2**53


def tenant_scope(tenant_id: str) -> str:
    return f"tenant:{tenant_id}"


def key_scope(key_id: str) -> str:
    return f"key:{key_id}"


def validate_limits(limits: Limits) -> Limits:
    """``limits`` if every limit is unset or a whole number in [0, 10**15], else ``InvalidConfig`` naming each."""
    bad = []
    for name in LIMITS:
        value = getattr(limits, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LIMIT:
            bad.append(f"{name}={value!r}")
    if bad:
        raise InvalidConfig(
            f"invalid quota limits {', '.join(bad)}: each must be a whole number from 0 to {MAX_LIMIT}, "
            "or unset (unlimited)"
        )
    return limits


def get_limits(session: Session, tenant_name_or_id: str) -> Limits:
    """The tenant's limits (all unset, i.e. unlimited, if none were ever set)."""
    tenant = _tenant(session, tenant_name_or_id)
    return _limits(session.get(QuotaLimits, tenant_scope(tenant.id)))


def get_key_limits(session: Session, key_prefix: str) -> Limits | None:
    """The key's override of its tenant's limits, or None when it has none."""
    key = tenancy.get_key(session, key_prefix)
    row = session.get(QuotaLimits, key_scope(key.id))
    return None if row is None else _limits(row)


def set_limits(
    session: Session, tenant: str, limits: Limits, key_prefix: str | None = None, *, actor: str | None = None
) -> Limits:
    """Replace the tenant's limits (or, with ``key_prefix``, that key's override) with ``limits``; a limit left
    unset is unlimited (for a key: the tenant's applies). Setting no limit at all removes a key's override.
    Every API process applies the change within ``CACHE_TTL_S``. Audited (``audit``) with the change."""
    validate_limits(limits)
    owner = _tenant(session, tenant)
    key: ApiKey | None = None
    if key_prefix is not None:
        key = tenancy.get_key(session, key_prefix)
        if key.tenant_id != owner.id:
            raise NotFound(
                f"tenant {owner.name!r} has no API key with prefix {key.prefix!r}; "
                f"`tessera keys list --tenant {owner.name}` shows its keys"
            )
    scope = key_scope(key.id) if key is not None else tenant_scope(owner.id)
    row = session.get(QuotaLimits, scope)
    # Audited in the same transaction as the change (committed below), so neither exists without the other.
    before = None if key is not None and row is None else _limits(row)
    after = None if key is not None and limits.unlimited else limits
    if before != after:
        audit(
            session,
            actor=actor,
            action="set",
            target_type="quota",
            target=f"key:{key.prefix}" if key is not None else f"tenant:{owner.name}",
            tenant_id=owner.id,
            before=None if before is None else asdict(before),
            after=None if after is None else asdict(after),
        )
    if key is not None and limits.unlimited:
        if row is not None:
            session.delete(row)
        session.commit()
        return limits
    if row is None:
        row = QuotaLimits(scope=scope, tenant_id=owner.id, key_id=key.id if key is not None else None)
        session.add(row)
    for name in LIMITS:
        setattr(row, name, getattr(limits, name))
    session.commit()
    return limits


def list_key_limits(session: Session, tenant: str) -> dict[str, Limits]:
    """Every key override of the tenant, by key prefix."""
    owner = _tenant(session, tenant)
    rows = session.execute(
        select(ApiKey.prefix, QuotaLimits)
        .join(QuotaLimits, QuotaLimits.key_id == ApiKey.id)
        .where(QuotaLimits.tenant_id == owner.id)
        .order_by(ApiKey.prefix)
    )
    return {prefix: _limits(row) for prefix, row in rows}


class QuotaLookup:
    """The scopes a caller's request is admitted against, read from the database at most once per
    ``ttl_s`` per (tenant, key): when an entry expires, the requests that find it so wait for one read
    instead of each making its own. The gateway asks ``cached`` on its event loop and ``scopes`` (which may
    read the database) from a thread."""

    def __init__(
        self, sessions: sessionmaker[Session], ttl_s: float = CACHE_TTL_S, max_entries: int = 10_000
    ):
        self.sessions = sessions
        self._cache: LoadingCache[tuple[str, str], list[Scope]] = LoadingCache(ttl_s, max_entries)

    def scopes(self, tenant_id: str, key_id: str) -> list[Scope]:
        return self._cache.get((tenant_id, key_id), lambda: self._load(tenant_id, key_id))

    def cached(self, tenant_id: str, key_id: str) -> list[Scope] | None:
        """The scopes if they are cached and fresh, else None: no database query (the event loop may ask)."""
        try:
            return self._cache.cached((tenant_id, key_id))
        except KeyError:
            return None

    def _load(self, tenant_id: str, key_id: str) -> list[Scope]:
        names = (tenant_scope(tenant_id), key_scope(key_id))
        with self.sessions() as session:
            rows = {
                r.scope: r for r in session.scalars(select(QuotaLimits).where(QuotaLimits.scope.in_(names)))
            }
            tenant = _limits(rows.get(names[0]))
            scopes = [Scope(names[0], tenant, _month_spent(session, tenant, tenant_id))]
            if names[1] in rows:
                key = tenant.merged(_limits(rows[names[1]]))
                scopes.append(Scope(names[1], key, _month_spent(session, key, tenant_id, key_id)))
        return scopes


def _month_spent(session: Session, limits: Limits, tenant_id: str, key_id: str | None = None) -> int:
    """Micro-USD of the current UTC month in the ledger's rollups, for a scope with a spend budget (else 0)."""
    if limits.monthly_spend is None:
        return 0
    today = datetime.now(timezone.utc).date()
    query = select(func.coalesce(func.sum(Rollup.cost), 0)).where(
        Rollup.tenant_id == tenant_id, Rollup.day >= today.replace(day=1)
    )
    if key_id is not None:
        query = query.where(Rollup.key_id == key_id)
    return int(session.scalar(query))


def _tenant(session: Session, name_or_id: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name_or_id)) or session.get(
        Tenant, name_or_id
    )
    if tenant is None:
        raise NotFound(f"no tenant named {name_or_id!r}; `tessera tenants list` shows them")
    return tenant


def _limits(row: QuotaLimits | None) -> Limits:
    if row is None:
        return Limits()
    return Limits(**{f.name: getattr(row, f.name) for f in fields(Limits)})
