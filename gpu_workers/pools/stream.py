"""A request's Redis Stream and its lease: who may write to it, what it already holds.

One attempt at a time serves a request: the holder of ``lease_key(request_id)`` (``gpu_workers.lifecycle``
holds the keys and the scripts). Every write checks the lease and appends in one Lua script, so an attempt whose lease was taken over (its worker was declared
dead, the message was delivered twice) can never add a token after that, however late it wakes up.
Reading what a stream holds lets a redelivered task decide between skipping, failing and retrying.

``StepWriter`` is how a worker streams: one thread writes the new tokens of every running request with one
script call per wake-up (a wake-up follows an engine step; tokens of several steps that piled up while
Redis was busy go out as one entry per request) and reads every request's cancel key in the same round
trip. The engine's step only appends to an in-memory queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.exceptions import NoScriptError, RedisError

from gpu_workers import lifecycle
from gpu_workers.lifecycle import LEASE_TTL_MS, lease_key
from gpu_workers.protocol import STREAM_FIELD, STREAM_TTL_S, Event, cancel_key, stream_key

log = logging.getLogger(__name__)

CHECK_S = 0.1  # longest time between two reads of the cancel keys (and deadline checks) when no token flows
STREAM_MAXLEN = 10_000  # events kept per stream (about a token each): a bound, never reached by a live reader
TERMINAL = ("final", "error")


class LeaseLost(RuntimeError):
    """Another attempt now owns the request; this one must stop without writing."""


@dataclass(frozen=True)
class Begun:
    """How an attempt's start went (``RequestStream.begin``)."""

    status: str  # claimed | finished | busy | cut
    events: int  # entries the stream held
    cancelled: bool = False  # the request's cancel key was set (known only when claimed)


@dataclass
class StreamState:
    events: int  # entries in the stream
    last: Event | None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.kind in TERMINAL


def read_state(client: redis.Redis, request_id: str) -> StreamState:
    pipe = client.pipeline(transaction=False)
    pipe.xlen(stream_key(request_id))
    pipe.xrevrange(stream_key(request_id), count=1)
    length, last = pipe.execute()
    return StreamState(length, Event.from_json(last[0][1][STREAM_FIELD.encode()]) if last else None)


class RequestStream:
    """One attempt's handle on a request's stream: claim the lease, append events under it, release it."""

    def __init__(self, client: redis.Redis, request_id: str, owner: str):
        self.client = client
        self.request_id = request_id
        self.owner = owner
        self._lease = lease_key(request_id)
        self._append = client.register_script(lifecycle.APPEND)
        self._release = client.register_script(lifecycle.RELEASE)
        self._take_over = client.register_script(lifecycle.TAKE_OVER)
        self._begin = client.register_script(lifecycle.BEGIN)
        self._end = client.register_script(lifecycle.END)

    def claim(self, previous_owner: str | None = None) -> bool:
        """Take the lease if it is free or held by ``previous_owner`` (a dead worker, or the prefill that
        handed this request to decode); False if another attempt holds it."""
        if previous_owner is None:
            return bool(self.client.set(self._lease, self.owner, nx=True, px=LEASE_TTL_MS))
        return bool(self._take_over(keys=[self._lease], args=[self.owner, previous_owner, LEASE_TTL_MS]))

    def begin(self, *, handed_over: bool, inflight: tuple[str, str, str]) -> Begun:
        """Start an attempt in one round trip: read what the stream holds, take the lease if it is free (or,
        ``handed_over``, as decode continues prefill's stream: held by the worker that wrote the stream's
        only event, which the attempt then expects to find), record the request in the worker's in-flight
        hash (``inflight``: key, field, value) and read its cancel key, all as one atomic step. A ``cut`` or
        ``claimed`` attempt holds the lease: ``end`` it."""
        key, name, value = inflight
        status, events, cancelled = self._begin(
            keys=[stream_key(self.request_id), self._lease, key, cancel_key(self.request_id)],
            args=[self.owner, LEASE_TTL_MS, int(handed_over), name, value, STREAM_TTL_S],
        )
        return Begun(status.decode(), int(events), bool(cancelled))

    def end(self, inflight_key: str) -> None:
        """End an attempt ``begin`` started: drop its in-flight record and release the lease if still ours."""
        self._end(keys=[self._lease, inflight_key], args=[self.owner, self.request_id])

    def release(self) -> None:
        self._release(keys=[self._lease], args=[self.owner])

    def state(self) -> StreamState:
        return read_state(self.client, self.request_id)

    def publish(self, *events: Event) -> None:
        """Append events in order; raises LeaseLost if this attempt no longer owns the request."""
        if events:
            keys, args = append_args([(self, events)])
            self.check_written(self._append(keys=keys, args=args)[0])

    def check_written(self, reply: Any) -> None:
        if isinstance(reply, Exception):
            raise reply
        if reply < 0:
            raise LeaseLost(f"request {self.request_id} is now served by another attempt")


