"""A request's lifecycle between the planes: who serves it, what a worker has in flight, when it is lost.

One attempt at a time serves a request: the holder of its lease (``lease_key``), renewed every heartbeat by
the worker serving it. An attempt begins (stream state, lease, in-flight record, cancel key) and ends in one
script each, and every append to the request's stream checks the lease in the same script. A worker records
what it has begun in its in-flight hash (``inflight_key``), which a live peer takes over if it dies. The
gateway, watching a quiet stream, ``observe``s the request and ``judge``s whether anybody is left to serve
it. Torch-free: the workers and the gateway both import it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from gpu_workers.protocol import HEARTBEAT_TTL_S, POOLS, WorkerInfo, pool_queue, workers_key

LEASE_TTL_MS = int(HEARTBEAT_TTL_S * 1000)  # the heartbeat renews the leases of a live worker


def lease_key(request_id: str) -> str:
    """Redis string: the worker id of the one attempt serving the request. Its holder renews it every
    heartbeat, so it exists exactly while a live worker serves the request (or a heartbeat TTL after it died)."""
    return f"tessera:lease:{request_id}"


def inflight_key(worker_id: str) -> str:
    """Redis hash: request id -> {"task": task name, "payload": GenerateTask JSON}: the requests a worker
    has begun and not ended, which a peer finishes if the worker dies (``pools.inflight``)."""
    return f"tessera:inflight:{worker_id}"


# Appends for one request or for every request a worker streams in a step, in one script run. KEYS: lease
# and stream of each request, in pairs. ARGV: maxlen, stream ttl, lease ttl ms, field, then for each request
# its owner, its event count n and its n events (JSON). Returns per request n, or -1 where its lease is
# another's. (Keys of many requests in one script: one Redis server, as the platform runs it, not a
# hash-slotted cluster.)
APPEND = """
local appended, a = {}, 5
for i = 1, #KEYS / 2 do
  local lease, stream, owner, n = KEYS[2 * i - 1], KEYS[2 * i], ARGV[a], tonumber(ARGV[a + 1])
  if redis.call('GET', lease) ~= owner then
    appended[i] = -1
  else
    for j = 1, n do
      redis.call('XADD', stream, 'MAXLEN', '~', ARGV[1], '*', ARGV[4], ARGV[a + 1 + j])
    end
    redis.call('EXPIRE', stream, ARGV[2])
    redis.call('PEXPIRE', lease, ARGV[3])
    appended[i] = n
  end
  a = a + 2 + n
end
return appended
"""
# KEYS: lease. ARGV: owner. Delete only if still ours.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# An attempt's start in one round trip. KEYS: stream, lease, the worker's in-flight hash, cancel key. ARGV: owner,
# lease ttl ms, handed over (1: the attempt continues a stream that another worker began and handed on, as
# decode continues prefill's: it may find that worker's one event and take that worker's lease), in-flight
# field and value, in-flight ttl s. Returns {status, events, cancelled}: 'finished' (the stream
# ended: nothing taken), 'busy' (another attempt holds the lease), 'cut' (the lease is ours, but the stream
# holds more than an attempt may find: a dead worker's partial output), 'claimed' (the lease is ours and the
# request recorded in flight).
BEGIN = """
local n = redis.call('XLEN', KEYS[1])
local last = nil
if n > 0 then
  last = cjson.decode(redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1][2][2])
  if last.kind == 'final' or last.kind == 'error' then return {'finished', n, 0} end
end
local handed_over = ARGV[3] == '1'
local previous = false
if handed_over and n == 1 and type(last.worker_id) == 'string' and last.worker_id ~= '' then
  previous = last.worker_id
