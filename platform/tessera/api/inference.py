"""OpenAI-compatible inference: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Per request, cheapest refusal first: body size (middleware) → auth → the attempt counted against rpm →
parse and validate the body → model → a prompt too many bytes for the context refused untokenised →
tokenise → the other quotas → route to a live worker → queue the task on Celery → read its token stream →
one JSON body or SSE chunks. The request's outcome goes to the records stream
(``tessera.records``), off the hot path. The routes are thin: ``api.gateway.Gateway`` does the work.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from tessera.api.deps import CurrentCaller
from tessera.api.errors import parse_body
from tessera.api.gateway import gateway
from tessera.api.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, caller: CurrentCaller) -> Response:
    await gateway(request).attempt(request, caller)
    body = await parse_body(request, ChatCompletionRequest)
    prepared = await gateway(request).prepare_for(request, body)
    return await gateway(request).serve(request, caller, prepared, "chat")


@router.post("/v1/completions")
async def completions(request: Request, caller: CurrentCaller) -> Response:
    await gateway(request).attempt(request, caller)
    body = await parse_body(request, CompletionRequest)
    prepared = await gateway(request).prepare_for(request, body)
    return await gateway(request).serve(request, caller, prepared, "text")


@router.get("/v1/models")
async def list_models(request: Request, caller: CurrentCaller) -> dict[str, Any]:
    models = await run_in_threadpool(gateway(request).catalog.enabled)
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "tessera"}
            for name, created in models
        ],
    }
