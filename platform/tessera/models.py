"""The control plane's tables: tenants, API keys (and their quotas), request records, the audit log and
batches; the deployments' tables live beside their config, in ``tessera.deployments``.

The schema is created by Alembic (``migrations/``); tests prove these models and the migrations agree.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from billing.schema import UTCDateTime  # one definition for both packages' tables

# Stable constraint names, so migrations can drop and alter them identically on SQLite and PostgreSQL.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SCOPE_INFERENCE = "inference"
SCOPE_ADMIN = "admin"
SCOPES = (SCOPE_INFERENCE, SCOPE_ADMIN)

REQUEST_STATUSES = ("queued", "running", "completed", "failed", "cancelled")
FINAL_STATUSES = ("completed", "failed", "cancelled")  # a record in one of these never changes again


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id() -> str:
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON()}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    disabled: Mapped[bool] = mapped_column(default=False)

    def __repr__(self) -> str:
        return f"Tenant(name={self.name!r}, id={self.id!r}, disabled={self.disabled})"


class ApiKey(Base):
    """A tenant's API key: ``tsk_<prefix>_<secret>``; only the prefix and a salted hash are stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True, index=True)
    hash: Mapped[str] = mapped_column(String(64))  # hex SHA-256 of salt + key (see tessera.auth)
    salt: Mapped[str] = mapped_column(String(32))  # hex, random per key
    scopes: Mapped[str] = mapped_column(String(200), default=SCOPE_INFERENCE)  # comma-separated
    name: Mapped[str] = mapped_column(String(100), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]  # None: never expires
    last_used_at: Mapped[datetime | None]

    tenant: Mapped[Tenant] = relationship()

    @property
    def scope_list(self) -> list[str]:
        return [s for s in self.scopes.split(",") if s]

    def has_scope(self, scope: str) -> bool:
        return scope in self.scope_list

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def __repr__(self) -> str:
        return f"ApiKey(prefix={self.prefix!r}, tenant_id={self.tenant_id!r}, scopes={self.scopes!r})"


class RequestRecord(Base):
    """One inference request's outcome, token counts and timings; settled once (see ``records.settle_records``).
    The gateway's records arrive through the outcome stream (``tessera.records``)."""

    __tablename__ = "request_records"
    __table_args__ = (Index("ix_request_records_tenant_id_created_at", "tenant_id", "created_at"),)

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    # The model id as called; no foreign key, so records outlive a deployment's removal or rename.
    deployment: Mapped[str] = mapped_column(String(200))
    model: Mapped[str | None] = mapped_column(String(200))  # the model id the client asked for
    status: Mapped[str] = mapped_column(String(20))  # one of REQUEST_STATUSES
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    cached_tokens: Mapped[int] = mapped_column(default=0)
    completion_tokens: Mapped[int] = mapped_column(default=0)
    error_code: Mapped[str | None] = mapped_column(String(64))
    ttft_s: Mapped[float | None]  # seconds from the gateway's start of the request to its first token
    duration_s: Mapped[float | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)  # when the gateway started the request
    finished_at: Mapped[datetime | None]


class QuotaLimits(Base):
    """A tenant's quota limits, or one key's override of them (``tessera.quota_config``); a null limit is
    unlimited (for a key: the tenant's applies). Enforced in Redis by ``tessera.quotas``."""

    __tablename__ = "quota_limits"

    scope: Mapped[str] = mapped_column(String(40), primary_key=True)  # "tenant:<id>" or "key:<id>"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    rpm: Mapped[int | None]
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    concurrency: Mapped[int | None]
    daily_tokens: Mapped[int | None] = mapped_column(BigInteger)
    monthly_tokens: Mapped[int | None] = mapped_column(BigInteger)
    monthly_spend: Mapped[int | None] = mapped_column(BigInteger)  # micro-USD per UTC month
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


# --- audit log and Workers-AI batches (issue 11) ---------------------------------------------------------

AUDIT_TARGET_TYPES = ("tenant", "key", "quota")
BATCH_ITEM_STATUSES = ("queued", "running", "completed", "failed")


class AuditEvent(Base):
    """One change to a tenant, a key or a quota, written in the same transaction as the change: who, when,
    what and the values before and after (never a secret or a key hash). See ``tessera.tenancy``."""

    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_tenant_id_id", "tenant_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # No foreign key: the log outlives what it describes.
    tenant_id: Mapped[str | None] = mapped_column(String(32))
    actor: Mapped[str] = mapped_column(String(200))  # "key:<prefix>" (admin API) or "cli:<user>"
    action: Mapped[str] = mapped_column(String(20))  # create, update, suspend, restore, revoke, expiry, set
    target_type: Mapped[str] = mapped_column(String(20))  # one of AUDIT_TARGET_TYPES
    target: Mapped[str] = mapped_column(String(200))  # a tenant name, a key prefix, "tenant:<name>" ...
    before: Mapped[dict[str, Any] | None]
    after: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Batch(Base):
    """A Workers-AI async batch (``?queueRequest=true``): its id is the ``request_id`` the tenant polls."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    model: Mapped[str] = mapped_column(String(200))
    items: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class BatchItem(Base):
    """One request of a batch: its run body, and where it is (queued, running, completed, failed). Claimed
    by one batch runner at a time (``UPDATE ... WHERE status = 'queued'``); each attempt is its own request."""

    __tablename__ = "batch_items"
    __table_args__ = (Index("ix_batch_items_status_claimed_by", "status", "claimed_by"),)

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    body: Mapped[dict[str, Any]]  # the item as validated (Workers AI's run body)
    external_reference: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20), default="queued")  # one of BATCH_ITEM_STATUSES
    attempts: Mapped[int] = mapped_column(default=0)  # dispatches that reached a worker
    request_id: Mapped[str | None] = mapped_column(String(64))  # the latest attempt's request id
    claimed_by: Mapped[str | None] = mapped_column(String(64))  # the runner running it
    result: Mapped[dict[str, Any] | None]  # {"response", "usage"} once completed
    error: Mapped[dict[str, Any] | None]  # {"code", "message"} once failed
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
