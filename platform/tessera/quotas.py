"""Per-tenant (and per-key) quotas enforced atomically in Redis: one Lua script checks every limit of every
scope and only then takes from all of them, so concurrent requests and API replicas can never overspend.

Limits, each optional (None = unlimited):
- ``rpm``: requests admitted in any sliding 60 s window (a log of admission times, not a fixed window);
- ``tpm``: tokens reserved in any sliding 60 s window (``prompt_tokens + max_tokens`` at admission,
  settled to the actual usage when the request ends);
- ``concurrency``: requests in flight, held as leases that expire unless renewed, so a gateway that dies
  mid-request cannot leak a slot;
- ``daily_tokens`` / ``monthly_tokens``: token budgets per UTC day / month, reserved and settled like tpm;
- ``monthly_spend``: a spend budget per UTC month in integer micro-USD. Admission reserves the request's most
  expensive outcome (every prompt token at the fresh price, ``max_tokens`` at the output price); the end
  settles it to the request's priced cost (cached tokens at the cached price), or to nothing when it failed
  before producing a token. A counter Redis lost restarts from the month's spend in the ledger.

A request rejected by one limit consumes none of the others, with one exception: the gateway counts an
attempt against ``rpm`` (``Quotas.attempt``) before it reads and tokenises the body, and a request refused after
that (a prompt over the context, a tpm limit) keeps its place in the rpm window, so refused requests cannot
make the gateway work without bound. Time comes from Redis (``TIME``), so every replica agrees on the window. Redis unreachable raises ``QuotaUnavailable``: the gateway fails closed.
"""

from __future__ import annotations

import asyncio
import calendar
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from tessera.limits import BUDGETS, LIMITS, Decision, Scope, Window

log = logging.getLogger(__name__)

WINDOW_MS = 60_000
LEASE_TTL_MS = 30_000  # a lease not renewed for this long is dropped (its gateway died)
_UNLIMITED = -1
SETTLE_TIMEOUT_S = 5.0


class QuotaUnavailable(Exception):
    """Redis could not be reached: no request is admitted without its quota being checked."""


_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid, tokens = ARGV[1], tonumber(ARGV[2])
local window, lease_ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local day_ttl, month_ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local cost = tonumber(ARGV[7])
local count_rpm = ARGV[8] == '1'
local nscopes = #KEYS / 7

local function expire_tokens(log, amounts)
  local old = redis.call('ZRANGEBYSCORE', log, '-inf', now - window)
  for _, member in ipairs(old) do
    local n = tonumber(redis.call('HGET', amounts, member) or '0')
    if n ~= 0 then redis.call('HINCRBY', amounts, '__total', -n) end  -- Lua's -0 is not an integer to Redis
    redis.call('HDEL', amounts, member)
  end
  if #old > 0 then redis.call('ZREMRANGEBYSCORE', log, '-inf', now - window) end
end

local function reset_ms(log)
  local first = redis.call('ZRANGE', log, 0, 0, 'WITHSCORES')
  if #first == 0 then return 0 end
  return math.max(tonumber(first[2]) + window - now, 0)
end

