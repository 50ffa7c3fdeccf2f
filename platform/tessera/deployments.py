"""Deployments: the models tenants call and how their worker pools serve them. ``DeploymentConfig`` is the
one place a deployment knob's name, type, default, description and validation live (the admin API's bodies
and the CLI's flags are derived from its fields; its tables, ``Deployment`` and ``DeploymentAudit``, are
here beside it); create, update, get and list them here, each change audited in the deployment's own log
and announced to its workers (``announce_config``, versioned by ``config_version``).
Errors are ``tessera.errors`` ``ServiceError``s: ``NotFound``, ``Conflict``, ``InvalidConfig``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import fields
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from redis import Redis, RedisError
from sqlalchemy import BigInteger, Index, Integer, String, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from billing.pagination import Page, keyset, offset_page
from gpu_workers.checkpoint import ModelConfig, ModelLoadError
from gpu_workers.gguf_file import is_gguf
from gpu_workers.protocol import DeploymentSpec, config_key, connect_redis
from tessera.db import commit_unique
from tessera.errors import Conflict, InvalidConfig, NotFound
from tessera.models import Base, utcnow

log = logging.getLogger(__name__)

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


# The columns' ranges (INTEGER, BIGINT): a larger value is a 422 that says so, not a database error.
INT_MAX, BIGINT_MAX = 2**31 - 1, 2**63 - 1


class DeploymentConfig(BaseModel):
    """A deployment's editable configuration, validated. Defaults are the worker's (``DeploymentSpec``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=200, description="the model id tenants call, e.g. @tessera/demo")
    checkpoint: str = Field(min_length=1, max_length=1000, description="checkpoint folder on the workers")
    mode: Mode = Field(
        _SPEC["mode"], description="disaggregated (prefill + decode pools) or colocated (one pool does both)"
    )
    dtype: Dtype = Field(_SPEC["dtype"], description="compute dtype; auto: bf16 where it is fast, else fp32")
    prefill_kv: KVFormat = Field(
        _SPEC["prefill_kv"], description="KV format prefill computes in; auto: the compute dtype, unquantised"
    )
    decode_kv: KVFormat = Field(
        _SPEC["decode_kv"], description="KV format the decode pool stores (the hand-off converts)"
    )
    prefill_weights: WeightFormat = Field(_SPEC["prefill_weights"], description="prefill weight format")
    decode_weights: WeightFormat = Field(_SPEC["decode_weights"], description="decode weight format")
    page_size: int = Field(_SPEC["page_size"], description="tokens per KV page: a power of two, 1-1024")
    kv_budget_bytes: int = Field(
        _SPEC["kv_budget_bytes"],
        gt=0,
        le=BIGINT_MAX,
        description="KV memory per worker, in bytes (the CLI also reads 512MiB, 8GiB)",
    )
    max_num_seqs: int = Field(
        _SPEC["max_num_seqs"], gt=0, le=INT_MAX, description="requests a worker batches at most"
    )
    max_model_len: int | None = Field(
        _SPEC["max_model_len"],
        gt=0,
        le=INT_MAX,
        description="context length cap; null (the CLI's auto): the checkpoint's context length",
    )
    max_tokens_limit: int = Field(
        4096, gt=0, le=INT_MAX, description="the most output tokens (max_tokens) one request may ask for"
    )
    local_prefill_max_tokens: int = Field(
        0,
        ge=0,
        le=INT_MAX,
        description="disaggregated mode: prompts of at most this many tokens are prefilled by the decode pool "
        "itself, with its formats, skipping the prefill pool and the KV hand-off (short prompts cost more to "
        "hand off than to prefill); 0: every prompt goes through the prefill pool",
    )
    integrity_check: bool = Field(
        _SPEC["integrity_check"], description="check KV page tags before every step reads the cache"
    )
    prefix_cache: bool = Field(_SPEC["prefix_cache"], description="reuse a tenant's cached prompt pages")
    batch_invariant: bool = Field(
        _SPEC["batch_invariant"],
        description="a seeded request gets the same tokens whatever else its steps hold (linears padded to "
        "16 rows, prefill cut into fixed chunks): streamed or not, alone or among others; slower at small "
        "batches",
    )
    enabled: bool = Field(True, description="serve requests; false: refuse them")

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


class Deployment(Base):
    """A model tenants can call and how its worker pools serve it: a column per ``DeploymentConfig`` field
    (which says what each means and allows)."""

    __tablename__ = "deployments"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    checkpoint: Mapped[str] = mapped_column(String(1000))
    mode: Mapped[str] = mapped_column(String(20))
    dtype: Mapped[str] = mapped_column(String(20))
    prefill_kv: Mapped[str] = mapped_column(String(20))
    decode_kv: Mapped[str] = mapped_column(String(20))
    prefill_weights: Mapped[str] = mapped_column(String(20))
    decode_weights: Mapped[str] = mapped_column(String(20))
    page_size: Mapped[int]
    kv_budget_bytes: Mapped[int] = mapped_column(BigInteger)
    max_num_seqs: Mapped[int]
    max_model_len: Mapped[int | None]
    max_tokens_limit: Mapped[int]
    local_prefill_max_tokens: Mapped[int] = mapped_column(default=0)
    integrity_check: Mapped[bool]
    prefix_cache: Mapped[bool]
    batch_invariant: Mapped[bool] = mapped_column(default=False)
    enabled: Mapped[bool] = mapped_column(default=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    def to_spec(self) -> DeploymentSpec:
        """What a worker needs to serve this deployment: the columns ``DeploymentSpec`` names (the gateway-only
        fields stay here)."""
        return DeploymentSpec(**{f.name: getattr(self, f.name) for f in fields(DeploymentSpec)})

    def __repr__(self) -> str:
        return f"Deployment(name={self.name!r}, mode={self.mode!r}, enabled={self.enabled})"


class DeploymentAudit(Base):
    """One change to a deployment: who made it, when, and each field's old and new value."""

    __tablename__ = "deployment_audit"
    __table_args__ = (Index("ix_deployment_audit_deployment_created_at", "deployment", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # No foreign key: the audit log outlives the deployment it describes.
    deployment: Mapped[str] = mapped_column(String(200))
    actor: Mapped[str] = mapped_column(String(200))  # e.g. "cli:alice" or "key:ab12cd34"
    action: Mapped[str] = mapped_column(String(20))  # create | update
    changes: Mapped[dict[str, Any]]  # {field: [old, new]}; old is null on create
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


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
    commit_unique(session, f"deployment {config.name!r} already exists")
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
