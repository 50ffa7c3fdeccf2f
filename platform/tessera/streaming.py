"""Read a request's token stream from Redis and shape it as OpenAI responses: SSE chunks or one body.

A worker appends Events to ``stream_key(request_id)``; the gateway reads them, stops at the request's
deadline or when the worker running it stops heartbeating, and sets ``cancel_key`` when the client goes away
so the worker frees the request's pages at once. Token entries that one read returns together (the gateway
fell behind) are passed on as one event, so a busy gateway sends fewer, longer chunks.

One ``StreamHub`` per Redis client reads every stream its process's requests are waiting on with a single
XREAD BLOCK: a worker's engine step appends a token to each of its requests' streams in one pipeline, and the
hub takes all of them in one round trip, where a read per request made one round trip per request per step
(and held one pooled connection per waiting request). A request that starts reading while the hub's XREAD
is blocked wakes it with an entry on the hub's own wake stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gpu_workers.protocol import (
    HEARTBEAT_TTL_S,
    POOLS,
    STREAM_FIELD,
    STREAM_TTL_S,
    Event,
    TokenLogprob,
    cancel_key,
    inflight_key,
    lease_key,
    pool_queue,
    stream_key,
)
from tessera import routing
from tessera.errors import APIError
from tessera.tool_calls import Delta, ToolCallParser, parse_message
from tessera.tool_calls import Message as ToolMessage

log = logging.getLogger(__name__)

BLOCK_MS = 500  # how long one XREAD waits; bounds how late a deadline or a dead worker is noticed
# Worker error codes that mean the request itself can never be served; every other code is a server fault.
CLIENT_ERROR_CODES = frozenset(
    {
        "context_length_exceeded",
        "kv_budget_exceeded",
        "empty_prompt",
        "invalid_prompt",
        "invalid_max_tokens",
        "invalid_stop",
        "invalid_temperature",
        "invalid_top_k",
        "invalid_top_p",
        "no_tokenizer",
    }
)
_SERVER_ERROR_STATUS = {
    "timeout": 504,
    "deadline_exceeded": 504,
    "worker_lost": 503,
    "stream_unavailable": 503,
}
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}


def error_status(code: str) -> int:
    if code in CLIENT_ERROR_CODES:
        return 400
    return _SERVER_ERROR_STATUS.get(code, 500)


def event_error(event: Event) -> APIError:
    error = event.error or {}
    code = error.get("code", "internal_error")
    return APIError(error_status(code), error.get("message", "the worker failed the request"), code)


def decode_entry(fields: dict[bytes, bytes]) -> Event:
    return Event.from_json(fields[STREAM_FIELD.encode()])


async def cancel(redis: aioredis.Redis, request_id: str) -> None:
    """Ask the worker to drop the request; shielded so it runs even while the caller is being cancelled."""
    with anyio.CancelScope(shield=True), contextlib.suppress(RedisError):
        await redis.set(cancel_key(request_id), b"1", ex=STREAM_TTL_S)


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
                elif self._quiet_check_due(last_event) and await self._worker_lost():
                    yield _failure(
                        "worker_lost", "the worker serving this request stopped; retry the request"
                    )
                    return
        finally:
            subscription.close()
            if not finished:
                await cancel(self.redis, self.request_id)

    def _quiet_check_due(self, last_event: float) -> bool:
        """Whether to ask ``_worker_lost`` now: the stream quiet a heartbeat TTL, and a quarter TTL since the
        last time (each asking costs a few Redis reads; a queue of quiet requests would repeat them per read)."""
        now = time.monotonic()
        if now - last_event <= self.heartbeat_ttl_s or now - self._checked_at < self.heartbeat_ttl_s / 4:
            return False
        self._checked_at = now
        return True

    async def _worker_lost(self) -> bool:
        """Whether nobody is left to serve the request, asked while its stream has been quiet a heartbeat TTL.

        Not while an attempt holds its lease (the worker serving it renews that every heartbeat, also while
        it drains out of its pool in a reload, and it lapses a TTL after that worker dies), nor for a prefill
        worker that streamed its token and ended its part (its in-flight record gone). Without a lease,
        lost at once when a worker it was routed to is not live and that pool has no live worker either.
        Otherwise suspect, and lost once a further TTL passes without a lease: a routed worker gone while its
        pool has live peers and an empty pool queue (a dead worker's peers re-queue or fail what it left, a
        departing one hands its queue to its pool, where a busy peer may take a while), or the last attempt
        seen holding the lease or writing the stream, when no router chose it (a peer took the request up),
        it is live in no pool and still records the request in flight (it died, maybe after leaving its
        pool, where no peer recovers it)."""
        try:
            holder = await self.redis.get(lease_key(self.request_id))
            if holder is not None:
                self._holder = holder.decode()
                self._orphaned_at = None
                return False
            suspect = False
            for pool, worker_id in self.workers:
                if await routing.is_live(self.redis, self.deployment, pool, worker_id, self.heartbeat_ttl_s):
                    continue
                if pool == "prefill" and self._entries and not await self._serving(worker_id):
                    continue  # it streamed its token and ended its part: decode goes on without it
                if not await routing.live_workers(self.redis, self.deployment, pool, self.heartbeat_ttl_s):
                    return True
                if await self.redis.llen(pool_queue(self.deployment, pool)):
                    continue  # handed to the pool's queue, it may wait there for a busy peer
                suspect = True
                break
            if not suspect and self._holder is not None and self._holder not in (w for _, w in self.workers):
                suspect = await self._serving(self._holder) and not await self._live_anywhere(self._holder)
        except RedisError:
            return False  # the next read reports Redis itself; the wait for a peer goes on where it was
        if not suspect:
            self._orphaned_at = None
            return False
        now = time.monotonic()
        if self._orphaned_at is None:
            self._orphaned_at = now
        return now - self._orphaned_at > self.heartbeat_ttl_s

    async def _serving(self, worker_id: str) -> bool:
        """Whether ``worker_id`` still records this request in flight (begun and not ended)."""
        return bool(await self.redis.hexists(inflight_key(worker_id), self.request_id))

    async def _live_anywhere(self, worker_id: str) -> bool:
        for pool in POOLS:
            if await routing.is_live(self.redis, self.deployment, pool, worker_id, self.heartbeat_ttl_s):
                return True
        return False


def _joined(first: Event, then: Event) -> Event:
    return Event(
        kind="token",
        token_ids=first.token_ids + then.token_ids,
        text=first.text + then.text,
        worker_id=then.worker_id,
    )


def _failure(code: str, message: str) -> Event:
    return Event(kind="error", error={"code": code, "message": message})


# A request's price: its usage -> the fields it adds to the usage body (``cost`` in USD and its details).
Pricing = Callable[[dict[str, int]], dict[str, Any]]


def usage_body(usage: dict[str, int] | None, cost: Pricing | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with ``cost``, also what the request costs (as the ledger records it)."""
    usage = usage or {}
    prompt = usage.get("prompt_tokens", 0)
    completion = usage.get("completion_tokens", 0)
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
    }
    if cost is not None:
        body.update(cost(usage))
    return body