local state = {}
local fail_scope, fail_limit, retry = 0, 0, 0
for s = 1, nscopes do
  local k = (s - 1) * 7
  local rpm_log, tpm_log, amounts, leases = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local day, month, spend = KEYS[k + 5], KEYS[k + 6], KEYS[k + 7]
  local a = 8 + (s - 1) * 7
  local rpm, tpm, conc = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local daily, monthly, spend_cap = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  if spend_cap >= 0 then
    redis.call('SET', spend, ARGV[a + 7], 'NX', 'EX', month_ttl + 3600)
  end
  redis.call('ZREMRANGEBYSCORE', rpm_log, '-inf', now - window)
  expire_tokens(tpm_log, amounts)
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
  local rpm_used = redis.call('ZCARD', rpm_log)
  local tpm_used = tonumber(redis.call('HGET', amounts, '__total') or '0')
  state[s] = {rpm_used, reset_ms(rpm_log), tpm_used, reset_ms(tpm_log)}
  if fail_scope == 0 then
    if count_rpm and rpm >= 0 and rpm_used + 1 > rpm then
      fail_scope, fail_limit, retry = s, 1, math.max(state[s][2], 1)
    elseif tpm >= 0 and tpm_used + tokens > tpm then
      fail_scope, fail_limit = s, 2
      -- tokens free up as old reservations leave the window; one too large for the limit never fits
      retry = tokens > tpm and window or math.max(state[s][4], 1)
    elseif conc >= 0 and redis.call('ZCARD', leases) + 1 > conc then
      fail_scope, fail_limit, retry = s, 3, 1000  -- a slot frees when any request ends
    elseif daily >= 0 and tonumber(redis.call('GET', day) or '0') + tokens > daily then
      fail_scope, fail_limit, retry = s, 4, day_ttl * 1000
    elseif monthly >= 0 and tonumber(redis.call('GET', month) or '0') + tokens > monthly then
      fail_scope, fail_limit, retry = s, 5, month_ttl * 1000
    elseif spend_cap >= 0 and tonumber(redis.call('GET', spend) or '0') + cost > spend_cap then
      fail_scope, fail_limit, retry = s, 6, month_ttl * 1000
    end
  end
end

local out = {fail_scope == 0 and 1 or 0, fail_scope, fail_limit, retry}
for s = 1, nscopes do
  local k = (s - 1) * 7
  if fail_scope == 0 then
    if count_rpm then
      redis.call('ZADD', KEYS[k + 1], now, rid)
      redis.call('PEXPIRE', KEYS[k + 1], window)
      state[s][1] = state[s][1] + 1
      if state[s][2] == 0 then state[s][2] = window end
    end
    redis.call('ZADD', KEYS[k + 2], now, rid)
    redis.call('HSET', KEYS[k + 3], rid, tokens)
    redis.call('HINCRBY', KEYS[k + 3], '__total', tokens)
    redis.call('PEXPIRE', KEYS[k + 2], window)
    redis.call('PEXPIRE', KEYS[k + 3], window)
    redis.call('ZADD', KEYS[k + 4], now + lease_ttl, rid)
    redis.call('PEXPIRE', KEYS[k + 4], lease_ttl)
    redis.call('INCRBY', KEYS[k + 5], tokens)
    redis.call('EXPIRE', KEYS[k + 5], day_ttl + 3600)
    redis.call('INCRBY', KEYS[k + 6], tokens)
    redis.call('EXPIRE', KEYS[k + 6], month_ttl + 3600)
    redis.call('INCRBY', KEYS[k + 7], cost)
    redis.call('EXPIRE', KEYS[k + 7], month_ttl + 3600)
    state[s][3] = state[s][3] + tokens
    if state[s][4] == 0 then state[s][4] = window end
  end
  for _, v in ipairs(state[s]) do table.insert(out, v) end
end
return out
"""

# KEYS: the rpm log of each scope. ARGV: request id, window ms, then each scope's rpm limit.
# Returns {admitted, failing scope index (0 = none), retry ms, per scope: rpm used, rpm reset ms}.
_ATTEMPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid, window = ARGV[1], tonumber(ARGV[2])
local state, fail, retry = {}, 0, 0
for s, log in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', log, '-inf', now - window)
  local used, reset = redis.call('ZCARD', log), 0
  local first = redis.call('ZRANGE', log, 0, 0, 'WITHSCORES')
  if #first > 0 then reset = math.max(tonumber(first[2]) + window - now, 0) end
  state[s] = {used, reset}
  local limit = tonumber(ARGV[2 + s])
  if fail == 0 and limit >= 0 and used + 1 > limit then fail, retry = s, math.max(reset, 1) end
end
local out = {fail == 0 and 1 or 0, fail, retry}
for s, log in ipairs(KEYS) do
  if fail == 0 then
    redis.call('ZADD', log, now, rid)
    redis.call('PEXPIRE', log, window)
    state[s][1] = state[s][1] + 1
    if state[s][2] == 0 then state[s][2] = window end
  end
  table.insert(out, state[s][1])
  table.insert(out, state[s][2])
end
return out
"""

