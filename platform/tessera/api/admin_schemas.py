"""Request and response bodies of the admin API (``/admin``); the deployment config itself is
``tessera.deployments.DeploymentConfig``, so the API, the CLI and the database validate one model."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, create_model, field_validator
from pydantic.fields import FieldInfo

from tessera.deployments import (
    EDITABLE_FIELDS,
    Deployment,
    DeploymentAudit,
    DeploymentConfig,
    deployment_config,
)
from tessera.limits import Limits
from tessera.models import SCOPE_INFERENCE, ApiKey, AuditEvent, Tenant

T = TypeVar("T")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, never silently ignored


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ListResponse(BaseModel, Generic[T]):
    data: list[T]
    next_cursor: str | None = Field(
        description="pass as ?cursor= for the next page; null on the last page", default=None
    )


# --- tenants ---------------------------------------------------------------------------------------------


class TenantCreate(_Request):
    name: str = Field(description="1-64 letters, digits, '.', '_' or '-'", examples=["acme"])


class TenantUpdate(_Request):
    # Strict: true or false only, never 0.0, 1 or "no" read as one of them.
    disabled: StrictBool | None = Field(
        None, description="true suspends the tenant: its keys stop authenticating"
    )


class TenantOut(BaseModel):
    id: str
    name: str
    disabled: bool
    created_at: datetime

    @classmethod
    def of(cls, tenant: Tenant) -> TenantOut:
        return cls(id=tenant.id, name=tenant.name, disabled=tenant.disabled, created_at=tenant.created_at)


# --- keys ------------------------------------------------------------------------------------------------


class KeyCreate(_Request):
    name: str = Field("", max_length=100)
    scopes: list[str] = Field(default_factory=lambda: [SCOPE_INFERENCE], examples=[["inference"]])
    expires_at: datetime | None = Field(None, description="an aware time (UTC); null: valid until revoked")


class KeyOut(BaseModel):
    id: str = Field(description="the key's prefix: the {key_id} of /admin/keys routes")
    prefix: str = Field(description="how the key begins, e.g. tsk_ab12cd34")
    tenant: str
    name: str
    scopes: list[str]
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None

    @classmethod
    def of(cls, key: ApiKey, tenant: str) -> KeyOut:
        return cls(
            id=key.prefix,
            prefix=f"tsk_{key.prefix}",
            tenant=tenant,
            name=key.name,
            scopes=key.scope_list,
            created_at=key.created_at,
            expires_at=key.expires_at,
            revoked_at=key.revoked_at,
            last_used_at=key.last_used_at,
        )


class KeyUpdate(_Request):
    name: str | None = Field(None, max_length=100, description="a new label; unset: unchanged")
    expires_at: datetime | None = Field(
        None, description="an aware future time (UTC); null: valid until revoked; unset: unchanged"
    )


class KeyCreated(KeyOut):
    secret: str = Field(description="the whole key: shown this once, never stored, cannot be recovered")


# --- quotas ----------------------------------------------------------------------------------------------


class Quotas(_Request):
    """Each limit unset (null) is unlimited; for a key override, unset means the tenant's limit applies."""

    rpm: int | None = Field(None, ge=0, description="requests per sliding minute")
    tpm: int | None = Field(
        None, ge=0, description="tokens per sliding minute (prompt + max_tokens reserved)"
    )
    concurrency: int | None = Field(None, ge=0, description="requests in flight")
    daily_tokens: int | None = Field(None, ge=0, description="tokens per UTC day")
    monthly_tokens: int | None = Field(None, ge=0, description="tokens per UTC month")
    monthly_spend_usd: float | None = Field(
        None,
        ge=0,
        le=1e9,
        description="spend per UTC month in USD (kept in micro-USD: at most 6 decimals); each request reserves "
        "its prompt at the fresh price plus max_tokens at the output price, settled to its real cost",
    )

    @field_validator("monthly_spend_usd")
    @classmethod
    def _whole_micro_usd(cls, value: float | None) -> float | None:
        if value is not None and abs(value * 1_000_000 - round(value * 1_000_000)) > 1e-6:
            raise ValueError("monthly_spend_usd has more than 6 decimals (the budget is kept in micro-USD)")
        return value

    def limits(self) -> Limits:
        values = self.model_dump()
        spend = values.pop("monthly_spend_usd")
        return Limits(**values, monthly_spend=None if spend is None else round(spend * 1_000_000))

    @classmethod
    def of(cls, limits: Limits) -> Quotas:
        values = {name: getattr(limits, name) for name in cls.model_fields if name != "monthly_spend_usd"}
        spend = limits.monthly_spend
        return cls(**values, monthly_spend_usd=None if spend is None else spend / 1_000_000)


