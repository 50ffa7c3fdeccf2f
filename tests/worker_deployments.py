"""A deployment in a fresh SQLite database, and the environment its `tessera worker` processes run with: what
the reload tests that start real workers share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import redis
from sqlalchemy.orm import Session, sessionmaker
from tessera import db, deployments


@dataclass
class WorkerDeployment:
    database_url: str
    sessions: sessionmaker[Session]
    env: dict[str, str]  # this process's environment without its TESSERA_ settings, then the stack's


def worker_deployment(
    tmp_path: Path, client: redis.Redis, redis_url: str, config: dict, secret: str, **env: str
) -> WorkerDeployment:
    """``config`` created as a deployment (announced through ``client``) in a database under ``tmp_path``; the
    workers' environment points at it and at ``redis_url``, with ``env`` added."""
    database_url = f"sqlite:///{tmp_path / 'tessera.db'}"
    db.upgrade(database_url)
    sessions = db.session_factory(db.make_engine(database_url))
    with sessions() as session:
        deployments.create_deployment(session, config, actor="test", redis=client)
    worker_env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    worker_env |= {
        "TESSERA_DATA_DIR": str(tmp_path),
        "TESSERA_DATABASE_URL": database_url,
        "TESSERA_REDIS_URL": redis_url,
        "TESSERA_SECRET_KEY": secret,
        **env,
    }
    return WorkerDeployment(database_url, sessions, worker_env)
