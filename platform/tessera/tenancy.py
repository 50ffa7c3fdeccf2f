"""Tenants, API keys, deployments and request records: the operations the CLI and the admin API share.

Each function is one unit of work: it validates, writes and commits (or rolls back and raises). Every change to a
tenant, a key or a quota writes an ``AuditEvent`` in the same transaction (``audit``), naming its actor: the
admin API passes ``key:<prefix>``, and a caller that names none is the local operator (``cli:<user>``). Errors are
``TenancyError`` subclasses (``ValueError``s) whose message says what was wrong and what to do:
``NotFound`` (HTTP 404), ``Conflict`` (409), ``InvalidConfig`` (422).
"""

from __future__ import annotations

import functools
import getpass
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from redis import Redis, RedisError
from sqlalchemy import func, literal, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from billing.pagination import InvalidCursor, Page, keyset, offset_page
from billing.upserts import dialect_insert
from gpu_workers.checkpoint import ModelConfig, ModelLoadError
from gpu_workers.gguf_file import is_gguf
from gpu_workers.protocol import DeploymentSpec, config_key, connect_redis
from tessera import auth
from tessera.models import (
    AUDIT_TARGET_TYPES,
    FINAL_STATUSES,
    REQUEST_STATUSES,
    SCOPE_INFERENCE,
    SCOPES,
    ApiKey,
    AuditEvent,
    Deployment,
    DeploymentAudit,
    RequestRecord,
    Tenant,
    new_id,
    utcnow,
)

log = logging.getLogger(__name__)


class TenancyError(ValueError):
    pass


class NotFound(TenancyError):
    pass


class Conflict(TenancyError):
    pass


class InvalidConfig(TenancyError):
    pass


TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Model ids like "@tessera/demo" or "@cf/meta/llama-3-8b": they name Celery queues and Redis keys, so no
# spaces or colons.
DEPLOYMENT_NAME_RE = re.compile(r"^@?[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")

Mode = Literal["disaggregated", "colocated"]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]  # auto: bf16 where it is fast, else fp32
KVFormat = Literal["auto", "bf16", "int8", "fp8_e4m3"]  # auto: the model's dtype, unquantised
WeightFormat = Literal["bf16", "fp8", "int4"]
MODES, DTYPES, KV_FORMATS, WEIGHT_FORMATS = (get_args(t) for t in (Mode, Dtype, KVFormat, WeightFormat))
# Fields that decide which files a worker loads: changing one re-checks the checkpoint.
CHECKPOINT_FIELDS = ("checkpoint", "prefill_weights", "decode_weights")

_SPEC = {f.name: f.default for f in fields(DeploymentSpec)}  # one source of truth for worker defaults


# --- audit log -------------------------------------------------------------------------------------------


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
        query = query.where(AuditEvent.tenant_id == get_tenant(session, tenant).id)
    if target_type is not None:
        if target_type not in AUDIT_TARGET_TYPES:
            raise InvalidCursor(
                f"invalid target_type {target_type!r}: choose from {', '.join(AUDIT_TARGET_TYPES)}"
            )
        query = query.where(AuditEvent.target_type == target_type)
    return keyset(session, query, (AuditEvent.id,), cursor, limit, descending=True)


def key_state(key: ApiKey) -> dict[str, Any]:
    """What the audit log records of a key: never its secret, hash or salt."""
    return {
        "name": key.name,
        "scopes": key.scope_list,
        "expires_at": key.expires_at,
        "revoked_at": key.revoked_at,
    }


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in values.items()}


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
    _commit(session, f"tenant {name!r} already exists")
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
    _commit(session, "key prefix collision; try again")
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


# --- deployments -----------------------------------------------------------------------------------------


# The columns' ranges (INTEGER, BIGINT): a larger value is a 422 that says so, not a database error.
INT_MAX, BIGINT_MAX = 2**31 - 1, 2**63 - 1


