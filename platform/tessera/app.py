"""The gateway's FastAPI app: ``create_app(settings)`` wires the database, Redis, Celery, the quotas, the
request records (outcome stream and its writer) and the routers.

Torch-free by design: from gpu_workers it imports only ``protocol``, ``tokenizer`` and ``checkpoint``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from billing import BillingConsumer
from billing import metrics as billing_metrics
from gpu_workers.protocol import connect_redis, make_celery
from tessera import batch, db
from tessera.api import (
    admin,
    embeddings,
    errors,
    health,
    inference,
    invoices,
    openapi,
    usage,
    web,
    workers_ai,
)
from tessera.api.catalog import Catalog
from tessera.api.deps import AdminCaller
from tessera.api.gateway import Gateway
from tessera.api.guard import Drain, GuardMiddleware
from tessera.auth import KeyVersion
from tessera.errors import APIError
from tessera.quota_config import QuotaLookup
from tessera.quotas import Quotas
from tessera.records import Recorder, RecordWriter
from tessera.settings import Settings, get_settings

log = logging.getLogger(__name__)


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
    # For the threads: key checks off the app's loop or on a cache miss, and the records writer.
    sync_redis = connect_redis(settings.redis_url)
    celery = make_celery(settings.redis_url)
    recorder = Recorder(redis, settings.records_stream, settings.records_stream_maxlen)
    writer = RecordWriter(
        sync_redis,
        sessions,
        settings.records_stream,
        maxlen=settings.records_stream_maxlen,
        claim_idle_s=settings.records_claim_idle_s,
        linger_s=settings.records_linger_s,
    )
    billing_consumer = BillingConsumer(  # its own consumer group on the same stream: charges the ledger
        sync_redis,
        sessions,
        settings.records_stream,
        maxlen=settings.records_stream_maxlen,
        claim_idle_s=settings.records_claim_idle_s,
        linger_s=settings.records_linger_s,
        grace=timedelta(days=settings.invoice_grace_days),
    )
    quotas = Quotas(redis)
    gateway = Gateway(settings, Catalog(sessions), redis, celery, recorder, quotas, QuotaLookup(sessions))
    dispatch = workers_ai.BatchDispatch(gateway, settings.batch_max_queue_depth)
    batch_runner = batch.BatchRunner(  # Workers-AI async batches, run while deployments have room
        sessions,
        redis,
        dispatch,
        dispatch.ready,
        concurrency=settings.batch_concurrency,
        runner_ttl_s=settings.batch_runner_ttl_s,
        max_attempts=settings.batch_max_attempts,
    )

    drain = Drain(settings.shutdown_grace_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        drain.bind()
        writer.start()
        billing_consumer.start()
        app.state.key_version.bind()  # key checks read the version through the async client on this loop
        await batch_runner.start()
        # The enabled models' tokenizers, loaded as the API starts serving rather than by their first
        # requests (a request for a model still loading waits for that one load).
        app.state.preload = threading.Thread(
            target=gateway.catalog.preload, name="catalog-preload", daemon=True
        )
        app.state.preload.start()
        yield
        await batch_runner.stop()
        await recorder.close()
        await run_in_threadpool(writer.stop)
        await run_in_threadpool(billing_consumer.stop)
        await redis.aclose()
        sync_redis.close()
        celery.close()
        engine.dispose()

    app = FastAPI(title="Tessera", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.sessions = sessions
    app.state.key_version = KeyVersion(sync_redis, aredis=redis)
    app.state.gateway = gateway
    app.state.records_writer = writer
    app.state.billing_consumer = billing_consumer
    app.state.batch_runner = batch_runner
    app.state.drain = drain
    # Inside the error middleware (installed next), so its answers carry the request id.
    app.add_middleware(GuardMiddleware, body_timeout_s=settings.body_timeout_s, drain=drain)
    errors.install(app, settings.max_body_bytes, settings.batch_max_body_bytes)
    app.include_router(inference.router)
    app.include_router(embeddings.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    app.include_router(workers_ai.router)
    app.include_router(usage.router)
    app.include_router(usage.admin_router)
    app.include_router(invoices.router)
    app.include_router(invoices.admin_router)
    web.install(app, sync_redis)  # the dashboard and admin console: pages, /static, web sessions
    openapi.install(app)

    # --- Prometheus (budgets-metrics) ---
    @app.get("/metrics", response_class=PlainTextResponse, tags=["metrics"])
    def prometheus_metrics(caller: AdminCaller) -> PlainTextResponse:
        """Prometheus' text format; admin keys only, since the labels name tenants. 503 when the database
        cannot be read: the usage counters come from it, and a scrape without them must fail, not drop them."""
        try:
            body, content_type = billing_metrics.exposition(sessions)
        except SQLAlchemyError as exc:
            log.warning("GET /metrics: cannot read the usage counters: %s", type(exc).__name__)
            raise APIError(
                503,
                "the database cannot be read, so the usage counters are unknown; retry shortly",
                "database_unavailable",
                headers={"Retry-After": "5"},
            ) from None
        return PlainTextResponse(body, media_type=content_type)

    return app
