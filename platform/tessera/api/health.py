"""Liveness (``/healthz``: the process answers) and readiness (``/readyz``: DB, Redis, the enabled models'
tokenizers loaded, and a model whose workers are all live: its serve worker, or a prefill and a decode
worker)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from gpu_workers.protocol import POOLS
from tessera import routing
from tessera.errors import error_body

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    gateway = request.app.state.gateway
    checks: dict[str, Any] = {}
    problems = []
    try:
        models = await run_in_threadpool(_ping_database, request)
        checks["database"] = "ok"
    except Exception as e:
        models = []
        checks["database"] = "error"
        problems.append(f"database unreachable ({type(e).__name__})")
    try:
        await gateway.redis.ping()
        checks["redis"] = "ok"
        live, servable = 0, 0
        for model in models:
            counts = {
                pool: len(
                    await routing.live_workers(
                        gateway.redis, model, pool, gateway.settings.worker_heartbeat_ttl_s
                    )
                )
                for pool in POOLS
            }
            live += sum(counts.values())
            # A colocated model needs its serve worker; a disaggregated one a prefill and a decode worker.
            servable += bool(counts["serve"] or (counts["prefill"] and counts["decode"]))
        checks["live_workers"] = live
        checks["servable_models"] = servable
        if not servable:
            problems.append(
                "no enabled model has the live workers it needs (a serve worker, or a prefill and a decode "
                "worker); start them with `tessera worker`"
            )
    except Exception as e:
        checks["redis"] = "error"
        problems.append(f"redis unreachable ({type(e).__name__})")
    # The API loads the enabled models' tokenizers as it starts (app.py): until then a model's first request
    # would wait for that load inside its admission bound.
    preload = getattr(request.app.state, "preload", None)
    checks["models_loaded"] = preload is None or not preload.is_alive()
    if not checks["models_loaded"]:
        problems.append("the enabled models' tokenizers are still loading")
    if problems:
        body = error_body(503, "not ready: " + "; ".join(problems), "not_ready")
        return JSONResponse({**body, "checks": checks}, status_code=503)
    return JSONResponse({"status": "ready", "checks": checks})


def _ping_database(request: Request) -> list[str]:
    """Enabled model ids, read with a real query, so a reachable database also proves its schema."""
    with request.app.state.sessions() as session:
        session.execute(text("SELECT 1"))
    return [name for name, _ in request.app.state.gateway.catalog.enabled()]
