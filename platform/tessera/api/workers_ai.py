"""Workers-AI REST: ``POST /accounts/{account_id}/ai/run/{model}``, also under ``/client/v4`` (its SDKs' path).

The body is Workers AI's (``prompt`` or ``messages`` plus sampling options); it becomes the matching OpenAI
request and runs through the same ``Gateway.prepare`` and ``Gateway.serve`` as ``/v1`` (so quotas, routing
and records are the same), answered in Workers AI's envelope ``{"result", "success", "errors",
"messages"}``. Every error, auth and validation included, uses that envelope with a numeric code beside
the HTTP status. The account id is the caller's tenant id; any other is a 404 that says nothing more.

Async batches on the same routes: ``?queueRequest=true`` with ``{"requests": [...]}`` stores the batch
(``tessera.batch``) and answers its ``request_id``; ``{"request_id"}`` polls it. ``BatchDispatch`` is how the
batch runner runs an item: through the same ``prepare`` and ``serve``, as a request of its own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import Discriminator, Tag, ValidationError
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from gpu_workers.protocol import pool_queue
from tessera import batch, routing
from tessera.api.deps import Caller, current_caller
from tessera.api.embeddings import TextEmbeddingRequest, run_text_embedding
from tessera.api.errors import validation_error
from tessera.api.gateway import Gateway, gateway
from tessera.api.prepare import Prepared
from tessera.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
)
from tessera.api.workers_ai_schemas import (
    BatchItemRequest,
    BatchRequest,
    BatchResponse,
    BatchResults,
    BatchStatus,
    Message,
    PollRequest,
    RunEnvelope,
    RunRequest,
    RunResult,
    Usage,
)
from tessera.errors import APIError, NotFound
from tessera.responses import (
    WorkersAIShape,
    usage_body,
    workers_ai_code,
    workers_ai_envelope,
    workers_ai_error,
)

log = logging.getLogger(__name__)

BODY_TAGS = (
    "run",
    "queue",
    "poll",
    "embed",
)  # which of the route's bodies a request sent (see ``_body_kind``)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(workers_ai_error(error), status_code=error.status, headers=error.headers)


def _untagged(errors: Any) -> list[dict[str, Any]]:
    """Pydantic's errors without the body's union tag in their location, so they name the field itself."""
    cleaned = []
    for error in errors:
        loc = tuple(error.get("loc", ()))
        if len(loc) > 1 and loc[0] == "body" and loc[1] in BODY_TAGS:
            loc = ("body", *loc[2:])
        cleaned.append({**error, "loc": loc})
    return cleaned


class EnvelopeRoute(APIRoute):
    """Answers this router's errors (from auth, body validation or the gateway) in Workers AI's envelope;
    refuses a batch over the batch size limit, and checks auth and counts the request against rpm
    (``Gateway.attempt``: every POST, runs, batches and polls alike), before the body is read."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                _check_batch_size(request)
                if request.method == "POST":
                    # Auth and the attempt against rpm before the body (up to 10 MB for a batch) is read and
                    # parsed; the handler's own auth is then a cache hit.
                    caller = await account_caller(request, request.path_params["account_id"])
                    # Its body may poll a batch rather than generate: the in-flight bound waits for admission.
                    await gateway(request).attempt(request, caller, generation=False)
                return await handler(await _as_json(request))
            except APIError as e:
                return error_response(e)
            except RequestValidationError as e:
                return error_response(validation_error(_untagged(e.errors())))

        return run


async def _as_json(request: Request) -> Request:
    """The request with its body declared JSON, whatever it was declared as: Workers AI reads every run body
    as JSON, and ``curl -d`` declares form encoding. Bytes that are not UTF-8 are refused here, in the
    envelope (FastAPI's own answer to them would be OpenAI's shape)."""
    headers = [(name, value) for name, value in request.scope["headers"] if name != b"content-type"]
    request = Request(
        {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}, request.receive
    )
    try:
        (await request.body()).decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            400,
            f"the request body is not valid UTF-8 (byte {e.start}); send UTF-8 encoded JSON",
            "invalid_json",
        ) from None
    return request


