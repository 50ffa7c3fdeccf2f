"""Alembic environment: the database URL comes from Tessera (the caller's, else its settings)."""

from __future__ import annotations

from logging.config import fileConfig

import tessera.deployments  # noqa: F401  (declares the deployments' tables on Base.metadata)
from alembic import context
from sqlalchemy.pool import NullPool
from tessera.db import make_engine
from tessera.models import Base
from tessera.settings import get_settings

from billing import metadata as billing_metadata

config = context.config
# Tessera's tables and billing's (billing has its own metadata: it cannot import tessera).
TARGET_METADATA = [Base.metadata, billing_metadata]
if config.config_file_name is not None:  # `alembic` run by hand with alembic.ini
    fileConfig(config.config_file_name, disable_existing_loggers=False)

url = config.attributes.get("database_url") or get_settings().database_url


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=TARGET_METADATA, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=TARGET_METADATA,
                # SQLite cannot ALTER most things in place; batch mode recreates the table instead.
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