@dataclass
class Result:
    """A finished request, accumulated from its events."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    error: Event | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asked

    def add(self, event: Event) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs or ())
        if event.usage is not None:  # final events carry usage, and so may error events
            self.usage = event.usage
        if event.kind == "final":
            self.finish_reason = event.finish_reason
        elif event.kind == "error":
            self.error = event

    def usage_or_count(self, prompt_tokens: int) -> dict[str, int]:
        """The worker's usage, or what the gateway saw (prompt length, tokens streamed) when there is none."""
        if self.usage is not None:
            return self.usage
        return {"prompt_tokens": prompt_tokens, "cached_tokens": 0, "completion_tokens": len(self.token_ids)}


@dataclass
class StreamedLogprobs:
    """Token logprobs in OpenAI's two forms: chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``
    and completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``; a stream's offsets run on from
    chunk to chunk. A token's text is its bytes as UTF-8, a partial character written as ``\\xNN``."""

    kind: str
    token_bytes: Callable[[int], bytes]
    pending: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0  # characters of the completion before the next token (completions' text_offset)

    def take(self, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any] | None:
        """``logprobs`` (default: those pending, which are then cleared) in this kind's form; None if none."""
        if logprobs is None:
            logprobs, self.pending = self.pending, []
        if not logprobs:
            return None
        if self.kind == "chat":
            return {"content": [self._entry(lp) for lp in logprobs], "refusal": None}
        tokens, offsets = [], []
        for lp in logprobs:
            tokens.append(self._text(lp.token))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def _text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="backslashreplace")

    def _entry(self, lp: TokenLogprob) -> dict[str, Any]:
        def one(token: int, logprob: float) -> dict[str, Any]:
            raw = self.token_bytes(token)
            return {
                "token": raw.decode("utf-8", errors="backslashreplace"),
                "logprob": logprob,
                "bytes": list(raw),
            }

        return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


