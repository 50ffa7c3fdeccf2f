"""The gateway's FastAPI app: ``create_app(settings)`` wires the database, Redis, Celery and the routers.

Torch-free by design: from gpu_workers it imports only ``protocol``, ``tokenizer`` and ``checkpoint``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gpu_workers.protocol import connect_redis, make_celery
from tessera import db
from tessera.api import errors, health, inference
from tessera.api.catalog import Catalog
from tessera.settings import Settings, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    if not settings.redis_url:
        raise ValueError(
            "TESSERA_REDIS_URL is not set: the API needs Redis (redis://HOST:PORT/0); "
            "`tessera up` starts an embedded one for you"
        )
    engine = db.make_engine(settings.database_url)
    sessions = db.session_factory(engine)
    redis = connect_redis(settings.redis_url, asyncio=True)
    celery = make_celery(settings.redis_url)
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