# KEYS per scope (5 each): tpm amounts, leases, day counter, month counter, month spend.
# ARGV: request id, tokens to give back (reserved - actual, may be negative), release lease (1/0),
# micro-USD to give back (reserved - actual cost, may be negative).
_SETTLE = """
local rid, delta, release = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local cost_delta = tonumber(ARGV[4])
for s = 1, #KEYS / 5 do
  local k = (s - 1) * 5
  local amounts = KEYS[k + 1]
  local held = redis.call('HGET', amounts, rid)
  if held then  -- still inside the tpm window: correct the reservation there too
    local n = math.max(tonumber(held) - delta, 0)
    redis.call('HSET', amounts, rid, n)
    redis.call('HINCRBY', amounts, '__total', n - tonumber(held))
  end
  if delta ~= 0 then
    for _, counter in ipairs({KEYS[k + 3], KEYS[k + 4]}) do
      if redis.call('EXISTS', counter) == 1 then
        redis.call('INCRBY', counter, -delta)
      end
    end
  end
  if cost_delta ~= 0 and redis.call('EXISTS', KEYS[k + 5]) == 1 then
    redis.call('INCRBY', KEYS[k + 5], -cost_delta)
  end
  if release then redis.call('ZREM', KEYS[k + 2], rid) end
end
return 1
"""