@dataclass(frozen=True)
class OpenAIShape:
    """Builds one request's OpenAI objects: ``chat`` (chat.completion) or ``text`` (text_completion). With
    ``tool_names``, a chat answer's tool calls (``tessera.tool_calls``) become ``tool_calls``, streamed as
    OpenAI streams them: per call a first delta with its index, id, type and name, then its arguments."""

    kind: str
    response_id: str
    model: str
    created: int
    cost: Pricing | None = None
    tool_names: tuple[str, ...] = ()
    # With logprobs asked: a token id's bytes (the model's tokenizer), to write each token's text.
    token_bytes: Callable[[int], bytes] | None = None
    _parser: ToolCallParser | None = field(default=None, init=False, repr=False, compare=False)
    _logprobs: StreamedLogprobs | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A stream's state, fresh for each copy (``dataclasses.replace`` makes one per request).
        if self.tool_names:
            object.__setattr__(self, "_parser", ToolCallParser(self.tool_names))
        if self.token_bytes is not None:
            object.__setattr__(self, "_logprobs", StreamedLogprobs(self.kind, self.token_bytes))

    def response(self, result: Result, prompt_tokens: int) -> dict[str, Any]:
        finish = FINISH_REASONS.get(result.finish_reason or "stop", "stop")
        logprobs = None
        if self.token_bytes is not None:
            logprobs = StreamedLogprobs(self.kind, self.token_bytes).take(result.logprobs)
        if self.kind == "chat" and self.tool_names:
            message = parse_message(result.text, self.tool_names)
            body: dict[str, Any] = {"role": "assistant", "content": message.content}
            if message.tool_calls:
                body["tool_calls"] = message.tool_calls
                finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": 0, "message": body, "finish_reason": finish, "logprobs": logprobs}
            obj = "chat.completion"
        elif self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": finish,
                "logprobs": logprobs,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": finish, "logprobs": logprobs}
            obj = "text_completion"
        return {
            **self._head(obj),
            "choices": [choice],
            "usage": usage_body(result.usage_or_count(prompt_tokens), self.cost),
        }

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any] | None:
        """A chunk for ``text`` (and its tokens' ``logprobs``); None when there is nothing to send yet: a
        tool call's markup not decided, or logprobs alone while tool calls are parsed (they go with the next
        chunk sent, the last one at the latest)."""
        finish = FINISH_REASONS.get(finish_reason, "stop") if finish_reason else None
        if self._logprobs is not None and logprobs:
            self._logprobs.pending.extend(logprobs)
        if self.kind == "chat" and self._parser is not None and not first:
            deltas = self._parser.feed(text)
            if finish_reason:
                deltas += self._parser.finish()
                if self._parser.calls and finish == "stop":
                    finish = "tool_calls"
            delta = _openai_delta(deltas)
            if not delta and finish is None:
                return None
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": self._pending()}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text or first else {}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": self._pending()}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": self._pending()}
        return {**self._head("text_completion"), "choices": [choice]}

    def _pending(self) -> dict[str, Any] | None:
        return None if self._logprobs is None else self._logprobs.take()

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_body(usage, self.cost)}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    def error_chunk(self, error: APIError) -> dict[str, Any]:
        return error.body()


