"""OpenAI-style errors for every failure, request ids on every response, and the request body limit.

Every error body is ``{"error": {"message", "type", "code", "param"}}``; bad input is always a 4xx.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.errors import APIError, error_body
from tessera.responses import workers_ai_error

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union-member loc entries


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def request_id(request: Request) -> str:
    return request.scope["state"]["request_id"]


async def parse_body(request: Request, schema: type[BaseModel]) -> Any:
    """The request body as ``schema``, or a 400 that says whether the bytes, the JSON or a field is wrong.

    A body declared as something other than JSON is a 415; an undeclared one is read as JSON, as curl
    users and OpenAI's API expect.
    """
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        raise APIError(
            415,
            f"the request body is declared as {content_type!r}; send JSON with "
            "'Content-Type: application/json'",
            "unsupported_media_type",
        )
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            400,
            f"the request body is not valid UTF-8 (byte {e.start}); send UTF-8 encoded JSON",
            "invalid_json",
        ) from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(
            400,
            f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
            "invalid_json",
        ) from None
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", "invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def validation_error(errors: Any) -> APIError:
    """One 400 naming the first bad field (pydantic's errors, from our parser or FastAPI's)."""
    path = _field_path(errors[0].get("loc", ()))
    # A union field fails once per member; the member that got deepest says what is really wrong
    # (a bad text part, not "should be a valid string").
    first = max(
        (e for e in errors if _field_path(e.get("loc", ())) == path), key=lambda e: len(e.get("loc", ()))
    )
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = f"missing required parameter '{path}'"
    elif path:
        message = f"invalid value for '{path}': {message}"
    others = len({_field_path(e.get("loc", ())) for e in errors[1:]} - {path})
    if others:
        message += f" (and {others} more invalid field{'s' if others > 1 else ''})"
    param = path.split(".")[0].split("[")[0] or None
    return APIError(400, message, "invalid_request", param=param)


def _field_path(loc: Any) -> str:
    """``messages[0].content`` from pydantic's loc; drops "body" and union-member tags like ``str``."""
    path = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            break  # a union member's tag: the field path ends before it
    return path


class RequestIdMiddleware:
    """Give every request a server-chosen id (``scope.state.request_id``) and echo it as ``x-request-id``.

    The id names the request's token stream in Redis, so it is never taken from the client.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # Caught here rather than by a handler so the 500 still carries the request id.
            if started:
                raise
            log.exception("unhandled error in request %s (%s %s)", rid, scope["method"], scope["path"])
            message = f"internal server error; retry, and report request id {rid} if it persists"
            await JSONResponse(error_body(500, message, "internal_error"), status_code=500)(
                scope, receive, send_with_id
            )


class BodyTooLarge(StarletteHTTPException):
    pass


# Workers AI's run route, on both of its paths: its errors go in Workers AI's envelope.
WORKERS_AI_RUN = re.compile(r"^(?:/client/v4)?/accounts/[^/]+/ai/run/")


def shaped_response(error: APIError, workers_ai: bool) -> JSONResponse:
    """``error`` in Workers AI's envelope (its run route) or in OpenAI's shape (everything else)."""
    body = workers_ai_error(error) if workers_ai else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


class BodyLimitMiddleware:
    """Refuse bodies over the limit with 413: by Content-Length before reading, else while reading. The
    limit is ``max_bytes``, or ``batch_max_bytes`` for a Workers-AI async batch (``?queueRequest=true``)."""

    def __init__(self, app: ASGIApp, max_bytes: int, batch_max_bytes: int | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.batch_max_bytes = batch_max_bytes

    def _limit(self, scope: Scope) -> tuple[int, bool]:
        """The body limit for this request, and whether its errors take Workers AI's envelope."""
        if not WORKERS_AI_RUN.match(scope["path"]):
            return self.max_bytes, False
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        batch = any(value.lower() == "true" for value in query.get("queueRequest", []))
        return (self.batch_max_bytes if batch and self.batch_max_bytes else self.max_bytes), True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, workers_ai = self._limit(scope)
        detail = f"the request body is larger than the limit of {limit} bytes; send a smaller request"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            status = 413 if length.isdigit() else 400
            code = "request_too_large" if status == 413 else "invalid_request"
            message = detail if status == 413 else "the Content-Length header is not a number"
            # Closed after the answer: the body it refuses is not read.
            refusal = APIError(status, message, code, headers={"Connection": "close"})
            await shaped_response(refusal, workers_ai)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(413, detail)
            return message

        await self.app(scope, counting_receive, send)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        message = f"no route for {request.method} {request.url.path}; see /docs for the API"
    elif status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    code = _CODES.get(status, "invalid_request" if status < 500 else "internal_error")
    headers = exc.headers
    if status == 405:
        # Starlette names the methods of the first route the path matched; the path may have several.
        headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request))}
    return JSONResponse(error_body(status, message, code), status_code=status, headers=headers)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app answers on the request's path: asked of the router method by
    method, as FastAPI's included routers match (they do not list their methods)."""
    routes = request.app.router.routes
    return [
        method
        for method in HTTP_METHODS
        if any(route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes)
    ]


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(exc.errors()))


# The database errors that mean it cannot answer now (down, unreachable, refusing connections, its pool or a
# lock timed out), as opposed to a query the code got wrong: a 503 the client may retry, not a 500.
DATABASE_UNAVAILABLE = (OperationalError, InterfaceError, DisconnectionError, PoolTimeout)


async def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    # The driver's message may name the server; the log keeps the kind and the request, the client neither.
    log.warning("request %s: the database cannot answer (%s)", request_id(request), type(exc).__name__)
    error = APIError(
        503,
        "the service's database cannot be reached right now; retry in a few seconds",
        "database_unavailable",
        headers={"Retry-After": "5"},
    )
    return shaped_response(error, bool(WORKERS_AI_RUN.match(request.url.path)))


def install(app: FastAPI, max_body_bytes: int, batch_max_body_bytes: int | None = None) -> None:
    """Register the error handlers and the request-id and body-limit middleware on ``app``."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    for kind in DATABASE_UNAVAILABLE:
        app.add_exception_handler(kind, _database_unavailable)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, batch_max_bytes=batch_max_body_bytes)
    # Added last so it is outermost: even the body limit's 413 carries the request id.
    app.add_middleware(RequestIdMiddleware)