class DeploymentConfig(BaseModel):
    """A deployment's editable configuration, validated. Defaults are the worker's (``DeploymentSpec``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=200)
    checkpoint: str = Field(min_length=1, max_length=1000)
    mode: Mode = _SPEC["mode"]
    dtype: Dtype = _SPEC["dtype"]
    prefill_kv: KVFormat = _SPEC["prefill_kv"]
    decode_kv: KVFormat = _SPEC["decode_kv"]
    prefill_weights: WeightFormat = _SPEC["prefill_weights"]
    decode_weights: WeightFormat = _SPEC["decode_weights"]
    page_size: int = _SPEC["page_size"]
    kv_budget_bytes: int = Field(_SPEC["kv_budget_bytes"], gt=0, le=BIGINT_MAX)
    max_num_seqs: int = Field(_SPEC["max_num_seqs"], gt=0, le=INT_MAX)
    max_model_len: int | None = Field(_SPEC["max_model_len"], gt=0, le=INT_MAX)
    max_tokens_limit: int = Field(4096, gt=0, le=INT_MAX)
    local_prefill_max_tokens: int = Field(
        0,
        ge=0,
        le=INT_MAX,
        description="disaggregated mode: prompts of at most this many tokens are prefilled by the decode pool "
        "itself, with its formats, skipping the prefill pool and the KV hand-off (short prompts cost more to "
        "hand off than to prefill); 0: every prompt goes through the prefill pool",
    )
    integrity_check: bool = _SPEC["integrity_check"]
    prefix_cache: bool = _SPEC["prefix_cache"]
    enabled: bool = True

    @field_validator("name")
    @classmethod
    def _model_id(cls, value: str) -> str:
        if not DEPLOYMENT_NAME_RE.match(value):
            raise ValueError(
                "expected a model id like '@tessera/demo': letters, digits, '.', '_', '-' in "
                "'/'-separated parts, optionally starting with '@'"
            )
        return value

    @field_validator("page_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value <= 0 or value & (value - 1) or value > 1024:
            raise ValueError(f"must be a power of two between 1 and 1024 tokens, got {value}")
        return value

    @model_validator(mode="after")
    def _limits_fit(self) -> DeploymentConfig:
        if self.max_model_len is not None and self.max_tokens_limit > self.max_model_len:
            raise ValueError(
                f"max_tokens_limit ({self.max_tokens_limit}) exceeds max_model_len ({self.max_model_len}); "
                "lower max_tokens_limit or raise max_model_len"
            )
        return self


EDITABLE_FIELDS = tuple(name for name in DeploymentConfig.model_fields if name != "name")


def validate_deployment(values: Mapping[str, Any] | DeploymentConfig) -> DeploymentConfig:
    """Parse and validate a deployment configuration; ``InvalidConfig`` lists every problem."""
    if isinstance(values, DeploymentConfig):
        return values
    try:
        return DeploymentConfig.model_validate(dict(values))
    except ValidationError as exc:
        problems = "; ".join(
            ": ".join(
                filter(None, (".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, ")))
            )
            for err in exc.errors()
        )
        raise InvalidConfig(f"invalid deployment config: {problems}") from None


def check_checkpoint(checkpoint: str | Path, prefill_weights: str, decode_weights: str) -> None:
    """The checkpoint folder has a config.json, and can give each phase's weight format; or the checkpoint is
    a GGUF file of a supported architecture (it gives every format: its Q4_0/Q4_1 weights load as int4, the
    rest are dequantised, and fp8 is quantised from those at load).

    Runs where the control plane runs: when checkpoints exist only on worker hosts, callers skip it.
    """
    skip_hint = "(if it exists only on the worker hosts, skip this check with --no-checkpoint-check)"
    path = Path(checkpoint).expanduser()
    if is_gguf(path):
        try:
            ModelConfig.from_pretrained(path)
        except ModelLoadError as exc:
            raise InvalidConfig(f"checkpoint {checkpoint}: {exc}") from None
        return
    config_path = path / "config.json"
    if not config_path.is_file():
        raise InvalidConfig(
            f"checkpoint {checkpoint} has no config.json: expected a Hugging Face-style folder "
            f"(config.json + *.safetensors) or a .gguf file {skip_hint}"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"cannot read {config_path}: {exc}") from None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    found = quant.get("format") if isinstance(quant, dict) else None
    # Workers quantise an unquantised checkpoint as they load it, so one checkpoint can serve fp8 prefill
    # and int4 decode; a converted checkpoint serves only its own format.
    for phase, weights in (("prefill", prefill_weights), ("decode", decode_weights)):
        if found is not None and found != weights:
            hint = (
                "point the deployment at the unquantised checkpoint (workers quantise it as they load)"
                if weights != "bf16"
                else "point the deployment at the unquantised checkpoint"
            )
            raise InvalidConfig(
                f"{phase}_weights={weights} cannot load {config_path}: its weights are already quantised to "
                f"{found}; {hint}, or set {phase}_weights={found}"
            )


def create_deployment(
    session: Session,
    config: DeploymentConfig | Mapping[str, Any],
    *,
    actor: str,
    check_checkpoint_files: bool = True,
    redis: Redis | None = None,
) -> Deployment:
    config = validate_deployment(config)
    if session.get(Deployment, config.name) is not None:
        raise Conflict(f"deployment {config.name!r} already exists; change it with update")
    if check_checkpoint_files:
        check_checkpoint(config.checkpoint, config.prefill_weights, config.decode_weights)
    values = config.model_dump()
    deployment = Deployment(**values)
    session.add(deployment)
    session.add(
        DeploymentAudit(
            deployment=config.name,
            actor=actor,
            action="create",
            changes={k: [None, v] for k, v in values.items() if k != "name"},
        )
    )
    _commit(session, f"deployment {config.name!r} already exists")
    announce_config(session, deployment, redis)
    return deployment


def update_deployment(
    session: Session,
    name: str,
    changes: Mapping[str, Any],
    *,
    actor: str,
    check_checkpoint_files: bool = True,
    redis: Redis | None = None,
) -> Deployment:
    """Apply ``changes`` ({field: new value}) after validating the whole resulting config; writes one audit
    row listing each field that really changed. A change that changes nothing writes nothing (but announces
    the config again, so re-running a change whose announcement failed tells the workers)."""
    unknown = sorted(set(changes) - set(EDITABLE_FIELDS))
    if unknown:
        raise InvalidConfig(
            f"cannot update {', '.join(unknown)}: editable fields are {', '.join(EDITABLE_FIELDS)}"
            + (" (a deployment's name is its model id and cannot change)" if "name" in unknown else "")
        )
    deployment = get_deployment(session, name)
    current = deployment_config(deployment)
    config = validate_deployment({**current.model_dump(), **changes})
    diff = {
        k: [getattr(current, k), getattr(config, k)]
        for k in EDITABLE_FIELDS
        if getattr(current, k) != getattr(config, k)
    }
    if not diff:
        announce_config(session, deployment, redis)
        return deployment
    if check_checkpoint_files and any(k in diff for k in CHECKPOINT_FIELDS):
        check_checkpoint(config.checkpoint, config.prefill_weights, config.decode_weights)
    for key, (_, new) in diff.items():
        setattr(deployment, key, new)
    session.add(DeploymentAudit(deployment=name, actor=actor, action="update", changes=diff))
    session.commit()
    announce_config(session, deployment, redis)
    return deployment


# Set only if newer: two changes committed close together may announce in either order.
_ANNOUNCE = """
if tonumber(redis.call('HGET', KEYS[1], 'version') or '-1') < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'version', ARGV[1], 'spec', ARGV[2])
end
"""


def config_version(session: Session, name: str) -> int:
    """The deployment's config version: the number of audited changes to it, its creation included."""
    query = select(func.count()).select_from(DeploymentAudit).where(DeploymentAudit.deployment == name)
    return session.scalar(query) or 0


