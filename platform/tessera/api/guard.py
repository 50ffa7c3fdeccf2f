"""What one request may hold of the API server, and how the server's shutdown ends it.

``GuardMiddleware`` wraps each HTTP request: its whole body must arrive within ``body_timeout_s`` of its
headers (else a 408 and the connection closed); a response sent before the body was read closes the
connection (the server does not read a body nobody will use); a client that leaves mid-body ends the request quietly, as
the normal event it is; and once a shutdown's grace period is over (``Drain``, begun by
``tessera.server.DrainingServer`` on SIGTERM), a request still running is ended with an error the client
can read: a 503 if nothing was sent yet, else, on an SSE stream, an ``error`` event and ``[DONE]``; what the
application sends after that goes nowhere, and uvicorn cancels it at its own deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.api.errors import WORKERS_AI_RUN, shaped_response
from tessera.errors import APIError
from tessera.responses import workers_ai_error

log = logging.getLogger(__name__)

DISCONNECT: Message = {"type": "http.disconnect"}
ARRIVED = "arrived"  # the request's state key: the event loop's time when its headers had arrived


class Drain:
    """The API's shutdown as requests see it: ``begin()`` (from a signal handler) starts the grace period;
    when it is over, every request still running is ended (``Guarded.end``)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.requests: set[Guarded] = set()
        self.begun = False
        self.over = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self) -> None:
        """Remember the app's loop (call from its lifespan): ``begin`` runs in a signal handler."""
        self._loop = asyncio.get_running_loop()

    def begin(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._begin)

    def _begin(self) -> None:
        if self.begun:
            return
        self.begun = True
        log.info("shutting down: %d running request(s) get %gs to finish", len(self.requests), self.grace_s)
        asyncio.get_running_loop().call_later(self.grace_s, self._expire)

    def _expire(self) -> None:
        self.over = True
        if self.requests:
            log.warning("ending %d request(s) still running after %gs", len(self.requests), self.grace_s)
        for request in list(self.requests):
            asyncio.get_running_loop().create_task(request.end(self.grace_s))


class GuardMiddleware:
    def __init__(self, app: ASGIApp, body_timeout_s: float, drain: Drain):
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Guarded(scope, receive, send, self.body_timeout_s)
        scope.setdefault("state", {})[ARRIVED] = request.arrived
        self.drain.requests.add(request)
        try:
            await self.app(scope, request.receive, request.send)
        except ClientDisconnect:
            if not request.timed_out:
                # The client left mid-body: nobody is there to answer, and it is not the server's error.
                log.info(
                    "%s %s: the client left before sending its whole body", scope["method"], scope["path"]
                )
        finally:
            self.drain.requests.discard(request)
        if request.timed_out:
            await request.answer_timeout()


class Guarded:
    """One request's receive and send, as ``GuardMiddleware`` bounds them."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, body_timeout_s: float):
        self.scope = scope
        self._receive = receive
        self._send = send
        self.body_timeout_s = body_timeout_s
        self.arrived = asyncio.get_running_loop().time()
        self.body_deadline = self.arrived + body_timeout_s
        self.body_read = False
        self.timed_out = False
        self.started = False  # the response's status line went out
        self.finished = False
        self.sse = False
        self.ended = False  # the server answered in the application's stead
        self.lock = asyncio.Lock()  # one message at a time: an ending never splits a stream's event

    @property
    def workers_ai(self) -> bool:
        return bool(WORKERS_AI_RUN.match(self.scope["path"]))

    async def receive(self) -> Message:
        if self.ended or self.timed_out:
            return DISCONNECT
        if not self.body_read:
            try:
                async with asyncio.timeout_at(self.body_deadline):
                    message = await self._receive()
            except TimeoutError:
                # To the application, a client that stopped sending has gone; it is answered 408 after.
                self.timed_out = True
                return DISCONNECT
            if message["type"] != "http.request" or not message.get("more_body", False):
                self.body_read = True
            return message
        return await self._receive()

    async def send(self, message: Message) -> None:
        async with self.lock:
            if self.ended or self.timed_out:
                return  # answered already: the application's late messages have nobody to go to
            if message["type"] == "http.response.start":
                self.started = True
                headers = dict(message.get("headers", []))
                self.sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                if not self.body_read and self._has_body() and b"connection" not in headers:
                    # Answered before its body was read (refused by auth or rpm, say): closing the connection
                    # spares the server reading, for nobody, a body of up to the size limit.
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self.finished = True
            await self._send(message)

    def _has_body(self) -> bool:
        headers = dict(self.scope["headers"])
        return headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers

    async def answer_timeout(self) -> None:
        if self.started:
            return
        error = APIError(
            408,
            f"the request body did not arrive within {self.body_timeout_s:g}s of its headers; send it at once "
            "(its Content-Length must match what is sent)",
            "request_timeout",
            headers={"Connection": "close"},
        )
        await self._respond(error)

    async def end(self, grace_s: float) -> None:
        """The shutdown's grace period is over: answer in the application's stead, so the client can tell
        its request was cut (a 503, or an SSE error event and ``[DONE]``); a plain body already under way
        has no place for one and is left to the server's own deadline."""
        async with self.lock:
            if self.finished or self.ended or self.timed_out:
                return
            error = APIError(
                503,
                f"the server is shutting down and ended this request after waiting {grace_s:g}s for it to "
                "finish; send it again",
                "server_shutting_down",
                headers={"Retry-After": "1", "Connection": "close"},
            )
            if not self.started:
                await self._respond(error)
            elif self.sse:
                payload: dict[str, Any] = workers_ai_error(error) if self.workers_ai else error.body()
                event = f"data: {json.dumps(payload, separators=(',', ':'))}\r\n\r\ndata: [DONE]\r\n\r\n"
                await self._send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                await self._send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                return
            self.finished = True
            self.ended = True

    async def _respond(self, error: APIError) -> None:
        self.started = self.finished = True
        response = shaped_response(error, self.workers_ai)
        await response(self.scope, self._receive, self._send)
