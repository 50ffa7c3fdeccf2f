"""Embeddings: OpenAI's ``POST /v1/embeddings``, and what Workers AI's ``{"text": ...}`` runs on an embedding model.

Per request: auth → model (an embedding model) → validate and tokenise every input (over the model's limit:
truncated when the request says ``truncate``, else a 400) → quotas (rpm, tpm, budgets: the prompt tokens, no
output) → a live worker of the deployment's ``serve`` pool → one ``tessera.embed`` task → the request's
stream, whose one final event holds the vectors and the usage → the answer. Billed as the chat routes are
(``records``, the ledger: prompt tokens at the model's fresh-input price).
"""

from __future__ import annotations

import base64
import sys
import time
from array import array
from contextlib import aclosing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, field_validator
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from gpu_workers.protocol import TASK_EMBED, Embeddings, EmbedTask
from gpu_workers.tokenizer import UnencodableText
from tessera import records, responses, routing
from tessera.api.catalog import Model
from tessera.api.deps import Caller, CurrentCaller
from tessera.api.errors import request_id
from tessera.api.gateway import (
    AFFINITY_HEADER,
    DEADLINE_GRACE_S,
    REJECT_IF_BUSY_HEADER,
    Gateway,
    gateway,
    rpm_counted,
)
from tessera.api.schemas import Text, _Strict
from tessera.errors import APIError
from tessera.models import utcnow
from tessera.pricing import charge

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs
POOL = "serve"  # an embedding deployment's one pool (gpu_workers.pools.embed)
router = APIRouter(tags=["embeddings"])

Input = Text | list[Text] | list[int] | list[list[int]]


def check_inputs(value: Any, name: str) -> Any:
    """A clear 400 for the shapes a union's own errors describe badly: an empty list, too many inputs, a
    list mixing strings with other things, an empty string or token list."""
    if isinstance(value, str):
        if not value:
            raise ValueError(f"'{name}' is an empty string; send text to embed")
        return value
    if not isinstance(value, list):
        raise ValueError(
            f"'{name}' must be a string, a list of strings, or token ids (a list of integers or of lists)"
        )
    if not value:
        raise ValueError(f"'{name}' is an empty list; send at least one string (or list of token ids)")
    if len(value) > MAX_INPUTS:
        raise ValueError(f"'{name}' has {len(value)} items; send at most {MAX_INPUTS} per request (split it)")
    first = value[0]
    kind = "string" if isinstance(first, str) else "list" if isinstance(first, list) else "integer"
    for index, item in enumerate(value):
        if kind == "integer" and (isinstance(item, bool) or not isinstance(item, int)):
            raise ValueError(f"{name}[{index}] is {_type(item)}; a list of token ids holds integers only")
        if kind == "string" and not isinstance(item, str):
            raise ValueError(f"{name}[{index}] is {_type(item)}; a list of inputs holds strings only")
        if kind == "list" and not isinstance(item, list):
            raise ValueError(f"{name}[{index}] is {_type(item)}; a list of token-id lists holds lists only")
        if kind in ("string", "list") and not item:
            raise ValueError(f"{name}[{index}] is empty; every input needs text (or at least one token id)")
    return value