def announce_config(session: Session, deployment: Deployment, redis: Redis | None = None) -> int:
    """Publish the committed config to the deployment's workers (``config_key``): each worker serving
    another spec drains and reloads. Call after the commit; returns the version announced. Without Redis
    (none configured, or unreachable) the change stays saved and workers apply it when they restart."""
    version = config_version(session, deployment.name)
    owned = redis is None
    if owned:
        from tessera.settings import get_settings

        url = get_settings().redis_url
        if not url:
            log.warning(
                "TESSERA_REDIS_URL is not set: running workers learn of the change from `tessera up` (which "
                "watches the database) or when they restart"
            )
            return version
        redis = connect_redis(url)
    try:
        redis.eval(_ANNOUNCE, 1, config_key(deployment.name), version, deployment.to_spec().to_json())
    except RedisError as exc:
        log.warning(
            "could not announce config version %d of %s (%s): workers keep the old config until restarted, "
            "or repeat the change once Redis is back",
            version,
            deployment.name,
            exc,
        )
    finally:
        if owned:
            redis.close()
    return version


def deployment_config(deployment: Deployment) -> DeploymentConfig:
    return DeploymentConfig.model_validate({k: getattr(deployment, k) for k in DeploymentConfig.model_fields})


def get_deployment(session: Session, name: str) -> Deployment:
    deployment = session.get(Deployment, name)
    if deployment is None:
        raise NotFound(f"no deployment named {name!r}; `tessera deployments list` shows them")
    return deployment


