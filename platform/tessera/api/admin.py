"""The admin API under ``/admin``: tenants, keys, quotas, deployments (config and audit log) and pool status.

Admin-scoped keys only (``require_admin``: 401 without a valid key, 403 for a key without the scope). Every
route calls the same service layer as the CLI (``tessera.tenancy``, ``tessera.quota_config``); every change
names its actor ``key:<prefix>`` and is audited in the same transaction: deployment changes in their own log
(``/admin/deployments/{name}/audit``), tenant, key and quota changes in ``/admin/audit``. Routes that touch
the database are sync, so FastAPI runs them in its thread pool.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.convertors import Convertor, register_url_convertor

from billing.pagination import MAX_PAGE, InvalidCursor, Page
from gpu_workers.protocol import POOLS, WorkerInfo, pool_queue
from tessera import deployments, quota_config, routing, tenancy
from tessera.api.admin_schemas import (
    AuditEntry,
    AuditEventOut,
    DeploymentOut,
    DeploymentUpdate,
    ErrorResponse,
    KeyCreate,
    KeyCreated,
    KeyOut,
    KeyQuota,
    KeyUpdate,
    ListResponse,
    PoolStatus,
    Quotas,
    TenantCreate,
    TenantOut,
    TenantUpdate,
    WorkerStatus,
)
from tessera.api.deps import AdminCaller, Caller, require_admin
from tessera.audit import audit_events_page
from tessera.deployments import DeploymentConfig
from tessera.errors import APIError, Conflict, InvalidConfig, NotFound

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "invalid request: a bad field, parameter or cursor"),
        (401, "no valid API key"),
        (403, "the key lacks the admin scope"),
        (404, "no such tenant, key or deployment"),
        (409, "already exists"),
        (422, "the configuration is invalid; the message names each problem"),
    )
}
router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)], responses=_ERRORS)


class DeploymentName(Convertor[str]):
    """A deployment name in a path: slashes allowed (``@hf/smollm2``), but never ending in ``/audit``, so that
    ``/deployments/{name}/audit`` answers a method it lacks with 405 rather than being read as a deployment
    named ``.../audit``."""

    regex = r".+(?<!/audit)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("deployment", DeploymentName())

Cursor = Annotated[str | None, Query(description="next_cursor of the previous page; omit for the first")]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="items per page")]


@contextmanager
def _session(request: Request) -> Iterator[Session]:
    """A database session whose service errors become our HTTP errors."""
    with request.app.state.sessions() as session:
        try:
            yield session
        except NotFound as exc:
            raise APIError(404, str(exc), "not_found") from None
        except Conflict as exc:
            raise APIError(409, str(exc), "conflict") from None
        except InvalidCursor as exc:
            raise APIError(400, str(exc), "invalid_request", param="cursor") from None
        except InvalidConfig as exc:
            raise APIError(422, str(exc), "invalid_config") from None


def _actor(caller: Caller) -> str:
    return f"key:{caller.key_prefix}"


# --- tenants ---------------------------------------------------------------------------------------------


@router.get("/tenants", response_model=ListResponse[TenantOut])
def list_tenants(request: Request, cursor: Cursor = None, limit: Limit = 50) -> ListResponse[TenantOut]:
    with _session(request) as session:
        page = tenancy.tenants_page(session, cursor=cursor, limit=limit)
        return ListResponse(data=[TenantOut.of(t) for t in page.items], next_cursor=page.next_cursor)


@router.post("/tenants", response_model=TenantOut, status_code=201)
def create_tenant(request: Request, body: TenantCreate, caller: AdminCaller) -> TenantOut:
    with _session(request) as session:
        tenant = tenancy.create_tenant(session, body.name, actor=_actor(caller))
        return TenantOut.of(tenant)


@router.get("/tenants/{tenant}", response_model=TenantOut)
def get_tenant(request: Request, tenant: str) -> TenantOut:
    with _session(request) as session:
        return TenantOut.of(tenancy.get_tenant(session, tenant))


@router.patch("/tenants/{tenant}", response_model=TenantOut)
def update_tenant(request: Request, tenant: str, body: TenantUpdate, caller: AdminCaller) -> TenantOut:
    """Suspend (``disabled: true``) or restore a tenant; a suspended tenant's keys are refused at once."""
    with _session(request) as session:
        if body.disabled is None:
            return TenantOut.of(tenancy.get_tenant(session, tenant))
        updated = tenancy.set_tenant_disabled(
            session, tenant, body.disabled, version=request.app.state.key_version, actor=_actor(caller)
        )
        return TenantOut.of(updated)