def _check_batch_size(request: Request) -> None:
    if request.query_params.get("queueRequest", "").lower() != "true":
        return
    limit = request.app.state.settings.batch_max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(
            413,
            f"the batch is {int(length)} bytes, over the limit of {limit} bytes; split it into smaller batches",
            "request_too_large",
        )


router = APIRouter(route_class=EnvelopeRoute, tags=["workers-ai"])


def _body_kind(data: Any) -> str:
    if isinstance(data, dict) and "requests" in data:
        return "queue"
    if isinstance(data, dict) and "request_id" in data and not {"prompt", "messages"} & set(data):
        return "poll"
    if isinstance(data, dict) and "text" in data and not {"prompt", "messages"} & set(data):
        return "embed"
    return "run"


RunBody = Annotated[
    Annotated[RunRequest, Tag("run")]
    | Annotated[BatchRequest, Tag("queue")]
    | Annotated[PollRequest, Tag("poll")]
    | Annotated[TextEmbeddingRequest, Tag("embed")],
    Discriminator(_body_kind),
]


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": RunEnvelope, "description": description}
    for status, description in (
        (
            400,
            "bad input (5007), or too large for the model's context (3006); a batch names each bad request",
        ),
        (401, "invalid API key (10000)"),
        (404, "unknown account (7003), model (5018) or batch request_id"),
        (413, "a batch over the size limit (3006)"),
        (429, "rate limit or quota exceeded (3036)"),
        (503, "out of capacity: no live worker (3040)"),
    )
}
_ACCOUNT_NOT_FOUND = "Could not route to {path}, perhaps your object identifier is invalid?"


async def account_caller(request: Request, account_id: str) -> Caller:
    """The caller, whose tenant must be ``account_id``. A dependency, so auth and the account are checked
    before the body's fields (FastAPI reports field errors after dependencies)."""
    caller = await current_caller(request)
    if account_id != caller.tenant_id:
        raise APIError(404, _ACCOUNT_NOT_FOUND.format(path=request.url.path), "account_not_found")
    return caller


AccountCaller = Annotated[Caller, Depends(account_caller)]


def _openai_request(model: str, body: RunRequest) -> ChatCompletionRequest | CompletionRequest:
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty,
        "stream": body.stream,
        # Workers AI ends a stream with the usage event.
        "stream_options": StreamOptions(include_usage=True) if body.stream else None,
    }
    try:
        if body.messages is not None:
            fmt = body.response_format.as_openai() if body.response_format else None
            tools = [_openai_tool(tool) for tool in body.tools] if body.tools is not None else None
            return ChatCompletionRequest.model_validate(
                {
                    **common,
                    "messages": body.messages,
                    "response_format": fmt,
                    "tools": tools,
                    "tool_choice": body.tool_choice,
                }
            )
        if body.response_format is not None or body.tools:
            raise APIError(
                400,
                "response_format (JSON mode) and tools need 'messages'; send the request as a chat",
                "invalid_request",
                param="response_format" if body.response_format is not None else "tools",
            )
        return CompletionRequest.model_validate({**common, "prompt": body.prompt})
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _openai_tool(tool: Any) -> Any:
    """A Workers AI flat tool as OpenAI's (one already in OpenAI's form, or not an object, as it is)."""
    if isinstance(tool, dict) and "function" not in tool and "type" not in tool:
        return {"type": "function", "function": tool}
    return tool


@router.post(
    "/accounts/{account_id}/ai/run/{model:path}",
    response_model=RunEnvelope,
    responses=_ERRORS,
    summary="Run a text-generation or text-embedding model (Workers AI)",
)
@router.post(
    "/client/v4/accounts/{account_id}/ai/run/{model:path}",
    response_model=RunEnvelope,
    responses=_ERRORS,
    summary="Run a text-generation model (Workers AI, the SDKs' path)",
)
async def run_model(
    request: Request,
    caller: AccountCaller,
    model: str,
    body: Annotated[RunBody, Body()],
    queue_request: Annotated[
        bool,
        Query(
            alias="queueRequest",
            description='true: queue a batch ({"requests": [...]}) or poll one ({"request_id"})',
        ),
    ] = False,
) -> Response:
    if isinstance(body, PollRequest):
        return await _poll(request, caller, model, body.request_id)
    if isinstance(body, BatchRequest):
        if not queue_request:
            raise APIError(
                400,
                "a body with 'requests' is a batch: add ?queueRequest=true",
                "invalid_request",
                param="requests",
            )
        return await _queue(request, caller, model, body)
    if queue_request:
        raise APIError(
            400,
            '?queueRequest=true takes a batch: send {"requests": [...]} (or {"request_id"} to poll one)',
            "invalid_request",
            param="requests",
        )
    if isinstance(body, TextEmbeddingRequest):
        result = await run_text_embedding(request, caller, model, body, reject_if_busy=False)
        return JSONResponse(workers_ai_envelope(result))
    gw = gateway(request)
    openai_body = _openai_request(model, body)
    prepared = await gw.prepare_for(request, openai_body)
    kind = "chat" if isinstance(openai_body, ChatCompletionRequest) else "text"
    reject = bool(body.options and body.options.rejectIfBusy)
    shape = WorkersAIShape(json_mode=body.response_format is not None, tool_names=prepared.tool_names)
    return await gw.serve(request, caller, prepared, kind, shape, reject_if_busy=reject)


