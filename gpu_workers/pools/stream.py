"""A request's Redis Stream and its lease: who may write to it, what it already holds.

One attempt at a time serves a request: the holder of ``lease_key(request_id)``. Every write checks the
lease and appends in one Lua script, so an attempt whose lease was taken over (its worker was declared
dead, the message was delivered twice) can never add a token after that, however late it wakes up.
Reading what a stream holds lets a redelivered task decide between skipping, failing and retrying.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from gpu_workers.protocol import HEARTBEAT_TTL_S, STREAM_FIELD, STREAM_TTL_S, Event, stream_key

STREAM_MAXLEN = 10_000  # events kept per stream (about a token each): a bound, never reached by a live reader
LEASE_TTL_MS = int(HEARTBEAT_TTL_S * 1000)  # the heartbeat renews the leases of a live worker
TERMINAL = ("final", "error")

# KEYS: lease, stream. ARGV: owner, maxlen, stream ttl, lease ttl ms, field, event JSON...
_PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
for i = 6, #ARGV do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', ARGV[5], ARGV[i])
end
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return #ARGV - 5
"""
# KEYS: lease. ARGV: owner. Delete only if still ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: lease. ARGV: new owner, previous owner, ttl ms. Take a free lease, or the previous owner's.
_TAKE_OVER = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[2] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
"""


class LeaseLost(RuntimeError):
    """Another attempt now owns the request; this one must stop without writing."""


def lease_key(request_id: str) -> str:
    return f"tessera:lease:{request_id}"


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
        self._publish = client.register_script(_PUBLISH)
        self._release = client.register_script(_RELEASE)
        self._take_over = client.register_script(_TAKE_OVER)

    def claim(self, previous_owner: str | None = None) -> bool:
        """Take the lease if it is free or held by ``previous_owner`` (a dead worker, or the prefill that
        handed this request to decode); False if another attempt holds it."""
        if previous_owner is None:
            return bool(self.client.set(self._lease, self.owner, nx=True, px=LEASE_TTL_MS))
        return bool(self._take_over(keys=[self._lease], args=[self.owner, previous_owner, LEASE_TTL_MS]))

    def release(self) -> None:
        self._release(keys=[self._lease], args=[self.owner])

    def state(self) -> StreamState:
        return read_state(self.client, self.request_id)

    def publish(self, *events: Event) -> None:
        """Append events in order; raises LeaseLost if this attempt no longer owns the request."""
        if not events:
            return
        for event in events:
            event.worker_id = self.owner
        args = [self.owner, STREAM_MAXLEN, STREAM_TTL_S, LEASE_TTL_MS, STREAM_FIELD]
        written = self._publish(
            keys=[self._lease, stream_key(self.request_id)], args=args + [e.to_json() for e in events]
        )
        if written < 0:
            raise LeaseLost(f"request {self.request_id} is now served by another attempt")