def append_args(appends: list[tuple[RequestStream, Sequence[Event]]]) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of the append script for these streams' events (stamped with each stream's owner)."""
    keys: list[str] = []
    args: list[Any] = [STREAM_MAXLEN, STREAM_TTL_S, LEASE_TTL_MS, STREAM_FIELD]
    for stream, events in appends:
        keys += [stream._lease, stream_key(stream.request_id)]
        args += [stream.owner, len(events)]
        for event in events:
            event.worker_id = stream.owner
            args.append(event.to_json())
    return keys, args


@dataclass(eq=False)
class Streamed:
    """One request while ``StepWriter`` streams it: the engine's events go in through ``put``; ``wait``
    returns once its final event is written (``final``), or the writing failed (``error``)."""

    stream: RequestStream
    deadline: float  # unix time: the writer aborts the request then
    _events: queue.SimpleQueue = field(repr=False)
    final: Any = None  # the engine's final StreamEvent
    completion_tokens: int = 0
    deadline_exceeded: bool = False
    stopping: bool = (
        False  # aborted (cancel key, deadline, lost lease, failed write): the final event follows
    )
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    def put(self, event: Any) -> None:
        """The engine's ``on_event``: never blocks."""
        self._events.put((self, event))

    def wait(self, poll_s: float = 1.0, alive: Callable[[], bool] = lambda: True) -> None:
        while not self.done.wait(poll_s):
            if not alive():
                raise RuntimeError("the stream writer of this worker stopped")


class StepWriter:
    """Writes the tokens of every request this worker streams, and reads their cancel keys, in one round trip.

    ``abort(request_id)`` stops a request in the engine: a set cancel key, a deadline passed, a lease lost
    or a write that failed. The engine then emits the request's final event, which ends it here too.
    """

    def __init__(self, client: redis.Redis, abort: Callable[[str], object], check_s: float = CHECK_S):
        self.client = client
        self.abort = abort
        self.check_s = check_s
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Streamed] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._append = client.register_script(lifecycle.APPEND)
        self.round_trips = 0  # pipelines executed (writes and cancel reads)
        self.entries_written = 0  # stream entries they appended

    def open(self, stream: RequestStream, deadline: float) -> Streamed:
        request = Streamed(stream, deadline, self._events)
        with self._lock:
            self._live[request.request_id] = request
        return request

    def start(self) -> None:
        """Write from a thread of its own from now on (once; later calls do nothing)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="stream-writer", daemon=True)
                self._thread.start()

    def pending(self) -> list[tuple[Streamed, Any]]:
        """The events put so far and not yet written (waiting up to ``check_s`` for the first)."""
        try:
            batch = [self._events.get(timeout=self.check_s)]
        except queue.Empty:
            return []
        while True:
            try:
                batch.append(self._events.get_nowait())
            except queue.Empty:
                return batch

    def close(self, request: Streamed) -> None:
        with self._lock:
            if self._live.get(request.request_id) is request:
                del self._live[request.request_id]

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while True:
            batch = self.pending()
            try:
                self.write(batch)
            except Exception as exc:  # never leave a request waiting on a writer that gave up
                log.exception("stream writer failed; failing the requests it was writing")
                for request, _ in batch:
                    self._fail(request, exc)

    def write(self, batch: list[tuple[Streamed, Any]]) -> None:
        """One round trip: each request's events of ``batch`` as one stream entry, every open request's
        cancel key read; then abort what was cancelled, expired or could not be written."""
        pending: dict[Streamed, list[Any]] = {}
        for request, event in batch:
            if not request.done.is_set():
                pending.setdefault(request, []).append(event)
        with self._lock:
            live = [r for r in self._live.values() if not r.done.is_set()]
        writes: list[tuple[Streamed, Event]] = []
        for request, events in pending.items():
            token_ids = [t for e in events for t in e.token_ids]
            text = "".join(e.text for e in events)
            request.completion_tokens += len(token_ids)
            logprobs = [lp for e in events for lp in e.logprobs or ()] or None
            if token_ids or text:
                writes.append(
                    (request, Event(kind="token", token_ids=token_ids, text=text, logprobs=logprobs))
                )
        pipe = self.client.pipeline(transaction=False)
        if writes:
            # Into the pipeline the script goes as a bare EVALSHA: redis-py's Script would make the pipeline
            # ask SCRIPT EXISTS first, one more round trip per step. A server without it answers NOSCRIPT.
            keys, args = append_args([(request.stream, [entry]) for request, entry in writes])
            pipe.evalsha(self._append.sha, len(keys), *keys, *args)
        if live:
            pipe.mget([cancel_key(r.request_id) for r in live])
        if writes or live:
            try:
                replies = pipe.execute(raise_on_error=False)
                if writes and isinstance(replies[0], NoScriptError):  # a restarted or flushed Redis
                    replies[0] = self._append(keys=keys, args=args)
            except RedisError as exc:
                for request, _ in writes:  # their tokens are not on the stream: they cannot go on
                    self._fail(request, exc)
                replies = []
            else:
                self.round_trips += 1
            if writes and replies:
                written = replies[0]
                for i, (request, _) in enumerate(writes):
                    try:
                        request.stream.check_written(
                            written if isinstance(written, Exception) else written[i]
                        )
                    except (LeaseLost, RedisError) as exc:
                        self._fail(request, exc)
                    else:
                        self.entries_written += 1
            cancels = replies[-1] if live and len(replies) == bool(writes) + 1 else None
            if cancels is not None and not isinstance(cancels, Exception):
                for request, cancelled in zip(live, cancels, strict=True):
                    if cancelled is not None:
                        self._stop(request)
        now = time.time()
        for request in live:
            if now >= request.deadline and not request.stopping:
                request.deadline_exceeded = True
                self._stop(request)
        for request, events in pending.items():
            final = next((e for e in events if e.finish_reason is not None), None)
            if final is not None and not request.done.is_set():
                request.final = final
                request.done.set()

    def _stop(self, request: Streamed) -> None:
        if not request.stopping:
            request.stopping = True
            self.abort(request.request_id)

    def _fail(self, request: Streamed, exc: BaseException) -> None:
        if request.error is None:
            request.error = exc
        self._stop(request)
        request.done.set()