def list_deployments(
    session: Session, *, enabled_only: bool = False, limit: int | None = None, offset: int = 0
) -> list[Deployment]:
    query = select(Deployment).order_by(Deployment.name)
    if enabled_only:
        query = query.where(Deployment.enabled.is_(True))
    return offset_page(session, query, limit, offset)


def deployment_audit(
    session: Session, name: str, *, limit: int | None = 50, offset: int = 0
) -> list[DeploymentAudit]:
    """The deployment's changes, newest first."""
    query = (
        select(DeploymentAudit)
        .where(DeploymentAudit.deployment == name)
        .order_by(DeploymentAudit.created_at.desc(), DeploymentAudit.id.desc())
    )
    return offset_page(session, query, limit, offset)


# --- request records -------------------------------------------------------------------------------------


def record_request(
    session: Session,
    request_id: str,
    *,
    tenant_id: str,
    deployment: str,
    status: str,
    key_id: str | None = None,
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    completion_tokens: int = 0,
    error_code: str | None = None,
) -> bool:
    """Insert or update one request's record now; True when this call changed it (see ``settle_records``)."""
    now = utcnow()
    record = {
        "request_id": request_id,
        "tenant_id": tenant_id,
        "key_id": key_id,
        "deployment": deployment,
        "status": status,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "completion_tokens": completion_tokens,
        "error_code": error_code,
        "created_at": now,
        "finished_at": now if status in FINAL_STATUSES else None,
    }
    return bool(settle_records(session, [record]))


# What settling may change in a stored record; the rest (tenant, key, deployment, start) is fixed at insert.
_OUTCOME_FIELDS = (
    "status",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "error_code",
    "model",
    "ttft_s",
    "duration_s",
    "finished_at",
)


@functools.lru_cache(maxsize=64)
def _settle_statement(dialect: str, columns: frozenset[str]):
    """The upsert ``settle_records`` runs for records with these columns (RETURNING the ids it changed: not
    rowcount, which psycopg reports none of for upserts)."""
    table = RequestRecord.__table__
    insert = dialect_insert(dialect, table)
    # One bound value per final status: a bound list would expand per execution, which executemany refuses.
    final = [literal(status) for status in FINAL_STATUSES]
    return insert.on_conflict_do_update(
        index_elements=["request_id"],
        set_={name: insert.excluded[name] for name in _OUTCOME_FIELDS if name in columns},
        where=table.c.status.not_in(final),
    ).returning(table.c.request_id)


