"""Workers-AI REST: ``POST /accounts/{account_id}/ai/run/{model}``, also under ``/client/v4`` (its SDKs' path).

The body is Workers AI's (``prompt`` or ``messages`` plus sampling options); it becomes the matching OpenAI
request and runs through the same ``Gateway.prepare`` and ``Gateway.serve`` as ``/v1`` (so quotas, routing
and records are the same), answered in Workers AI's envelope ``{"result", "success", "errors",
"messages"}``. Every error, auth and validation included, uses that envelope with a numeric code beside
the HTTP status. The account id is the caller's tenant id; any other is a 404 that says nothing more.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.concurrency import run_in_threadpool

from tessera import streaming
from tessera.api.deps import Caller, current_caller
from tessera.api.errors import validation_error
from tessera.api.inference import gateway
from tessera.api.schemas import (
    MAX_SEED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    Text,
)
from tessera.errors import APIError


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(streaming.workers_ai_error(error), status_code=error.status, headers=error.headers)


class EnvelopeRoute(APIRoute):
    """Answers this router's errors (from auth, body validation or the gateway) in Workers AI's envelope."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                return error_response(e)
            except RequestValidationError as e:
                return error_response(validation_error(e.errors()))

        return run


router = APIRouter(route_class=EnvelopeRoute, tags=["workers-ai"])


class RunOptions(BaseModel):
    """Workers AI's per-request options; ``rejectIfBusy`` answers 429 at once when the model is busy."""

    model_config = ConfigDict(strict=True, extra="ignore")

    rejectIfBusy: bool = False  # noqa: N815 (Workers AI's spelling)


class RunRequest(BaseModel):
    """A text-generation request as Workers AI takes it: ``prompt`` or ``messages``, not both."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    prompt: Text | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    options: RunOptions | None = None

    @model_validator(mode="after")
    def _one_input(self) -> RunRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either 'prompt' or 'messages' (one of them, not both)")
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class RunResult(BaseModel):
    response: str
    usage: Usage


class Message(BaseModel):
    code: int
    message: str


class RunEnvelope(BaseModel):
    result: RunResult | None
    success: bool
    errors: list[Message]
    messages: list[Message]


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": RunEnvelope, "description": description}
    for status, description in (
        (400, "bad input (5007), or too large for the model's context (3006)"),
        (401, "invalid API key (10000)"),
        (404, "unknown account (7003) or model (5018)"),
        (429, "rate limit or quota exceeded (3036)"),
        (503, "out of capacity: no live worker (3040)"),
    )
}
_ACCOUNT_NOT_FOUND = "Could not route to {path}, perhaps your object identifier is invalid?"


def account_caller(request: Request, account_id: str) -> Caller:
    """The caller, whose tenant must be ``account_id``. A dependency, so auth and the account are checked
    before the body's fields (FastAPI reports field errors after dependencies)."""
    caller = current_caller(request)
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
        "stream": body.stream,
        # Workers AI ends a stream with the usage event.
        "stream_options": StreamOptions(include_usage=True) if body.stream else None,
    }
    try:
        if body.messages is not None:
            return ChatCompletionRequest.model_validate({**common, "messages": body.messages})
        return CompletionRequest.model_validate({**common, "prompt": body.prompt})
    except ValidationError as e:
        raise validation_error(e.errors()) from None


@router.post(
    "/accounts/{account_id}/ai/run/{model:path}",
    response_model=RunEnvelope,
    responses=_ERRORS,
    summary="Run a text-generation model (Workers AI)",
)
@router.post(
    "/client/v4/accounts/{account_id}/ai/run/{model:path}",
    response_model=RunEnvelope,
    responses=_ERRORS,
    summary="Run a text-generation model (Workers AI, the SDKs' path)",
)
async def run_model(request: Request, caller: AccountCaller, model: str, body: RunRequest) -> Response:
    gw = gateway(request)
    openai_body = _openai_request(model, body)
    prepared = await run_in_threadpool(gw.prepare, openai_body)
    kind = "chat" if isinstance(openai_body, ChatCompletionRequest) else "text"
    reject = bool(body.options and body.options.rejectIfBusy)
    return await gw.serve(request, caller, prepared, kind, streaming.WorkersAIShape(), reject_if_busy=reject)
