"""The OpenAPI document as the API behaves: FastAPI's, plus what FastAPI cannot see.

The generation routes parse their bodies themselves (``parse_body``: strict, 415 for a body declared as
something other than JSON), so their request bodies are declared here from the same pydantic models. Every
route but the public ones takes a bearer key. Each operation lists the error statuses it can answer, with
the error body it answers them in: OpenAI's ``{"error": ...}``, or Workers AI's envelope on its run routes.
Validation errors are 400s (``tessera.api.errors``), so FastAPI's 422 "Validation Error" is dropped where it
is only FastAPI's default.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from tessera.api.admin_schemas import ErrorResponse
from tessera.api.schemas import ChatCompletionRequest, CompletionRequest

SCHEMAS = "#/components/schemas/"
BEARER = "bearerAuth"
# Answered without a key: probes and the web sign-in (the form carries the key).
PUBLIC = frozenset({"/healthz", "/readyz", "/signin", "/signout"})
BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
# Routes that admit work against the quotas and queue it on a model's workers.
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/ai/run/")
DESCRIPTIONS = {
    400: "invalid request: the message names the field, parameter or value that is wrong",
    401: "no valid API key (send 'Authorization: Bearer <key>')",
    403: "the key lacks the scope this route needs",
    404: "no such model, resource or route",
    413: "the request body is over the size limit",
    415: "the body is declared as something other than JSON",
    429: "a rate limit or quota is exceeded, or the model is busy and the request asked to be refused then; "
    "see Retry-After",
    503: "a dependency (the quota store, the database, the model's workers) cannot answer now, or the model's "
    "queue is full; see Retry-After",
}


def install(app: FastAPI) -> None:
    """Serve ``document(app)`` as the app's OpenAPI document (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    _, defs = models_json_schema(
        [(ErrorResponse, "validation"), *((model, "validation") for model in BODIES.values())],
        ref_template=SCHEMAS + "{model}",
    )
    schemas.update(defs["$defs"])
    components["securitySchemes"] = {
        BEARER: {"type": "http", "scheme": "bearer", "description": "a Tessera API key (tessera keys create)"}
    }
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            _complete(path, method, operation)
    if not any("HTTPValidationError" in str(op) for ops in doc["paths"].values() for op in ops.values()):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
    return doc


def _complete(path: str, method: str, operation: dict[str, Any]) -> None:
    responses = operation.setdefault("responses", {})
    if responses.get("422", {}).get("description") == "Validation Error":
        del responses["422"]
    model = BODIES.get(path)
    if model is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": SCHEMAS + model.__name__}}},
        }
    statuses = {400}
    if path not in PUBLIC:
        operation["security"] = [{BEARER: []}]
        statuses |= {401, 403, 503}
    if "{" in path or any(part in path for part in GENERATION):
        statuses.add(404)
    if method in ("post", "put", "patch"):
        statuses.add(413)
    if path in BODIES:
        statuses.add(415)
    if any(part in path for part in GENERATION):
        statuses |= {429, 503}
    error = _error_schema(responses)
    for status in sorted(statuses):
        responses.setdefault(
            str(status),
            {"description": DESCRIPTIONS[status], "content": {"application/json": {"schema": error}}},
        )


def _error_schema(responses: dict[str, Any]) -> dict[str, Any]:
    """The schema the operation's own declared errors use (Workers AI's envelope on its routes), else
    OpenAI's error body."""
    for status, response in responses.items():
        if status.startswith(("4", "5")):
            schema = response.get("content", {}).get("application/json", {}).get("schema")
            if schema is not None and "HTTPValidationError" not in str(schema):
                return schema
    return {"$ref": SCHEMAS + "ErrorResponse"}