def settle_records(session: Session, records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Insert or update request records (``RequestRecord`` columns, ``request_id`` required) in one
    transaction, and commit; returns the ids this call changed.

    Idempotent: once a record reaches a final status (completed, failed, cancelled) it never changes again,
    so a request settled twice (a redelivered task, an outcome drained twice from the stream) is counted
    once, and a late non-final update (e.g. "running" after "completed") is ignored. Safe under concurrent
    writers on SQLite and PostgreSQL: INSERT ... ON CONFLICT DO UPDATE only where the stored status is not
    final, one statement per batch (SQLAlchemy's insertmanyvalues; records with the same columns share it).
    Within ``records`` the first of each request id wins.
    """
    first: dict[str, Mapping[str, Any]] = {}
    for record in records:
        first.setdefault(record["request_id"], record)
    unique = list(first.values())
    for record in unique:
        if record["status"] not in REQUEST_STATUSES:
            raise InvalidConfig(
                f"invalid request status {record['status']!r}: expected one of {', '.join(REQUEST_STATUSES)}"
            )
    if not unique:
        return []
    by_columns: dict[frozenset[str], list[Mapping[str, Any]]] = {}
    for record in unique:
        by_columns.setdefault(frozenset(record), []).append(record)
    dialect = session.get_bind().dialect.name
    changed: list[str] = []
    for columns, rows in by_columns.items():
        # executemany of one cached statement: compiled once per process, where a multi-row VALUES built
        # per batch was compiled per batch (BENCHMARKS.md: 4.8-12x the CPU on SQLite, 3.6-4.6x on PostgreSQL)
        changed += session.scalars(_settle_statement(dialect, columns), rows)
    changed_ids = set(changed)
    last_used: dict[str, datetime] = {}
    for record in unique:
        if record["request_id"] in changed_ids and record.get("key_id") is not None:
            used = record.get("created_at") or utcnow()
            last_used[record["key_id"]] = max(used, last_used.get(record["key_id"], used))
    for key_id, used in last_used.items():
        session.execute(
            update(ApiKey)
            .where(ApiKey.id == key_id, or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < used))
            .values(last_used_at=used)
        )
    session.commit()
    return changed


# --- pages -----------------------------------------------------------------------------------------------


def tenants_page(session: Session, *, cursor: str | None = None, limit: int = 50) -> Page[Tenant]:
    return keyset(session, select(Tenant), (Tenant.created_at, Tenant.id), cursor, limit)


def keys_page(session: Session, tenant: str, *, cursor: str | None = None, limit: int = 50) -> Page[ApiKey]:
    owner = get_tenant(session, tenant)
    query = select(ApiKey).where(ApiKey.tenant_id == owner.id)
    return keyset(session, query, (ApiKey.created_at, ApiKey.id), cursor, limit)


def deployments_page(session: Session, *, cursor: str | None = None, limit: int = 50) -> Page[Deployment]:
    return keyset(session, select(Deployment), (Deployment.name,), cursor, limit)


def audit_page(
    session: Session, name: str, *, cursor: str | None = None, limit: int = 50
) -> Page[DeploymentAudit]:
    """The deployment's changes, newest first (ids grow with every change). The log outlives a removed
    deployment; a name with neither a deployment nor any change is ``NotFound``."""
    query = select(DeploymentAudit).where(DeploymentAudit.deployment == name)
    page = keyset(session, query, (DeploymentAudit.id,), cursor, limit, descending=True)
    if not page.items and cursor is None:
        get_deployment(session, name)
    return page


# --- helpers ---------------------------------------------------------------------------------------------


def _commit(session: Session, conflict_message: str) -> None:
    """Commit; a unique constraint another writer won meanwhile becomes a ``Conflict``."""
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(conflict_message) from None
