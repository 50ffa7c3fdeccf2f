"""The API's HTTP server: uvicorn on h11 with the limits of ``Settings`` (README "Server limits"), and a
shutdown that drains.

uvicorn's own knobs bound the header block (``h11_max_incomplete_event_size``: a larger one is a 400 and the
connection closed), idle keep-alive connections (``timeout_keep_alive``) and open connections
(``limit_concurrency``: beyond it a new request gets 503). uvicorn has no deadline for a request's headers, so
``HeaderDeadlineProtocol`` adds one; the body's deadline and the drain are ``tessera.api.guard``'s.
h11, not httptools: httptools' parser takes a header block of any size.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from types import FrameType

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from tessera.api.guard import Drain
from tessera.settings import Settings

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations of this size and up get pages of their own, returned to the system when freed.
LARGE_ALLOCATION_BYTES = 128 * 1024

# uvicorn cancels what still runs this long after the grace period: the guard's endings have gone out by then.
SHUTDOWN_MARGIN_S = 2.0


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for a request's headers: the clock starts when the connection
    opens and again when a response completes, and the request's headers stop it. Without it a connection
    that sends nothing, or a header line now and then, is held for ever."""

    header_timeout_s = 10.0
    _headers_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # before the base class, which may start a pipelined request at once
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._headers_due = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_late(self) -> None:
        self._headers_due = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM (or Ctrl-C) stops accepting and begins ``drain``: running requests
    get its grace period, then the guard ends those left with an error their clients can read."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.drain.begin()
        super().handle_exit(sig, frame)


def return_large_allocations() -> bool:
    """Make glibc give the memory of large allocations (request bodies, their JSON, prompts) back to the system
    when they are freed. By default glibc raises its mmap threshold to the largest block freed so far (up to
    32 MiB), so after one 10 MB batch every later body is carved from the heap and the process keeps the
    high-water mark for good: a flood of large requests grew the API from 105 MB to 1.7 GB and it stayed
    there. A fixed threshold keeps blocks of 128 KiB and up in pages of their own. False where the C library
    is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    ok = mallopt(M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES) and mallopt(
        M_TRIM_THRESHOLD, LARGE_ALLOCATION_BYTES
    )
    if not ok:
        log.warning("could not set glibc's mmap threshold: large request bodies may stay in the heap")
    return bool(ok)


def server(app: FastAPI, settings: Settings) -> DrainingServer:
    # sse-starlette would end every stream the moment uvicorn is told to exit, cleanly, as if finished: the
    # drain ends them instead, after the grace period and with an error event.
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()
    return_large_allocations()
    protocol = type(
        "HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": settings.header_timeout_s}
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_keep_alive=settings.keep_alive_s,
        limit_concurrency=settings.max_connections,
        timeout_graceful_shutdown=settings.shutdown_grace_s + SHUTDOWN_MARGIN_S,
    )
    return DrainingServer(config, app.state.drain)