def _type(value: Any) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}.get(
        type(value), "null" if value is None else "an object"
    )


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings body. ``truncate`` (an extension): cut inputs over the model's limit to their first
    tokens instead of refusing the request."""

    model: Text = Field(min_length=1)
    input: Input = Field(
        description=f"a string, a list of up to {MAX_INPUTS} strings, token ids, or a list of token-id lists"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="only the model's own dimension is supported")
    user: Text | None = None
    truncate: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _clear_errors(cls, value: Any) -> Any:
        return check_inputs(value, "input")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    cost: float | None = None
    cost_details: dict[str, Any] | None = None


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


@dataclass
class PreparedEmbedding:
    model: Model
    inputs: list[list[int]]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


def prepare(
    gw: Gateway,
    model_name: str,
    raw: str | list[Any],
    truncate: bool,
    dimensions: int | None,
    param: str = "input",
) -> PreparedEmbedding:
    """Tokenise and check every input against the embedding model ``model_name``. Sync (a thread runs it)."""
    model = gw.catalog.get(model_name)
    encoder = model.embedding
    if encoder is None:
        raise APIError(
            400,
            f"the model '{model.spec.name}' does not serve embeddings; pick an embedding model from GET /v1/models",
            "not_an_embedding_model",
            param="model",
        )
    if dimensions is not None and dimensions != encoder.dimension:
        raise APIError(
            400,
            f"this model's embeddings have {encoder.dimension} dimensions and cannot be shortened; omit 'dimensions' "
            f"or set it to {encoder.dimension}",
            "invalid_dimensions",
            param="dimensions",
        )
    limit = encoder.max_seq_length
    texts = [raw] if isinstance(raw, str) else raw if raw and isinstance(raw[0], str) else None
    if texts is not None:
        try:
            encoded = encoder.tokenizer.encode_batch(texts)
        except UnencodableText as e:
            raise APIError(400, str(e), "invalid_input", param=param) from None
        over = [i for i, e in enumerate(encoded) if e.truncated]
        inputs = [e.ids for e in encoded]
    else:
        inputs = [list(raw)] if isinstance(raw[0], int) else [list(ids) for ids in raw]
        over = [i for i, ids in enumerate(inputs) if len(ids) > limit]
        for index, ids in enumerate(inputs):
            bad = [t for t in ids if not 0 <= t < model.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"{param}[{index}] has token ids outside [0, {model.vocab_size}): {bad[:5]}",
                    "invalid_input",
                    param=param,
                )
        if truncate:
            inputs = [ids[:limit] for ids in inputs]
    if over and not truncate:
        where = f"{param}[{over[0]}]" if not isinstance(raw, str) and not isinstance(raw[0], int) else param
        more = f" (and {len(over) - 1} more inputs)" if len(over) > 1 else ""
        raise APIError(
            400,
            f"{where} is longer than this model's limit of {limit} tokens{more}; shorten it, or set "
            "'truncate': true to embed its first tokens",
            "context_length_exceeded",
            param=param,
        )
    return PreparedEmbedding(model, inputs)


@dataclass
class Embedded:
    vectors: Embeddings
    prompt_tokens: int
    cost: dict[str, Any]  # cost and cost_details, as the ledger records them


async def serve(
    gw: Gateway, request: Request, caller: Caller, prepared: PreparedEmbedding, reject_if_busy: bool = False
) -> tuple[Embedded, dict[str, str]]:
    """Admit, route, queue and wait for an embedding request; the vectors, its usage and the rate-limit
    headers. Quotas settle once, to the prompt tokens (or 0 when it failed before a worker embedded it)."""
    reject_if_busy = reject_if_busy or request.headers.get(REJECT_IF_BUSY_HEADER, "").lower() == "true"
    rid = request_id(request)
    spec = prepared.model.spec
    started_at = utcnow()
    prompt_tokens = prepared.prompt_tokens
    decision, held, price = await gw.admit(
        caller, rid, spec.name, started_at, prompt_tokens, 0, rpm_counted=rpm_counted(request)
    )
    try:
        salt = routing.affinity_salt(gw.settings.derive_key("affinity"), caller.tenant_id)
        key = routing.affinity_key(
            salt, request.headers.get(AFFINITY_HEADER), prepared.inputs[0], spec.page_size
        )
        ttl = gw.settings.worker_heartbeat_ttl_s
        try:
            worker = await routing.pick(gw.redis, spec.name, POOL, key, ttl)
        except routing.NoLiveWorker as e:
            raise APIError(503, str(e), "no_live_worker", headers={"Retry-After": "5"}) from None
        except RedisError:
            raise APIError(503, "Redis is unreachable; retry shortly", "queue_unavailable") from None
        route = routing.Route(TASK_EMBED, routing.queue_of(worker), ((POOL, worker.worker_id),))
        await gw.check_capacity(route, reject_if_busy, caller, spec.name)
        deadline = time.time() + gw.settings.request_timeout_s
        await gw.enqueue(route, EmbedTask(rid, spec.name, caller.tenant_id, prepared.inputs, deadline))
        reader = records.TimedReader(
            gw.redis,
            rid,
            spec.name,
            deadline + DEADLINE_GRACE_S,
            route.workers,
            ttl,
            client_gone=request.is_disconnected,
            started_at=started_at,
        )
        result, vectors = responses.Result(), None
        async with aclosing(reader.events()) as events:
            async for event in events:
                result.add(event)
                vectors = event.embeddings or vectors
        if result.usage is not None:
            held.used_tokens = result.usage.get("prompt_tokens", 0)
            held.used_cost = charge(price, result.usage).total
        gw.recorder.submit(
            records.outcome_of(
                result,
                reader,
                tenant_id=caller.tenant_id,
                key_id=caller.key_id,
                model=spec.name,
                prompt_tokens=prompt_tokens,
            )
        )
        if result.error is not None:
            raise responses.event_error(result.error)
        if vectors is None:
            raise APIError(499, "the request was cancelled before it was embedded", "cancelled")
        usage = result.usage_or_count(prompt_tokens)
        return Embedded(
            vectors, usage["prompt_tokens"], charge(price, usage).usage_fields()
        ), decision.headers()
    finally:
        await held.settle()


def rows(vectors: Embeddings) -> list[bytes]:
    """Each vector's little-endian float32 bytes."""
    raw = base64.b64decode(vectors.data)
    n, d = vectors.shape
    return [raw[i * 4 * d : (i + 1) * 4 * d] for i in range(n)]