# --- async batches --------------------------------------------------------------------------------------


def _validate_items(
    gw: Gateway, model: str, items: list[dict[str, Any]]
) -> tuple[list[tuple[dict[str, Any], str | None]], list[tuple[int, APIError]]]:
    """Each item validated as a run body, then against the model (tokenised, context and output limits) as
    an interactive request is; returns the valid bodies and each bad item's error. Sync: tokenising is CPU."""
    valid, problems = [], []
    for index, raw in enumerate(items):
        try:
            item = BatchItemRequest.model_validate(raw)
            gw.prepare(_openai_request(model, item.model_copy(update={"stream": False})))
        except ValidationError as e:
            problems.append((index, validation_error(e.errors())))
            continue
        except APIError as e:
            if e.status >= 500 or e.code == "model_not_found":
                raise  # about the batch, not the item
            problems.append((index, e))
            continue
        # Batch items never stream, and the run options (rejectIfBusy) do not apply to queued work.
        body = item.model_dump(exclude={"external_reference", "stream", "options"}, exclude_none=True)
        valid.append((body, item.external_reference))
    return valid, problems


async def _queue(request: Request, caller: Caller, model: str, body: BatchRequest) -> Response:
    gw = gateway(request)
    items, problems = await run_in_threadpool(_validate_items, gw, model, body.requests)
    if problems:
        more = f" (and {len(problems) - 1} more invalid requests)" if len(problems) > 1 else ""
        first_index, first = problems[0]
        summary = APIError(400, f"requests[{first_index}]: {first.message}{more}", first.code)
        envelope = workers_ai_error(summary)
        envelope["errors"] = [
            {"code": workers_ai_code(error), "message": f"requests[{index}]: {error.message}"}
            for index, error in problems
        ]
        return JSONResponse(envelope, status_code=400)

    def store() -> str:
        with request.app.state.sessions() as session:
            return batch.submit(
                session, tenant_id=caller.tenant_id, key_id=caller.key_id, model=model, items=items
            ).id

    batch_id = await run_in_threadpool(store)
    runner = getattr(request.app.state, "batch_runner", None)
    if runner is not None:
        runner.wake()
    status = BatchStatus(status="queued", request_id=batch_id, model=model)
    return JSONResponse(workers_ai_envelope(status.model_dump()))