end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= previous then return {'busy', n, 0} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
if n > (handed_over and 1 or 0) then return {'cut', n, 0} end
redis.call('HSET', KEYS[3], ARGV[4], ARGV[5])
redis.call('EXPIRE', KEYS[3], ARGV[6])
return {'claimed', n, redis.call('EXISTS', KEYS[4])}
"""
# An attempt's end: KEYS: lease, in-flight hash. ARGV: owner, in-flight field. Drop the in-flight record; delete
# the lease only if still ours.
END = """
redis.call('HDEL', KEYS[2], ARGV[2])
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: lease. ARGV: new owner, previous owner, ttl ms. Take a free lease, or the previous owner's.
TAKE_OVER = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[2] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
"""
# KEYS: the leases of the requests a worker tracks, then its in-flight hash. ARGV: the worker's id, lease ttl ms,
# hash ttl s. Extends only the leases the worker still holds: one another attempt took over (this worker was
# declared dead and its request recovered) is that attempt's to keep alive, and must lapse when it dies.
RENEW = """
for i = 1, #KEYS - 1 do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
end
redis.call('EXPIRE', KEYS[#KEYS], ARGV[3])
return 0
"""


def live(age_s: float | None, ttl_s: float) -> bool:
    """Whether a worker whose last heartbeat is ``age_s`` old (None: it has none) is live."""
    return age_s is not None and age_s <= ttl_s


def heartbeat_age(raw: bytes | None, now: float) -> float | None:
    """How old a heartbeat entry (``WorkerInfo`` JSON) is; None for none, or a malformed one."""
    if raw is None:
        return None
    try:
        return now - WorkerInfo.from_json(raw).last_seen
    except (ValueError, TypeError):
        return None


def live_workers(entries: Iterable[bytes], ttl_s: float, now: float) -> list[WorkerInfo]:
    """The live workers among a pool's heartbeat entries (``workers_key``); a malformed one is as good as none."""
    return [WorkerInfo.from_json(raw) for raw in entries if live(heartbeat_age(raw, now), ttl_s)]


def quiet_check_due(idle_s: float, since_check_s: float, ttl_s: float) -> bool:
    """Whether to look for a lost worker now: the stream idle over a heartbeat TTL, and a quarter TTL since
    the last look (each look costs a round trip; a queue of quiet requests would repeat them per read)."""
    return idle_s > ttl_s and since_check_s >= ttl_s / 4


@dataclass(frozen=True)
class Routed:
    """One worker the request was routed to, as observed."""

    pool: str
    worker_id: str
    heartbeat_age_s: float | None  # since its last heartbeat (None: not in its pool)
    pool_heartbeat_age_s: float | None  # the youngest heartbeat of its pool (None: the pool is empty)
    in_flight: bool  # its in-flight hash records the request (begun and not ended)
    pool_queued: int  # tasks waiting in its pool's shared queue


@dataclass(frozen=True)
class Observed:
    """What the gateway sees of a request whose stream is quiet."""

    idle_s: float  # since the stream's last entry (or since the request was queued)
    lease_holder: str | None  # the attempt holding the lease now
    routed: tuple[Routed, ...] = ()
    streamed: bool = False  # the stream holds entries (a prefill worker may have ended its part)
    last_holder: str | None = None  # the last attempt seen holding the lease or writing the stream
    last_holder_in_flight: bool = False
    last_holder_heartbeat_age_s: float | None = None  # its youngest heartbeat in any pool


class Verdict(enum.Enum):
    ALIVE = "alive"  # served, or waiting where a live worker will take it up
    SUSPECT = "suspect"  # nobody visibly on it: lost if it stays so for a further TTL
    LOST = "lost"  # nobody is left to serve it


def judge(seen: Observed, ttl_s: float, suspect_for_s: float | None = None) -> Verdict:
    """Whether anybody is left to serve the request (``suspect_for_s``: how long it has been SUSPECT before).

    ALIVE while its stream has been idle at most a TTL, or an attempt holds its lease (the worker serving it
    renews that every heartbeat, also while it drains out of its pool in a reload, and it lapses a TTL after
    that worker dies). A prefill worker that streamed its token and ended its part (no longer recording the
    request in flight) is not watched. Without a lease, LOST at once when a worker it was routed to is not live
    and that pool has no live worker either. SUSPECT, and LOST once a further TTL passes so: a routed worker
    gone while its pool has live peers and an empty pool queue (a dead worker's peers re-queue or fail what it
    left, a departing one hands its queue to its pool, where a busy peer may take a while), or the last attempt
    seen holding the lease or writing the stream, when no router chose it (a peer took the request up), is live
    in no pool and still records the request in flight (it died, maybe after leaving its pool, where no peer
    recovers it)."""
    if seen.idle_s <= ttl_s or seen.lease_holder is not None:
        return Verdict.ALIVE
    suspect = False
    for worker in seen.routed:
        if live(worker.heartbeat_age_s, ttl_s):
            continue
        if worker.pool == "prefill" and seen.streamed and not worker.in_flight:
            continue  # it streamed its token and ended its part: decode goes on without it
        if not live(worker.pool_heartbeat_age_s, ttl_s):
            return Verdict.LOST
        if worker.pool_queued:
            continue  # handed to the pool's queue, it may wait there for a busy peer
        suspect = True
        break
    routed_ids = {worker.worker_id for worker in seen.routed}
    if not suspect and seen.last_holder is not None and seen.last_holder not in routed_ids:
        suspect = seen.last_holder_in_flight and not live(seen.last_holder_heartbeat_age_s, ttl_s)
    if not suspect:
        return Verdict.ALIVE
    if suspect_for_s is not None and suspect_for_s > ttl_s:
        return Verdict.LOST
    return Verdict.SUSPECT


async def observe(
    redis: aioredis.Redis,
    request_id: str,
    deployment: str,
    routed: tuple[tuple[str, str], ...],
    *,
    idle_s: float,
    streamed: bool,
    last_holder: str | None,
    now: float,
) -> Observed:
    """What ``judge`` needs of a request routed to ``routed`` ((pool, worker id) pairs), read in one round
    trip: its lease, the heartbeats of its routed pools (of every pool when another attempt was seen on it),
    the in-flight records of its routed workers and last holder, its routed pools' queue lengths."""
    other_holder = last_holder is not None and last_holder not in {w for _, w in routed}
    pools = list(POOLS) if other_holder else list(dict.fromkeys(pool for pool, _ in routed))
    asked = [worker for _, worker in routed] + ([last_holder] if other_holder else [])
    async with redis.pipeline(transaction=False) as pipe:
        pipe.get(lease_key(request_id))
        for pool in pools:
            pipe.hgetall(workers_key(deployment, pool))
        for worker in asked:
            pipe.hexists(inflight_key(worker), request_id)
        for pool, _ in routed:
            pipe.llen(pool_queue(deployment, pool))
        replies = await pipe.execute()
    holder, replies = replies[0], replies[1:]
    beats = dict(zip(pools, replies[: len(pools)], strict=True))
    in_flight = dict(zip(asked, replies[len(pools) : len(pools) + len(asked)], strict=True))
    queued = replies[len(pools) + len(asked) :]

    def age(pool: str, worker_id: str) -> float | None:
        return heartbeat_age(beats[pool].get(worker_id.encode()), now)

    def youngest(pool: str) -> float | None:
        ages = (heartbeat_age(raw, now) for raw in beats[pool].values())
        return min((a for a in ages if a is not None), default=None)

    seen_routed = tuple(
        Routed(pool, worker, age(pool, worker), youngest(pool), bool(in_flight[worker]), int(depth))
        for (pool, worker), depth in zip(routed, queued, strict=True)
    )
    holder_ages = [age(pool, last_holder) for pool in pools] if other_holder else []
    return Observed(
        idle_s=idle_s,
        lease_holder=holder.decode() if holder is not None else None,
        routed=seen_routed,
        streamed=streamed,
        last_holder=last_holder,
        last_holder_in_flight=bool(in_flight.get(last_holder)) if other_holder else False,
        last_holder_heartbeat_age_s=min((a for a in holder_ages if a is not None), default=None),
    )
