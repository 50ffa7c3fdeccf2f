"""Read a request's token stream from Redis: its events in order, ending with its final or error event.

A worker appends Events to ``stream_key(request_id)``; the gateway reads them, stops at the request's
deadline or when the worker running it stops heartbeating, and sets ``cancel_key`` when the client goes away
so the worker frees the request's pages at once. Token entries that one read returns together (the gateway
fell behind) are passed on as one event, so a busy gateway sends fewer, longer chunks. The process's
``StreamHub`` (``stream_hub``) does the reading.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gpu_workers import lifecycle
from gpu_workers.lifecycle import Verdict
from gpu_workers.protocol import HEARTBEAT_TTL_S, STREAM_FIELD, STREAM_TTL_S, Event, cancel_key, stream_key
from tessera.responses import Result
from tessera.stream_hub import BLOCK_MS, hub_for


def decode_entry(fields: dict[bytes, bytes]) -> Event:
    return Event.from_json(fields[STREAM_FIELD.encode()])


async def cancel(redis: aioredis.Redis, request_id: str) -> None:
    """Ask the worker to drop the request; shielded so it runs even while the caller is being cancelled."""
    with anyio.CancelScope(shield=True), contextlib.suppress(RedisError):
        await redis.set(cancel_key(request_id), b"1", ex=STREAM_TTL_S)


@dataclass
class StreamReader:
    """The Events of one request, in order, ending with its final or error event (never hanging)."""

    redis: aioredis.Redis
    request_id: str
    deployment: str
    deadline: float
    workers: tuple[tuple[str, str], ...]  # (pool, worker id) to watch for death while the stream is quiet
    heartbeat_ttl_s: float = HEARTBEAT_TTL_S
    client_gone: Callable[[], Awaitable[bool]] | None = None  # polled between reads (non-stream requests)
    _orphaned_at: float | None = field(default=None, init=False, repr=False)  # see _worker_lost
    _entries: int = field(default=0, init=False, repr=False)  # stream entries read so far
    _holder: str | None = field(default=None, init=False, repr=False)  # the last attempt seen with the lease
    _checked_at: float = field(default=0.0, init=False, repr=False)  # monotonic time of the last quiet check

    async def events(self) -> AsyncIterator[Event]:
        """Use under ``contextlib.aclosing`` so an early exit cancels the request on the worker at once."""
        subscription = hub_for(self.redis).subscribe(stream_key(self.request_id))
        last_event = time.monotonic()
        # The stream is left to expire rather than deleted: a redelivered task reads it to see the request
        # already finished (and must not run, or bill, twice).
        finished = False  # the worker ended the stream itself; otherwise tell it to stop
        try:
            while True:
                remaining_s = self.deadline - time.time()
                if remaining_s <= 0:
                    yield _failure(
                        "timeout",
                        "the request ran past its deadline; retry later or with a smaller max_tokens",
                    )
                    return
                try:
                    entries = await subscription.read(min(BLOCK_MS / 1000, remaining_s))
                except RedisError as e:
                    yield _failure("stream_unavailable", f"lost the request's token stream ({e}); retry")
                    return
                # A run of token entries that one read returned (the reader fell behind the worker) goes on
                # as one event: one SSE chunk for the client to parse instead of many.
                tokens: Event | None = None
                for _, fields in entries:
                    event = decode_entry(fields)
                    if event.worker_id:  # its writer held the lease when it wrote (see _worker_lost)
                        self._holder = event.worker_id
                    if event.kind == "token":
                        tokens = event if tokens is None else _joined(tokens, event)
                        continue
                    if tokens is not None:
                        yield tokens
                        tokens = None
                    finished = event.kind in ("final", "error")
                    yield event
                    if finished:
                        return
                if tokens is not None:
                    yield tokens
                if entries:
                    last_event = time.monotonic()
                    self._entries += len(entries)
                    self._orphaned_at = None
                elif self.client_gone is not None and await self.client_gone():
                    return
                elif self._quiet_check_due(last_event) and await self._worker_lost(last_event):
                    yield _failure(
                        "worker_lost", "the worker serving this request stopped; retry the request"
                    )
                    return
        finally:
            subscription.close()
            if not finished:
                await cancel(self.redis, self.request_id)

    def _quiet_check_due(self, last_event: float) -> bool:
        """Whether to ask ``_worker_lost`` now (``lifecycle.quiet_check_due``)."""
        now = time.monotonic()
        if not lifecycle.quiet_check_due(now - last_event, now - self._checked_at, self.heartbeat_ttl_s):
            return False
        self._checked_at = now
        return True

    async def _worker_lost(self, last_event: float) -> bool:
        """Whether nobody is left to serve the request: ``lifecycle.judge`` over what ``lifecycle.observe``
        reads, a SUSPECT verdict turning LOST once it has lasted a further heartbeat TTL."""
        now = time.monotonic()
        try:
            seen = await lifecycle.observe(
                self.redis,
                self.request_id,
                self.deployment,
                self.workers,
                idle_s=now - last_event,
                streamed=self._entries > 0,
                last_holder=self._holder,
                now=time.time(),
            )
        except RedisError:
            return False  # the next read reports Redis itself; the wait for a peer goes on where it was
        if seen.lease_holder is not None:
            self._holder = seen.lease_holder
        suspect_for_s = None if self._orphaned_at is None else now - self._orphaned_at
        verdict = lifecycle.judge(seen, self.heartbeat_ttl_s, suspect_for_s)
        if verdict is Verdict.ALIVE:
            self._orphaned_at = None
        elif verdict is Verdict.SUSPECT and self._orphaned_at is None:
            self._orphaned_at = now
        return verdict is Verdict.LOST


def _joined(first: Event, then: Event) -> Event:
    return Event(
        kind="token",
        token_ids=first.token_ids + then.token_ids,
        text=first.text + then.text,
        worker_id=then.worker_id,
    )


def _failure(code: str, message: str) -> Event:
    return Event(kind="error", error={"code": code, "message": message})


async def collect(reader: StreamReader) -> Result:
    result = Result()
    async with aclosing(reader.events()) as events:
        async for event in events:
            result.add(event)
    return result


async def tagged(reader: StreamReader) -> AsyncIterator[tuple[int, Event]]:
    """One request's events as choice 0's (``sse``'s input for a single choice)."""
    async with aclosing(reader.events()) as events:
        async for event in events:
            yield 0, event