# --- quotas ----------------------------------------------------------------------------------------------


@router.get("/tenants/{tenant}/quotas", response_model=Quotas)
def get_tenant_quotas(request: Request, tenant: str) -> Quotas:
    with _session(request) as session:
        tenancy.get_tenant(session, tenant)
        return Quotas.of(quota_config.get_limits(session, tenant))


@router.put("/tenants/{tenant}/quotas", response_model=Quotas)
def set_tenant_quotas(request: Request, tenant: str, body: Quotas, caller: AdminCaller) -> Quotas:
    """Replace the tenant's limits: a limit left out or null is unlimited."""
    with _session(request) as session:
        tenancy.get_tenant(session, tenant)
        after = quota_config.set_limits(session, tenant, body.limits(), actor=_actor(caller))
        return Quotas.of(after)


@router.get("/keys/{key_id}/quotas", response_model=KeyQuota)
def get_key_quotas(request: Request, key_id: str) -> KeyQuota:
    with _session(request) as session:
        return _key_quota(session, key_id)


@router.put("/keys/{key_id}/quotas", response_model=KeyQuota)
def set_key_quotas(request: Request, key_id: str, body: Quotas, caller: AdminCaller) -> KeyQuota:
    """Replace the key's override: a limit left out or null falls back to the tenant's; all null removes it."""
    with _session(request) as session:
        key = tenancy.get_key(session, key_id)
        quota_config.set_limits(
            session, key.tenant.name, body.limits(), key_prefix=key.prefix, actor=_actor(caller)
        )
        return _key_quota(session, key.prefix)


def _key_quota(session: Session, key_id: str) -> KeyQuota:
    key = tenancy.get_key(session, key_id)
    override = quota_config.get_key_limits(session, key.prefix)
    effective = quota_config.get_limits(session, key.tenant_id).merged(override)
    return KeyQuota(
        key=key.prefix,
        tenant=key.tenant.name,
        override=None if override is None else Quotas.of(override),
        effective=Quotas.of(effective),
    )


# --- keys ------------------------------------------------------------------------------------------------


@router.get("/tenants/{tenant}/keys", response_model=ListResponse[KeyOut])
def list_keys(
    request: Request, tenant: str, cursor: Cursor = None, limit: Limit = 50
) -> ListResponse[KeyOut]:
    """The tenant's keys, revoked ones included; never their secrets."""
    with _session(request) as session:
        page = tenancy.keys_page(session, tenant, cursor=cursor, limit=limit)
        return ListResponse(data=[KeyOut.of(k, tenant) for k in page.items], next_cursor=page.next_cursor)


@router.post("/tenants/{tenant}/keys", response_model=KeyCreated, status_code=201)
def create_key(request: Request, tenant: str, body: KeyCreate, caller: AdminCaller) -> KeyCreated:
    """A new key; ``secret`` is the whole key, shown in this response only: hand it to its user now."""
    with _session(request) as session:
        key, secret = tenancy.create_key(
            session,
            tenant,
            scopes=body.scopes,
            name=body.name,
            expires_at=body.expires_at,
            actor=_actor(caller),
        )
        return KeyCreated(**KeyOut.of(key, tenant).model_dump(), secret=secret)


@router.delete("/keys/{key_id}", response_model=KeyOut)
def revoke_key(request: Request, key_id: str, caller: AdminCaller) -> KeyOut:
    """Revoke a key: every API process refuses it from its next request. Revoking twice changes nothing."""
    with _session(request) as session:
        key = tenancy.revoke_key(session, key_id, version=request.app.state.key_version, actor=_actor(caller))
        return KeyOut.of(key, key.tenant.name)