# KEYS: the leases of each scope. ARGV: request id, lease ttl ms.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, leases in ipairs(KEYS) do
  redis.call('ZADD', leases, 'XX', now + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', leases, tonumber(ARGV[2]))
end
return 1
"""


def _period_keys(scope: Scope, now: datetime) -> tuple[str, str, str]:
    """The scope's counters for ``now``'s UTC day and month: tokens per day, tokens per month, spend per month."""
    return (
        scope.key(f"day:{now:%Y-%m-%d}"),
        scope.key(f"month:{now:%Y-%m}"),
        scope.key(f"spend:{now:%Y-%m}"),
    )


def _period_ends(now: datetime) -> tuple[datetime, datetime]:
    """The ends of ``now``'s UTC day and month: when a daily and a monthly budget reset."""
    day_end = datetime(now.year, now.month, now.day, tzinfo=timezone.utc) + timedelta(days=1)
    last = calendar.monthrange(now.year, now.month)[1]
    month_end = datetime(now.year, now.month, last, tzinfo=timezone.utc) + timedelta(days=1)
    return day_end, month_end


def _period_ttls(now: datetime) -> tuple[int, int]:
    """Seconds until the end of the UTC day and month: when a budget resets."""
    day_end, month_end = _period_ends(now)
    ts = now.timestamp()
    return max(int(day_end.timestamp() - ts), 1), max(int(month_end.timestamp() - ts), 1)


@dataclass(frozen=True)
class Reservation:
    """What an admitted request holds, to settle when it ends."""

    request_id: str
    scopes: tuple[Scope, ...]
    tokens: int
    day: datetime
    cost: int = 0  # micro-USD reserved against spend budgets


class Quotas:
    """Admission, lease renewal and settlement against one Redis (shared by every API replica)."""

    def __init__(self, redis: Redis, lease_ttl_ms: int = LEASE_TTL_MS, window_ms: int = WINDOW_MS):
        self.redis = redis
        self.lease_ttl_ms = lease_ttl_ms
        self.window_ms = window_ms
        self._admit = redis.register_script(_ADMIT)
        self._attempt = redis.register_script(_ATTEMPT)
        self._settle = redis.register_script(_SETTLE)
        self._renew = redis.register_script(_RENEW)

    async def attempt(self, request_id: str, scopes: list[Scope]) -> Decision:
        """Count a request against the ``rpm`` of every scope that sets one, before anything costly is done for
        it; refused (nothing counted) if any scope's window is full. Whatever happens to the request after an
        admitted attempt, it keeps its place in the window; ``admit(..., rpm_counted=True)`` then checks the
        other limits only."""
        scopes = [s for s in scopes if s.limits.rpm is not None]
        if not scopes:
            return Decision(admitted=True)
        args: list[int | str] = [request_id, self.window_ms, *(s.limits.rpm for s in scopes)]
        try:
            out = [int(x) for x in await self._attempt(keys=[s.key("rpm") for s in scopes], args=args)]
        except RedisError as exc:
            raise QuotaUnavailable(f"quota store unreachable: {exc}") from exc
        admitted, fail, retry_ms = out[:3]
        state = [v for pair in zip(out[3::2], out[4::2], strict=True) for v in (*pair, 0, 0)]
        return Decision(
            admitted=bool(admitted),
            limit=None if admitted else "rpm",
            scope=scopes[fail - 1].name if fail else None,
            retry_after_ms=retry_ms,
            requests=_tightest(scopes, state, "rpm", 0),
            limit_value=scopes[fail - 1].limits.rpm if fail else None,
        )

    async def admit(
        self, request_id: str, scopes: list[Scope], tokens: int, cost: int = 0, rpm_counted: bool = False
    ) -> tuple[Decision, Reservation | None]:
        """Check every limit of every scope, and take from all of them only if all allow the request.
        ``tokens`` (prompt + max_tokens) and ``cost`` (its most expensive outcome, micro-USD) are reserved.
        ``rpm_counted``: ``attempt`` counted the request against rpm already, so rpm is neither checked nor
        taken again."""
        scopes = [s for s in scopes if not s.limits.unlimited]
        now = datetime.now(timezone.utc)
        if not scopes:
            return Decision(admitted=True), Reservation(request_id, (), tokens, now, cost)
        day_ttl, month_ttl = _period_ttls(now)
        keys: list[str] = []
        args: list[int | str] = [
            request_id,
            tokens,
            self.window_ms,
            self.lease_ttl_ms,
            day_ttl,
            month_ttl,
            cost,
            0 if rpm_counted else 1,
        ]
        for scope in scopes:
            day, month, spend = _period_keys(scope, now)
            keys += [
                scope.key("rpm"),
                scope.key("tpm"),
                scope.key("tpm:amounts"),
                scope.key("leases"),
                day,
                month,
                spend,
            ]
        for scope in scopes:
            args += [
                _UNLIMITED if getattr(scope.limits, n) is None else getattr(scope.limits, n) for n in LIMITS
            ]
            args.append(scope.month_spent)
        try:
            out = [int(x) for x in await self._admit(keys=keys, args=args)]
        except RedisError as exc:
            raise QuotaUnavailable(f"quota store unreachable: {exc}") from exc
        admitted, fail_scope, fail_limit, retry_ms = out[:4]
        limit = LIMITS[fail_limit - 1] if fail_limit else None
        decision = Decision(
            admitted=bool(admitted),
            limit=limit,
            scope=scopes[fail_scope - 1].name if fail_scope else None,
            retry_after_ms=retry_ms,
            requests=_tightest(scopes, out[4:], "rpm", 0),
            tokens=_tightest(scopes, out[4:], "tpm", 2),
            limit_value=getattr(scopes[fail_scope - 1].limits, LIMITS[fail_limit - 1])
            if fail_scope
            else None,
            resets_at=_period_ends(now)[0 if limit == "daily_tokens" else 1] if limit in BUDGETS else None,
        )
        return decision, (Reservation(request_id, tuple(scopes), tokens, now, cost) if admitted else None)

    async def renew(self, reservation: Reservation) -> None:
        """Extend the request's concurrency leases; call while it streams (well within the lease TTL)."""
        if not reservation.scopes:
            return
        try:
            await self._renew(
                keys=[s.key("leases") for s in reservation.scopes],
                args=[reservation.request_id, self.lease_ttl_ms],
            )
        except RedisError as exc:
            raise QuotaUnavailable(f"quota store unreachable: {exc}") from exc

    async def settle(self, reservation: Reservation, used_tokens: int, used_cost: int = 0) -> None:
        """The request ended having used ``used_tokens`` and cost ``used_cost`` micro-USD: give back the rest of
        the reservation everywhere it still counts and release its concurrency lease. Zeros release it in
        full (a request that failed before producing a token)."""
        if not reservation.scopes:
            return
        keys: list[str] = []
        for scope in reservation.scopes:
            day, month, spend = _period_keys(scope, reservation.day)
            keys += [scope.key("tpm:amounts"), scope.key("leases"), day, month, spend]
        delta = reservation.tokens - max(used_tokens, 0)
        cost_delta = reservation.cost - max(used_cost, 0)
        try:
            await self._settle(keys=keys, args=[reservation.request_id, delta, 1, cost_delta])
        except RedisError as exc:
            raise QuotaUnavailable(f"quota store unreachable: {exc}") from exc

    async def in_flight(self, scope: Scope) -> int:
        """Live concurrency leases of ``scope`` (expired ones do not count)."""
        t = await self.redis.time()
        now_ms = t[0] * 1000 + t[1] // 1000
        return await self.redis.zcount(scope.key("leases"), now_ms, "+inf")

    async def spent(self, scope: Scope, when: datetime | None = None) -> int:
        """Micro-USD ``scope`` has spent or holds reserved in ``when``'s UTC month (default: now)."""
        _, _, spend = _period_keys(scope, when or datetime.now(timezone.utc))
        return int(await self.redis.get(spend) or 0)


class Held:
    """An admitted request's reservation while it runs: its leases renewed every third of their TTL, and
    settled exactly once however the request ends (``settle`` is idempotent and survives cancellation)."""

    def __init__(self, quotas: Quotas, reservation: Reservation):
        self.quotas = quotas
        self.reservation = reservation
        self.used_tokens = 0  # set as the request learns its usage; what ``settle`` charges
        self.used_cost = 0  # micro-USD, likewise
        self.settled = False
        self._renewer = asyncio.create_task(self._renew()) if reservation.scopes else None

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.quotas.lease_ttl_ms / 3000)
            try:
                await self.quotas.renew(self.reservation)
            except QuotaUnavailable as e:  # the next renewal may get through before the lease expires
                log.warning("could not renew the lease of request %s: %s", self.reservation.request_id, e)

    async def guard(self, chunks: AsyncIterator[str]) -> AsyncGenerator[str, None]:
        """``chunks``, then ``settle``: a streamed request's reservation ends with its stream, however it ends."""
        try:
            async with aclosing(chunks):  # closed first, so the stream's own end has set ``used_tokens``
                async for chunk in chunks:
                    yield chunk
        finally:
            await self.settle()

    async def close(self, stream: AsyncGenerator[str, None]) -> None:
        """Close ``guard``'s stream and settle: after the response, for a stream cut off mid-chunk or never
        started (a client that hung up at once), whose own ``finally`` has not run."""
        await stream.aclose()
        await self.settle()

    async def settle(self) -> None:
        if self.settled:
            return
        self.settled = True
        if self._renewer is not None:
            self._renewer.cancel()
        # Shielded: a client disconnect cancels the caller, and the slot must be released all the same.
        with anyio.CancelScope(shield=True), anyio.move_on_after(SETTLE_TIMEOUT_S):
            try:
                await self.quotas.settle(self.reservation, self.used_tokens, self.used_cost)
            except QuotaUnavailable as e:
                log.error(
                    "could not settle request %s (%s): its lease expires by itself within %d ms",
                    self.reservation.request_id,
                    e,
                    self.quotas.lease_ttl_ms,
                )


def _tightest(scopes: list[Scope], state: list[int], limit: str, offset: int) -> Window | None:
    """The window with the least room left among the scopes that set ``limit``."""
    best: Window | None = None
    for i, scope in enumerate(scopes):
        value = getattr(scope.limits, limit)
        if value is None:
            continue
        used, reset = state[i * 4 + offset], state[i * 4 + offset + 1]
        window = Window(limit=value, remaining=value - used, reset_ms=reset)
        if best is None or window.remaining < best.remaining:
            best = window
    return best
