"""The stream hub: one XREAD BLOCK per Redis client reads every stream its process's requests wait on.

A worker's engine step appends a token to each of its requests' streams in one pipeline, and the hub takes
all of them in one round trip, where a read per request made one round trip per request per step (and held
one pooled connection per waiting request). A request that starts reading while the hub's XREAD is blocked
wakes it with an entry on the hub's own wake stream.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

BLOCK_MS = 500  # how long one XREAD waits; bounds how late a deadline or a dead worker is noticed


class HubReadFailed(RedisError):
    """The hub's XREAD failed: every stream it was reading reports the error."""


class Subscription:
    """The entries the hub has read for one stream and not yet handed out."""

    def __init__(self, hub: StreamHub, key: bytes, last_id: bytes):
        self.hub = hub
        self.key = key
        self.last_id = last_id
        self.entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        self.error: RedisError | None = None
        self._waiter: asyncio.Future[None] | None = None

    async def read(self, timeout_s: float) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The entries after the last ones read, waiting up to ``timeout_s`` for some ([] when none came);
        raises the hub's error when its read failed."""
        if not self.entries and self.error is None:
            await self.hub.ensure_reading(self)
        if not self.entries and self.error is None:  # (entries may have come while it woke the hub)
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _set_done, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        if self.error is not None:
            raise self.error
        entries, self.entries = self.entries, []
        return entries

    def close(self) -> None:
        self.hub.unsubscribe(self)

    def _deliver(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        self.entries.extend(entries)
        self.last_id = entries[-1][0]
        _set_done(self._waiter)

    def _fail(self, error: RedisError) -> None:
        self.error = error
        _set_done(self._waiter)


def _set_done(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class StreamHub:
    """Reads every subscribed stream with one XREAD BLOCK at a time, on one of the client's connections.

    The reading task runs while any stream is subscribed. ``block_ms`` bounds how long one read waits; a new
    subscriber during a blocked read adds an entry to ``wake_key`` (a stream of the hub's own, trimmed to
    one entry and expiring), which ends that read at once."""

    WAKE_TTL_S = 3600

    def __init__(self, redis: aioredis.Redis, *, block_ms: int = BLOCK_MS, count: int = 64):
        self.redis = redis
        self.block_ms = block_ms
        self.count = count
        self.wake_key = f"tessera:hub:{uuid.uuid4().hex}".encode()
        self._wake_id = b"0-0"
        self._subs: dict[bytes, Subscription] = {}
        self._task: asyncio.Task[None] | None = None
        self._reading: dict[bytes, bytes] = {}  # the streams of the XREAD in flight (key -> last id)

    def subscribe(self, key: str | bytes, last_id: bytes = b"0-0") -> Subscription:
        key = key.encode() if isinstance(key, str) else key
        if key in self._subs:
            raise ValueError(f"stream {key!r} is already being read")
        sub = self._subs[key] = Subscription(self, key, last_id)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if self._subs.get(sub.key) is sub:
            del self._subs[sub.key]

    async def ensure_reading(self, sub: Subscription) -> None:
        """Make sure a read covers ``sub``: start the reading task, or wake the one blocked without it."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._reading = {}
            self._task = loop.create_task(self._run(), name="tessera-stream-hub")
        elif sub.key not in self._reading and self._reading:
            self._reading = {}  # one wake per blocked read is enough
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.xadd(self.wake_key, {b"w": b"1"}, maxlen=1, approximate=False)
                    pipe.expire(self.wake_key, self.WAKE_TTL_S)
                    await pipe.execute()
            except RedisError as e:
                sub._fail(e)

    async def _run(self) -> None:
        try:
            while self._subs:
                streams = {self.wake_key: self._wake_id}
                streams.update((key, sub.last_id) for key, sub in self._subs.items())
                self._reading = streams
                try:
                    reply = await self.redis.xread(streams, block=self.block_ms, count=self.count)
                except Exception as e:  # Redis away, or anything else: no reader may wait on a dead hub
                    if not isinstance(e, RedisError):
                        log.exception("the stream hub's read failed")
                    error = HubReadFailed(str(e))
                    for sub in list(self._subs.values()):
                        sub._fail(error)
                    self._subs.clear()
                    return
                finally:
                    self._reading = {}
                for key, entries in reply or ():
                    if key == self.wake_key:
                        self._wake_id = entries[-1][0]
                        continue
                    sub = self._subs.get(key)
                    if sub is not None and entries:
                        sub._deliver(entries)
        finally:
            if self._task is asyncio.current_task():
                self._task = None


_HUBS: weakref.WeakKeyDictionary[aioredis.Redis, StreamHub] = weakref.WeakKeyDictionary()


def hub_for(redis: aioredis.Redis) -> StreamHub:
    """The stream hub of a Redis client (one per client: the gateway has one client per process)."""
    hub = _HUBS.get(redis)
    if hub is None:
        hub = _HUBS[redis] = StreamHub(redis)
    return hub