async def _poll(request: Request, caller: Caller, model: str, batch_id: str) -> Response:
    def load() -> batch.BatchView:
        with request.app.state.sessions() as session:
            view = batch.get_batch(session, caller.tenant_id, batch_id)
            session.expunge_all()
            return view

    try:
        view = await run_in_threadpool(load)
    except NotFound as e:
        raise APIError(404, str(e), "batch_not_found") from None
    if view.status != "done":
        status = BatchStatus.model_validate(
            {"status": view.status, "request_id": view.batch.id, "model": view.batch.model}
        )
        return JSONResponse(workers_ai_envelope(status.model_dump()))
    responses, totals = [], {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for item in view.items:
        errors = []
        if item.status == "completed" and item.result is not None:
            usage = item.result.get("usage", {})
            totals["prompt_tokens"] += usage.get("prompt_tokens", 0)
            totals["completion_tokens"] += usage.get("completion_tokens", 0)
            totals["cached_tokens"] += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        else:
            stored = item.error or {}
            failure = APIError(
                stored.get("status", 500),
                stored.get("message", "the request failed"),
                stored.get("code", "internal_error"),
            )
            errors = [Message(code=workers_ai_code(failure), message=failure.message)]
        responses.append(
            BatchResponse(
                id=item.index,
                result=RunResult.model_validate(item.result) if item.status == "completed" else None,
                success=item.status == "completed",
                external_reference=item.external_reference,
                errors=errors,
            )
        )
    results = BatchResults(responses=responses, usage=Usage.model_validate(usage_body(totals)))
    # Unset fields stay out: each result as its request answered it, the sum without per-request extras.
    return JSONResponse(workers_ai_envelope(results.model_dump(exclude_unset=True)))


async def _never_disconnects() -> dict[str, Any]:
    await anyio.sleep_forever()
    return {}


class BatchDispatch:
    """Runs one claimed batch item through ``Gateway.prepare`` and ``Gateway.serve``, as an interactive
    request of the item's tenant and key with its own request id (so quotas are checked now, and its record
    and ledger entry are its own); and says when a deployment has room for batch work."""

    def __init__(self, gw: Gateway, max_queue_depth: int):
        self.gw = gw
        self.max_queue_depth = max_queue_depth  # waiting interactive tasks at which batch items hold back

    async def ready(self, model: str) -> bool:
        """Every pool the deployment needs has a live worker, and fewer than ``max_queue_depth`` tasks wait
        for its entry pool (the pool requests are queued on)."""
        try:
            spec = (await run_in_threadpool(self.gw.catalog.get, model)).spec
        except APIError:
            return True  # an unknown or disabled model: let the dispatch fail its items with the reason
        pools = ("serve",) if spec.mode == "colocated" else ("prefill", "decode")
        ttl = self.gw.settings.worker_heartbeat_ttl_s
        try:
            live = [await routing.live_workers(self.gw.redis, spec.name, pool, ttl) for pool in pools]
            if not all(live):
                return False
            depth = await self.gw.redis.llen(pool_queue(spec.name, pools[0]))
            for worker in live[0]:
                depth += await self.gw.redis.llen(routing.queue_of(worker))
        except RedisError:
            return False
        return depth < self.max_queue_depth

    async def __call__(self, item: batch.Claimed) -> batch.Outcome:
        try:
            body = RunRequest.model_validate(item.body)
            prepared: Prepared = await run_in_threadpool(self.gw.prepare, _openai_request(item.model, body))
            caller = Caller(tenant_id=item.tenant_id, tenant_name="", key_id=item.key_id or "", key_prefix="")
            # serve() reads headers, the request id and (to notice a client leaving) receive: a batch item
            # has no client, so it never leaves.
            scope = {
                "type": "http",
                "method": "POST",
                "path": f"/batch/{item.batch_id}/{item.index}",
                "headers": [],
                "query_string": b"",
                "state": {"request_id": item.request_id},
            }
            response = await self.gw.serve(
                Request(scope, _never_disconnects), caller, prepared, "workers_ai", WorkersAIShape()
            )
        except ValidationError as e:
            return batch.Failed(_error(validation_error(e.errors())))
        except APIError as e:
            return _outcome_of(e)
        return batch.Done(json.loads(bytes(response.body))["result"])


# Codes that mean the item never reached a worker (try again later, the attempt not counted), and those
# that mean the worker running it went away (try again, counted).
_DEFER_CODES = frozenset(
    {"no_live_worker", "queue_full", "queue_unavailable", "quota_unavailable", "out_of_capacity"}
)
_RETRY_CODES = frozenset({"worker_lost", "stream_unavailable", "timeout", "deadline_exceeded"})


def _outcome_of(error: APIError) -> batch.Outcome:
    if error.status == 429 or error.code in _DEFER_CODES:
        retry_after = (error.headers or {}).get("Retry-After", "1")
        quota = error.code in ("rate_limit_exceeded", "quota_exceeded")
        return batch.Deferred(float(retry_after) if retry_after.isdigit() else 1.0, quota=quota)
    if error.code in _RETRY_CODES:
        return batch.Lost(_error(error))
    return batch.Failed(_error(error))


def _error(error: APIError) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "status": error.status}