class KeyQuota(BaseModel):
    key: str
    tenant: str
    override: Quotas | None = Field(description="the key's own limits; null: the tenant's apply")
    effective: Quotas = Field(description="the tenant's limits with the override applied")


# --- deployments -----------------------------------------------------------------------------------------


def _optional(field: FieldInfo) -> tuple[Any, FieldInfo]:
    """A DeploymentConfig field as a change: unset or null by default, strict if a boolean (true or false
    only, never 0 or "no"), its description kept. The whole resulting config is validated by
    ``tessera.deployments``, so its constraints are checked there, once, with its messages."""
    annotation = StrictBool if field.annotation is bool else field.annotation
    return annotation | None, Field(None, description=field.description)


DeploymentUpdate = create_model(
    "DeploymentUpdate",
    __base__=_Request,
    __doc__="The fields to change; every other field keeps its value. The whole resulting config is validated.",
    __module__=__name__,
    **{name: _optional(DeploymentConfig.model_fields[name]) for name in EDITABLE_FIELDS},
)


class DeploymentOut(DeploymentConfig):
    model_config = ConfigDict(extra="ignore")

    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, deployment: Deployment) -> DeploymentOut:
        config = deployment_config(deployment).model_dump()
        return cls(**config, created_at=deployment.created_at, updated_at=deployment.updated_at)


class AuditEntry(BaseModel):
    id: int
    deployment: str
    actor: str = Field(description="who: 'key:<prefix>' for the admin API, 'cli:<user>' for the CLI")
    action: str = Field(description="create | update")
    at: datetime
    changes: dict[str, list[Any]] = Field(description="{field: [before, after]}; before is null on create")

    @classmethod
    def of(cls, entry: DeploymentAudit) -> AuditEntry:
        return cls(
            id=entry.id,
            deployment=entry.deployment,
            actor=entry.actor,
            action=entry.action,
            at=entry.created_at,
            changes=entry.changes,
        )


class AuditEventOut(BaseModel):
    id: int
    at: datetime
    actor: str = Field(description="who: 'key:<prefix>' for the admin API, 'cli:<user>' for the CLI")
    action: str = Field(description="create | update | suspend | restore | revoke | expiry | set")
    target_type: str = Field(description="tenant | key | quota")
    target: str = Field(
        description="a tenant name, a key prefix, or 'tenant:<name>' / 'key:<prefix>' (quotas)"
    )
    tenant_id: str | None
    before: dict[str, Any] | None = Field(description="the changed values before; null on create")
    after: dict[str, Any] | None = Field(description="the values after; null when removed")

    @classmethod
    def of(cls, event: AuditEvent) -> AuditEventOut:
        return cls(
            id=event.id,
            at=event.created_at,
            actor=event.actor,
            action=event.action,
            target_type=event.target_type,
            target=event.target,
            tenant_id=event.tenant_id,
            before=event.before,
            after=event.after,
        )


# --- pools -----------------------------------------------------------------------------------------------


class WorkerStatus(BaseModel):
    worker_id: str
    host: str
    pid: int
    queue: str
    queue_depth: int = Field(description="tasks waiting in this worker's own (affinity) queue")
    last_seen: datetime
    kv_format: str
    kv_pages_used: int
    kv_pages_total: int
    running: int
    waiting: int
    integrity_mismatches: int
    generated_tokens: int = Field(description="tokens its engine generated since it started")
    steps: int = Field(
        description="engine steps since it started; generated_tokens / steps is its mean batch of sampled rows"
    )
    preemptions: int = Field(
        description="sequences its engine preempted for lack of KV pages (recomputed later) since it started"
    )
    config_version: int | None = Field(
        description="the deployment config version it serves (its count of audited changes); null if "
        "none was announced"
    )
    integrity_check: bool | None
    draining: bool = Field(description="finishing its requests on the old config before it restarts")


class PoolStatus(BaseModel):
    deployment: str
    pool: str = Field(description="serve | prefill | decode")
    enabled: bool
    live_workers: int
    queue: str
    queue_depth: int = Field(description="tasks waiting in the pool's queue and its live workers' queues")
    kv_pages_used: int
    kv_pages_total: int
    kv_formats: list[str] = Field(
        description="the KV formats its live workers run (two while a change drains)"
    )
    prefix_cache_hit_rate: float | None = Field(
        description="hit tokens / query tokens; null before any query"
    )
    integrity_mismatches: int
    workers: list[WorkerStatus]