@router.patch("/keys/{key_id}", response_model=KeyOut)
def update_key(request: Request, key_id: str, body: KeyUpdate, caller: AdminCaller) -> KeyOut:
    """Rename a key or change its expiry (``expires_at: null`` makes it valid until revoked); audited.
    Every API process applies a new expiry by its next request."""
    with _session(request) as session:
        changes: dict[str, Any] = {}
        if body.name is not None:
            changes["name"] = body.name
        if "expires_at" in body.model_fields_set:
            changes["expires_at"] = body.expires_at
        key = tenancy.update_key(
            session, key_id, **changes, version=request.app.state.key_version, actor=_actor(caller)
        )
        return KeyOut.of(key, key.tenant.name)


# --- audit log -------------------------------------------------------------------------------------------

TargetType = Annotated[
    str | None, Query(description="only changes to this kind of target: tenant | key | quota")
]
TenantFilter = Annotated[str | None, Query(description="only changes to this tenant (its name) and its keys")]


@router.get("/audit", response_model=ListResponse[AuditEventOut])
def list_audit(
    request: Request,
    tenant: TenantFilter = None,
    target_type: TargetType = None,
    cursor: Cursor = None,
    limit: Limit = 50,
) -> ListResponse[AuditEventOut]:
    """Who changed which tenant, key or quota, when, and the values before and after; newest first."""
    with _session(request) as session:
        try:
            page = audit_events_page(
                session, tenant=tenant, target_type=target_type, cursor=cursor, limit=limit
            )
        except InvalidCursor as exc:
            param = "target_type" if "target_type" in str(exc) else "cursor"
            raise APIError(400, str(exc), "invalid_request", param=param) from None
        return ListResponse(data=[AuditEventOut.of(e) for e in page.items], next_cursor=page.next_cursor)


# --- deployments -----------------------------------------------------------------------------------------

CheckCheckpoint = Annotated[
    bool,
    Query(
        description="check the checkpoint folder can give each phase's weight format; turn off when "
        "checkpoints exist only on the worker hosts"
    ),
]


@router.get("/deployments", response_model=ListResponse[DeploymentOut])
def list_deployments(
    request: Request, cursor: Cursor = None, limit: Limit = 50
) -> ListResponse[DeploymentOut]:
    with _session(request) as session:
        page = deployments.deployments_page(session, cursor=cursor, limit=limit)
        return ListResponse(data=[DeploymentOut.of(d) for d in page.items], next_cursor=page.next_cursor)


@router.post("/deployments", response_model=DeploymentOut, status_code=201)
def create_deployment(
    request: Request, body: DeploymentConfig, caller: AdminCaller, check_checkpoint: CheckCheckpoint = True
) -> DeploymentOut:
    with _session(request) as session:
        deployment = deployments.create_deployment(
            session,
            body,
            actor=_actor(caller),
            check_checkpoint_files=check_checkpoint,
            redis=request.app.state.key_version.redis,
        )
        return DeploymentOut.of(deployment)


@router.get("/deployments/{name:path}/audit", response_model=ListResponse[AuditEntry])
def deployment_audit(
    request: Request, name: str, cursor: Cursor = None, limit: Limit = 50
) -> ListResponse[AuditEntry]:
    """Who changed the deployment, when, and each field before and after; newest first."""
    with _session(request) as session:
        page = deployments.audit_page(session, name, cursor=cursor, limit=limit)
        return ListResponse(data=[AuditEntry.of(e) for e in page.items], next_cursor=page.next_cursor)


@router.get("/deployments/{name:deployment}", response_model=DeploymentOut)
def get_deployment(request: Request, name: str) -> DeploymentOut:
    with _session(request) as session:
        return DeploymentOut.of(deployments.get_deployment(session, name))