def floats(row: bytes) -> list[float]:
    values = array("f")
    values.frombytes(row)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingResponse,
    summary="Create embeddings (OpenAI-compatible)",
)
async def create_embeddings(
    request: Request, caller: CurrentCaller, body: Annotated[EmbeddingRequest, Body()]
) -> Response:
    gw = gateway(request)
    prepared = await run_in_threadpool(prepare, gw, body.model, body.input, body.truncate, body.dimensions)
    embedded, headers = await serve(gw, request, caller, prepared)
    encode = (
        (lambda row: base64.b64encode(row).decode("ascii")) if body.encoding_format == "base64" else floats
    )
    data = [
        {"object": "embedding", "index": i, "embedding": encode(row)}
        for i, row in enumerate(rows(embedded.vectors))
    ]
    usage = {"prompt_tokens": embedded.prompt_tokens, "total_tokens": embedded.prompt_tokens, **embedded.cost}
    return JSONResponse(
        {"object": "list", "data": data, "model": prepared.model.spec.name, "usage": usage}, headers=headers
    )


class TextEmbeddingRequest(_Strict):
    """Workers AI's text-embedding body: ``text`` (one string or a list); ``truncate_inputs`` (Workers AI's name,
    or ``truncate``) cuts inputs over the model's limit instead of refusing them."""

    text: Text | list[Text]
    truncate_inputs: bool = False
    truncate: bool = False

    @field_validator("text", mode="before")
    @classmethod
    def _clear_errors(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not isinstance(value[0], str):
            raise ValueError("'text' must be a string or a list of strings")
        return check_inputs(value, "text")


class TextEmbeddingResult(BaseModel):
    shape: list[int] = Field(description="[inputs, dimension]")
    data: list[list[float]]
    pooling: str = Field(description="how each input's token vectors became one: mean or cls")
    usage: EmbeddingUsage


async def run_text_embedding(
    request: Request, caller: Caller, model: str, body: TextEmbeddingRequest, reject_if_busy: bool
) -> dict[str, Any]:
    """Workers AI's answer (the ``result``) to ``{"text": ...}`` on an embedding model."""
    gw = gateway(request)
    truncate = body.truncate or body.truncate_inputs
    prepared = await run_in_threadpool(prepare, gw, model, body.text, truncate, None, "text")
    embedded, _ = await serve(gw, request, caller, prepared, reject_if_busy)
    usage = {"prompt_tokens": embedded.prompt_tokens, "total_tokens": embedded.prompt_tokens, **embedded.cost}
    assert prepared.model.embedding is not None  # prepare refuses any other model
    return {
        "shape": embedded.vectors.shape,
        "data": [floats(row) for row in rows(embedded.vectors)],
        "pooling": prepared.model.embedding.pooling,
        "usage": usage,
    }
