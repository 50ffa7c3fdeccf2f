"""Quotas against a real Redis: exact under concurrency and across processes, nothing taken on rejection,
reservations settled to actual usage, leases that cannot leak, fail closed when Redis is gone."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import uuid

import pytest
from redis.asyncio import BlockingConnectionPool, Redis
from tessera.limits import Decision, Limits, Scope, Window, duration
from tessera.quotas import Quotas, QuotaUnavailable

REDIS_URL = "redis://127.0.0.1:6379/0"


def scope(**limits) -> Scope:
    return Scope(f"test:{uuid.uuid4().hex}", Limits(**limits))


def run(coro):
    return asyncio.run(coro)


def connect() -> Redis:
    # Hundreds of concurrent calls share a bounded pool, as the gateway's do.
    return Redis(connection_pool=BlockingConnectionPool.from_url(REDIS_URL, max_connections=32, timeout=10))


async def _admit_many(sc: Scope | list[Scope], n: int, tokens: int = 1, **kw) -> list[Decision]:
    async with connect() as redis:
        quotas = Quotas(redis, **kw)
        scopes = sc if isinstance(sc, list) else [sc]
        results = await asyncio.gather(*(quotas.admit(uuid.uuid4().hex, scopes, tokens) for _ in range(n)))
        return [d for d, _ in results]


def test_rpm_admits_exactly_the_limit_under_200_concurrent_requests():
    decisions = run(_admit_many(scope(rpm=50), 200))
    assert sum(d.admitted for d in decisions) == 50
    rejected = [d for d in decisions if not d.admitted]
    assert {d.limit for d in rejected} == {"rpm"}
    assert all(d.retry_after_ms > 0 and int(d.headers()["retry-after"]) >= 1 for d in rejected)


def _admit_in_process(name: str, n: int, out) -> None:
    sc = Scope(name, Limits(rpm=50))
    out.put(sum(d.admitted for d in run(_admit_many(sc, n))))


def test_rpm_holds_across_two_processes_sharing_redis():
    name = f"test:{uuid.uuid4().hex}"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_admit_in_process, args=(name, 100, out)) for _ in range(2)]
    for p in procs:
        p.start()
    counts = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sum(counts) == 50


def test_tpm_never_admits_more_tokens_than_the_limit():
    async def go():
        sc = scope(tpm=1000)
        async with connect() as redis:
            quotas = Quotas(redis)
            sizes = [37 + (i * 53) % 120 for i in range(100)]
            results = await asyncio.gather(*(quotas.admit(uuid.uuid4().hex, [sc], n) for n in sizes))
            admitted = [n for n, (d, _) in zip(sizes, results, strict=True) if d.admitted]
            return sizes, admitted, results

    sizes, admitted, results = run(go())
    assert sum(admitted) <= 1000
    assert sum(admitted) > 1000 - max(sizes)  # it fills the window: a rejection means the next would not fit
    assert all(d.limit == "tpm" for d, _ in results if not d.admitted)


def test_a_request_larger_than_tpm_is_rejected_and_waits_a_whole_window():
    (decision,) = run(_admit_many(scope(tpm=100), 1, tokens=101))
    assert not decision.admitted and decision.limit == "tpm"
    assert decision.retry_after_ms == 60_000


def test_concurrency_never_exceeds_the_limit_and_releases_every_slot():
    async def go():
        sc = scope(concurrency=4)
        in_flight, peak = 0, 0
        admitted = 0
        async with connect() as redis:
            quotas = Quotas(redis)

            async def one():
                nonlocal in_flight, peak, admitted
                while True:
                    decision, reservation = await quotas.admit(uuid.uuid4().hex, [sc], 1)
                    if decision.admitted:
                        break
                    assert decision.limit == "concurrency"
                    await asyncio.sleep(0.005)
                in_flight += 1
                admitted += 1
                peak = max(peak, in_flight, await quotas.in_flight(sc))
                await asyncio.sleep(0.01)
                in_flight -= 1
                await quotas.settle(reservation, 1)

            await asyncio.gather(*(one() for _ in range(40)))
            return peak, admitted, await quotas.in_flight(sc)

    peak, admitted, left = run(go())
    assert admitted == 40
    assert peak == 4
    assert left == 0


def test_a_lease_that_is_never_settled_expires_and_frees_its_slot():
    async def go():
        sc = scope(concurrency=1)
        async with connect() as redis:
            quotas = Quotas(redis, lease_ttl_ms=300)
            first, _ = await quotas.admit("a", [sc], 1)  # its gateway "dies": never settled
            blocked, _ = await quotas.admit("b", [sc], 1)
            await asyncio.sleep(0.4)
            after, _ = await quotas.admit("c", [sc], 1)
            return first, blocked, after

    first, blocked, after = run(go())
    assert first.admitted and not blocked.admitted and after.admitted


def test_renewing_a_lease_keeps_the_slot_past_its_ttl():
    async def go():
        sc = scope(concurrency=1)
        async with connect() as redis:
            quotas = Quotas(redis, lease_ttl_ms=300)
            _, reservation = await quotas.admit("a", [sc], 1)
            for _ in range(4):
                await asyncio.sleep(0.15)
                await quotas.renew(reservation)
            blocked, _ = await quotas.admit("b", [sc], 1)
            return blocked

    assert not run(go()).admitted


def test_a_rejection_by_one_limit_consumes_none_of_the_others():
    async def go():
        tenant, key = scope(rpm=10, concurrency=5, daily_tokens=10_000), scope(tpm=100)
        async with connect() as redis:
            quotas = Quotas(redis)
            rejected, _ = await quotas.admit("big", [tenant, key], 500)
            ok, _ = await quotas.admit("small", [tenant, key], 10)
            return rejected, ok, await quotas.in_flight(tenant), await redis.keys(f"*{tenant.name}*day*")

    rejected, ok, in_flight, _ = run(go())
    assert not rejected.admitted and rejected.limit == "tpm"
    assert ok.admitted
    assert ok.requests == Window(limit=10, remaining=9, reset_ms=ok.requests.reset_ms)  # only "small" counted
    assert in_flight == 1


def test_settling_gives_back_the_unused_reservation():
    async def go():
        sc = scope(tpm=1000, daily_tokens=1000)
        async with connect() as redis:
            quotas = Quotas(redis)
            _, reservation = await quotas.admit("a", [sc], 900)  # prompt + max_tokens
            before, _ = await quotas.admit("b", [sc], 200)
            await quotas.settle(reservation, 150)  # what it really used
            after, _ = await quotas.admit("c", [sc], 200)
            return before, after

    before, after = run(go())
    assert not before.admitted
    assert after.admitted
    assert after.tokens.remaining == 1000 - 150 - 200


def test_a_request_that_fails_before_any_token_releases_its_whole_reservation():
    async def go():
        sc = scope(daily_tokens=100)
        async with connect() as redis:
            quotas = Quotas(redis)
            _, reservation = await quotas.admit("a", [sc], 100)
            await quotas.settle(reservation, 0)
            again, _ = await quotas.admit("b", [sc], 100)
            return again

    assert run(go()).admitted


def test_a_request_settled_to_nothing_leaves_the_window_without_breaking_admission():
    # Settled to 0 tokens, it leaves the tpm window while others keep the window's keys alive: the admission
    # that expires it takes 0 off the window's total (once Lua's -0, which Redis refuses as "not an integer":
    # every later admission of the scope failed, a 503 for its tenant).
    async def go():
        sc = scope(tpm=100_000)
        async with connect() as redis:
            quotas = Quotas(redis, window_ms=500)
            _, reservation = await quotas.admit("a", [sc], 100)
            await quotas.settle(reservation, 0)
            start = time.monotonic()
            decisions = []
            while time.monotonic() - start < 0.8:  # admissions every 50 ms, so the keys never expire
                decisions.append((await quotas.admit(uuid.uuid4().hex, [sc], 100))[0])
                await asyncio.sleep(0.05)
            amounts = sc.key("tpm:amounts")
            return decisions, await redis.exists(amounts), await redis.hexists(amounts, "a")

    decisions, window_alive, a_still_there = run(go())
    assert all(d.admitted for d in decisions)
    assert window_alive and not a_still_there  # "a" left the window through an admission


def test_concurrent_requests_never_overspend_a_daily_budget():
    decisions = run(_admit_many(scope(daily_tokens=1000), 100, tokens=30))
    assert sum(d.admitted for d in decisions) == 33
    assert {d.limit for d in decisions if not d.admitted} == {"daily_tokens"}


def test_the_window_slides_instead_of_resetting_at_a_boundary():
    async def go():
        sc = scope(rpm=5)
        async with connect() as redis:
            quotas = Quotas(redis, window_ms=4000)  # wide: a loaded machine's late wake-ups still fit
            first = [
                d
                for d, _ in await asyncio.gather(*(quotas.admit(uuid.uuid4().hex, [sc], 1) for _ in range(5)))
            ]
            start = time.monotonic()  # after the last admission: by start + 4 s every one has left the window
            await asyncio.sleep(2.2)  # past any 2 s boundary, still inside the 4 s window
            mid, _ = await quotas.admit("mid", [sc], 1)
            await asyncio.sleep(max(0.0, 4.05 - (time.monotonic() - start)))
            late, _ = await quotas.admit("late", [sc], 1)
            return first, mid, late

    first, mid, late = run(go())
    assert all(d.admitted for d in first)
    assert not mid.admitted and 0 < mid.retry_after_ms <= 1800
    assert late.admitted


def test_key_limits_override_the_tenant_limits_they_set():
    tenant = Limits(rpm=100, tpm=10_000, concurrency=8)
    assert tenant.merged(Limits(rpm=5)) == Limits(rpm=5, tpm=10_000, concurrency=8)
    assert tenant.merged(None) == tenant


def test_unlimited_scopes_admit_without_touching_redis():
    async def go():
        async with Redis(host="127.0.0.1", port=1) as dead:  # nothing listens there
            return await Quotas(dead).admit("a", [scope()], 10)

    decision, _ = run(go())
    assert decision.admitted and decision.headers() == {}


def test_redis_down_fails_closed():
    async def go():
        async with Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5) as dead:
            await Quotas(dead).admit("a", [scope(rpm=10)], 10)

    with pytest.raises(QuotaUnavailable, match="unreachable"):
        run(go())


@pytest.mark.parametrize(
    ("ms", "text"),
    [(0, "0ms"), (250, "250ms"), (1000, "1s"), (1001, "2s"), (360_000, "6m0s"), (3_723_000, "1h2m3s")],
)
def test_durations_are_spelled_as_openai_spells_them(ms, text):
    assert duration(ms) == text


def test_headers_report_the_tightest_window_and_retry_after_on_rejection():
    decisions = run(_admit_many([scope(rpm=3, tpm=100), scope(rpm=2)], 3, tokens=10))
    ok = [d for d in decisions if d.admitted]
    rejected = [d for d in decisions if not d.admitted]
    assert len(ok) == 2 and len(rejected) == 1
    headers = [d.headers() for d in ok]
    assert sorted(h["x-ratelimit-remaining-requests"] for h in headers) == ["0", "1"]
    assert all(
        h["x-ratelimit-limit-requests"] == "2" and h["x-ratelimit-limit-tokens"] == "100" for h in headers
    )
    assert rejected[0].limit == "rpm" and "retry-after" in rejected[0].headers()


def test_concurrent_requests_never_overspend_a_monthly_spend_budget():
    async def go():
        sc = scope(monthly_spend=1_000)
        async with connect() as redis:
            quotas = Quotas(redis)
            results = await asyncio.gather(
                *(quotas.admit(uuid.uuid4().hex, [sc], 1, cost=30) for _ in range(100))
            )
            return [d for d, _ in results], await quotas.spent(sc)

    decisions, spent = run(go())
    assert sum(d.admitted for d in decisions) == 33 and spent == 33 * 30
    rejected = [d for d in decisions if not d.admitted]
    assert {(d.limit, d.code) for d in rejected} == {("monthly_spend", "spend_budget_exceeded")}
    assert all(d.resets_at is not None and d.resets_at.day == 1 and d.resets_at.hour == 0 for d in rejected)
    assert "monthly spend budget of $0.001" in rejected[0].message()


def test_settling_a_spend_reservation_charges_the_real_cost_and_zero_releases_it():
    async def go():
        sc = scope(monthly_spend=100)
        async with connect() as redis:
            quotas = Quotas(redis)
            _, a = await quotas.admit("a", [sc], 10, cost=60)
            blocked, _ = await quotas.admit("b", [sc], 10, cost=60)
            await quotas.settle(a, 5, used_cost=25)  # cheaper than reserved: cached tokens, an early stop
            after_settle = await quotas.spent(sc)
            _, c = await quotas.admit("c", [sc], 10, cost=60)
            await quotas.settle(c, 0)  # failed before any token
            return blocked, after_settle, await quotas.spent(sc)

    blocked, after_settle, final = run(go())
    assert not blocked.admitted and blocked.limit == "monthly_spend"
    assert after_settle == 25 and final == 25


def test_a_spend_rejection_consumes_none_of_the_other_limits():
    async def go():
        sc = scope(rpm=10, daily_tokens=1_000, monthly_spend=10)
        async with connect() as redis:
            quotas = Quotas(redis)
            rejected, _ = await quotas.admit("big", [sc], 100, cost=11)
            ok, _ = await quotas.admit("small", [sc], 100, cost=10)
            return rejected, ok

    rejected, ok = run(go())
    assert not rejected.admitted and rejected.limit == "monthly_spend"
    assert ok.admitted and ok.requests.remaining == 9