def _openai_delta(deltas: list[Delta]) -> dict[str, Any]:
    """One chunk's delta from the parser's pieces: their content joined, and per call touched one
    ``tool_calls`` entry (its first carries id, type and name; arguments joined)."""
    delta: dict[str, Any] = {}
    content = "".join(d.content for d in deltas)
    if content:
        delta["content"] = content
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.index is None:
            continue
        entry = calls.setdefault(d.index, {"index": d.index, "function": {"arguments": ""}})
        if d.name is not None:
            entry.update(id=d.id, type="function")
            entry["function"] = {"name": d.name, "arguments": entry["function"]["arguments"]}
        entry["function"]["arguments"] += d.arguments
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta


class Shape(Protocol):
    """How one request's answer is written: the whole body, stream chunks, the usage chunk, a mid-stream error.
    ``kind == "chat"`` opens a stream with a role chunk; a ``chunk`` of ``None`` is not sent. A dataclass: the
    gateway sets ``cost`` (``dataclasses.replace``) to the request's pricing."""

    kind: str
    cost: Pricing | None

    def response(self, result: Result, prompt_tokens: int) -> dict[str, Any]: ...

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any] | None: ...

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]: ...

    def error_chunk(self, error: APIError) -> dict[str, Any]: ...


# Workers AI's numeric error codes, by our error code; anything else is 5007 (bad input) when it is the
# caller's fault and 3043 (internal error) when it is ours.
WORKERS_AI_CODES = {
    "invalid_api_key": 10000,
    "permission_denied": 10000,
    "rate_limit_exceeded": 3036,
    "quota_exceeded": 3036,
    "spend_budget_exceeded": 3036,
    "no_live_worker": 3040,
    "out_of_capacity": 3040,
    "queue_full": 3040,
    "worker_lost": 3040,
    "queue_unavailable": 3040,
    "quota_unavailable": 3040,
    "model_unavailable": 3040,
    "context_length_exceeded": 3006,
    "max_tokens_too_large": 3006,
    "kv_budget_exceeded": 3006,
    "request_too_large": 3006,
    "timeout": 3007,
    "deadline_exceeded": 3007,
    "model_not_found": 5018,
    "account_not_found": 7003,
}


def workers_ai_code(error: APIError) -> int:
    code = WORKERS_AI_CODES.get(error.code)
    if code is not None:
        return code
    return 3043 if error.status >= 500 else 5007


def workers_ai_envelope(result: Any) -> dict[str, Any]:
    return {"result": result, "success": True, "errors": [], "messages": []}


def workers_ai_error(error: APIError) -> dict[str, Any]:
    """Workers AI's error envelope: ``success: false`` and ``errors: [{"code": <int>, "message"}]``."""
    return {
        "result": None,
        "success": False,
        "errors": [{"code": workers_ai_code(error), "message": error.message}],
        "messages": [],
    }


@dataclass(frozen=True)
class WorkersAIShape:
    """Workers AI's ``/ai/run`` answers: ``{"result": {"response", "usage"}, "success", ...}``, or SSE
    ``{"response": "..."}`` events, the last one with ``usage``, then ``[DONE]``."""

    kind: str = "workers_ai"
    cost: Pricing | None = None
    json_mode: bool = False  # response_format asked for JSON: a complete answer is returned parsed
    # With tools: calls come back as ``tool_calls`` ([{"name", "arguments": {...}}]) beside ``response``
    # (the text before them); streamed, the calls come with the last event.
    tool_names: tuple[str, ...] = ()
    _parser: ToolCallParser | None = field(default=None, init=False, repr=False, compare=False)
    _message: ToolMessage | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tool_names:
            object.__setattr__(self, "_parser", ToolCallParser(self.tool_names))
            object.__setattr__(self, "_message", ToolMessage())

    def response(self, result: Result, prompt_tokens: int) -> dict[str, Any]:
        usage = usage_body(result.usage_or_count(prompt_tokens), self.cost)
        answer: Any = result.text
        if self.tool_names:
            message = parse_message(result.text, self.tool_names)
            body = {"response": message.content or ""}
            if message.tool_calls:
                body["tool_calls"] = _workers_ai_calls(message)
            return workers_ai_envelope({**body, "usage": usage})
        if self.json_mode and result.finish_reason == "stop":
            # Grammar-constrained, so a stopped answer parses; one cut by max_tokens stays text.
            with contextlib.suppress(ValueError):
                answer = json.loads(result.text)
        return workers_ai_envelope({"response": answer, "usage": usage})

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any] | None:
        # Workers AI's run route has no logprobs: its requests never ask for them.
        if self._parser is None:
            return {"response": text} if text else None
        deltas = self._parser.feed(text) + (self._parser.finish() if finish_reason else [])
        for delta in deltas:
            self._message.add(delta)
        content = "".join(d.content for d in deltas)
        if finish_reason and self._message.tool_calls:
            return {"response": content, "tool_calls": _workers_ai_calls(self._message)}
        return {"response": content} if content else None

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"response": "", "usage": usage_body(usage, self.cost)}

    def error_chunk(self, error: APIError) -> dict[str, Any]:
        return workers_ai_error(error)