@router.patch("/deployments/{name:deployment}", response_model=DeploymentOut)
def update_deployment(
    request: Request,
    name: str,
    body: DeploymentUpdate,
    caller: AdminCaller,
    check_checkpoint: CheckCheckpoint = True,
) -> DeploymentOut:
    """Change the given fields; the whole resulting config is validated (422 names each problem) and the
    change is audited. Workers serving the old config finish their requests on it, then restart on the new
    one (``config_version`` in ``/admin/pools``); queued requests wait for them."""
    with _session(request) as session:
        deployment = deployments.update_deployment(
            session,
            name,
            body.model_dump(exclude_unset=True),
            actor=_actor(caller),
            check_checkpoint_files=check_checkpoint,
            redis=request.app.state.key_version.redis,  # announces the config: its workers drain and reload
        )
        return DeploymentOut.of(deployment)


# --- pools -----------------------------------------------------------------------------------------------


@router.get("/pools", response_model=ListResponse[PoolStatus])
async def list_pools(request: Request, cursor: Cursor = None, limit: Limit = 50) -> ListResponse[PoolStatus]:
    """Each deployment's pools, from the workers' heartbeats and the Celery queues in Redis; pages hold
    ``limit`` deployments (all their pools)."""
    page = await run_in_threadpool(_deployments_page, request, cursor, limit)
    gateway = request.app.state.gateway
    now = time.time()
    pools = []
    for name, mode, enabled in page.items:
        expected = ("serve",) if mode == "colocated" else ("prefill", "decode")
        for pool in POOLS:
            workers = await routing.live_workers(
                gateway.redis, name, pool, gateway.settings.worker_heartbeat_ttl_s, now=now
            )
            if workers or pool in expected:  # a pool of the other mode shows while it drains
                pools.append(await _pool_status(gateway.redis, name, pool, enabled, workers))
    return ListResponse(data=pools, next_cursor=page.next_cursor)


def _deployments_page(request: Request, cursor: str | None, limit: int) -> Page[tuple[str, str, bool]]:
    with _session(request) as session:
        page = deployments.deployments_page(session, cursor=cursor, limit=limit)
        return Page([(d.name, d.mode, d.enabled) for d in page.items], page.next_cursor)


async def _pool_status(
    redis: aioredis.Redis, deployment: str, pool: str, enabled: bool, workers: list[WorkerInfo]
) -> PoolStatus:
    queue = pool_queue(deployment, pool)
    workers = sorted(workers, key=lambda w: w.worker_id)
    depths = [await redis.llen(routing.queue_of(w)) for w in workers]
    queried = sum(w.prefix_cache_query_tokens for w in workers)
    hits = sum(w.prefix_cache_hit_tokens for w in workers)
    return PoolStatus(
        deployment=deployment,
        pool=pool,
        enabled=enabled,
        live_workers=len(workers),
        queue=queue,
        queue_depth=await redis.llen(queue) + sum(depths),
        kv_pages_used=sum(w.kv_pages_used for w in workers),
        kv_pages_total=sum(w.kv_pages_total for w in workers),
        kv_formats=sorted({w.kv_format for w in workers if w.kv_format}),
        prefix_cache_hit_rate=hits / queried if queried else None,
        integrity_mismatches=sum(w.integrity_mismatches for w in workers),
        workers=[
            WorkerStatus(
                worker_id=w.worker_id,
                host=w.host,
                pid=w.pid,
                queue=routing.queue_of(w),
                queue_depth=depth,
                last_seen=datetime.fromtimestamp(w.last_seen, timezone.utc),
                kv_format=w.kv_format,
                kv_pages_used=w.kv_pages_used,
                kv_pages_total=w.kv_pages_total,
                running=w.running,
                waiting=w.waiting,
                integrity_mismatches=w.integrity_mismatches,
                generated_tokens=w.generated_tokens,
                steps=w.steps,
                preemptions=w.preemptions,
                config_version=w.config_version,
                integrity_check=w.integrity_check,
                draining=w.draining,
            )
            for w, depth in zip(workers, depths, strict=True)
        ],
    )
