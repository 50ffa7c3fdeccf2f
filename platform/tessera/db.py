"""Database engines, sessions and migrations for SQLite (the default) and PostgreSQL (psycopg 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

import tessera
from tessera.errors import Conflict

# The Alembic environment and versions: package data (a symlink to the checkout's migrations/ in a checkout,
# a copy in a wheel). No alembic.ini is needed at run time: alembic_config() builds the config in code.
MIGRATIONS_DIR = (tessera.PACKAGE_DATA / "_migrations").resolve()


def normalize_url(url: str | URL) -> URL:
    """Parse a database URL; plain ``postgresql://`` (and ``postgres://``) select the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ValueError(
            f"unsupported database {parsed.get_backend_name()!r} in {redact(parsed)}: "
            "use sqlite:///PATH or postgresql://USER@HOST/DB"
        )
    return parsed


def redact(url: str | URL) -> str:
    """The URL with its password hidden, for messages and logs."""
    return make_url(url).render_as_string(hide_password=True)


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An engine for ``url``. SQLite: shared across threads, WAL journal, foreign keys enforced, and the
    database file's folder created; PostgreSQL: psycopg 3 with pre-ping (connections survive restarts)."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        in_memory = database in ("", ":memory:") or database.startswith("file::memory:")
        if not in_memory:
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        connect_args = {"check_same_thread": False, **kwargs.pop("connect_args", {})}
        engine = create_engine(parsed, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas(wal=not in_memory))
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **kwargs)


def _sqlite_pragmas(wal: bool):
    def on_connect(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        if wal:  # readers don't block the writer: the API reads keys while workers settle requests
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=5000")
        cursor.close()

    return on_connect


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (services commit, then callers print the result)."""
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str | URL | None = None):
    """An Alembic config for the packaged ``migrations/`` that targets ``url``, built in code (no
    alembic.ini; env.py reads the URL from the attributes, without one it falls back to the settings')."""
    from alembic.config import Config

    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(
            f"Alembic migrations not found at {MIGRATIONS_DIR}: the tessera package is incomplete; reinstall it"
        )
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        config.attributes["database_url"] = normalize_url(url)
    return config


def upgrade(url: str | URL, revision: str = "head") -> str | None:
    """Migrate the database at ``url`` up to ``revision``; returns the revision it is at afterwards."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)
    return current_revision(url)


def downgrade(url: str | URL, revision: str) -> str | None:
    """Migrate the database at ``url`` down to ``revision`` (``base`` drops every table)."""
    from alembic import command

    command.downgrade(alembic_config(url), revision)
    return current_revision(url)


def current_revision(url: str | URL) -> str | None:
    """The migration revision the database is at; None for a database never migrated."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str | None:
    """The newest revision in ``migrations/``."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def commit_unique(session: Session, conflict_message: str) -> None:
    """Commit; a unique constraint another writer won meanwhile becomes a ``Conflict``."""
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(conflict_message) from None