def _workers_ai_calls(message: ToolMessage) -> list[dict[str, Any]]:
    """Workers AI's calls: the name and the arguments parsed (their text when a cut call's do not parse)."""
    calls = []
    for call in message.tool_calls:
        arguments: Any = call["function"]["arguments"]
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
        calls.append({"name": call["function"]["name"], "arguments": arguments})
    return calls


async def collect(reader: StreamReader) -> Result:
    result = Result()
    async with aclosing(reader.events()) as events:
        async for event in events:
            result.add(event)
    return result


async def sse(
    events: AsyncIterator[tuple[int, Event]],
    shapes: list[Shape],
    prompt_tokens: int,
    include_usage: bool,
    on_finish: Callable[[list[Result]], None],
    usage_of: Callable[[list[Result]], dict[str, int]] | None = None,
) -> AsyncIterator[str]:
    """SSE ``data:`` payloads of a request's choices (``events``: (choice index, event), ``shapes``: one per
    choice): a role chunk per choice, content chunks as they come, each choice's finish chunk, usage if
    asked (``usage_of`` the results, default the one choice's), ``[DONE]``.

    A worker error after the stream began becomes an OpenAI error chunk (the status is already 200) and
    ends the stream. ``on_finish`` gets the accumulated results, however the stream ended.
    """
    results = [Result() for _ in shapes]
    many = len(shapes) > 1
    try:
        for index, shape in enumerate(shapes):
            if shape.kind == "chat":
                yield _dump(_indexed(shape.chunk("", None, first=True), index, many))
        async with aclosing(events) as tagged:
            async for index, event in tagged:
                results[index].add(event)
                if event.kind == "error":
                    yield _dump(shapes[index].error_chunk(event_error(event)))
                    break
                finish = event.finish_reason if event.kind == "final" else None
                if event.text or finish or event.logprobs:
                    chunk = shapes[index].chunk(event.text, finish, logprobs=event.logprobs)
                    if chunk is not None:
                        yield _dump(_indexed(chunk, index, many))
        if include_usage and all(r.error is None for r in results):
            usage = usage_of(results) if usage_of else results[0].usage_or_count(prompt_tokens)
            yield _dump(shapes[0].usage_chunk(usage))
        yield "[DONE]"
    finally:
        on_finish(results)


async def tagged(reader: StreamReader) -> AsyncIterator[tuple[int, Event]]:
    """One request's events as choice 0's (``sse``'s input for a single choice)."""
    async with aclosing(reader.events()) as events:
        async for event in events:
            yield 0, event


def _indexed(obj: dict[str, Any] | None, index: int, many: bool) -> dict[str, Any] | None:
    if many and obj is not None:
        for choice in obj.get("choices", ()):
            choice["index"] = index
    return obj


# Characters str.splitlines (and so httpx's ``iter_lines`` and many SSE clients) splits a line at, which
# json.dumps leaves raw with ensure_ascii=False; SSE itself ends lines only at CR/LF. Escaped, the data line
# stays one line for every client and decodes to the same text.
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def _dump(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
