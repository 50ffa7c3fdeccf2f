"""A request's lifecycle rule, once, over observed states: is anybody left to serve it?

``lifecycle.judge`` is what the gateway decides from what it sees of a quiet request (its lease, the heartbeats
of the workers it was routed to and of their pools, in-flight records, queue lengths, idle time); the
gateway tests (tests/test_gateway.py) show the same verdicts end to end, through Redis and a real stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis
import redis.asyncio as aioredis
from test_budgets import REDIS_URL

from gpu_workers.lifecycle import (
    Observed,
    Routed,
    Verdict,
    inflight_key,
    judge,
    lease_key,
    live,
    observe,
    quiet_check_due,
)
from gpu_workers.protocol import WorkerInfo, pool_queue, workers_key

TTL = 10.0
ALIVE, SUSPECT, LOST = Verdict.ALIVE, Verdict.SUSPECT, Verdict.LOST


def routed(
    pool: str = "decode",
    worker_id: str = "w1",
    age: float | None = 1.0,
    pool_age: float | None = 1.0,
    in_flight: bool = False,
    queued: int = 0,
) -> Routed:
    return Routed(pool, worker_id, age, pool_age, in_flight, queued)


GONE = {"age": None}  # a routed worker no longer in its pool
GONE_ALONE = {"age": None, "pool_age": None}  # ... and nobody else in that pool either
STALE_ALONE = {"age": TTL + 1, "pool_age": TTL + 1}  # its heartbeat older than the TTL, and the pool's

# (observed, how long it was suspect before, verdict)
CASES = {
    "stream_idle_less_than_a_ttl": (Observed(TTL - 1, None, (routed(**GONE_ALONE),)), None, ALIVE),
    "lease_held_though_every_worker_is_gone": (Observed(60, "w1", (routed(**GONE_ALONE),)), 30.0, ALIVE),
    "routed_worker_live": (Observed(60, None, (routed(),)), None, ALIVE),
    "heartbeat_exactly_a_ttl_old_is_live": (Observed(60, None, (routed(age=TTL),)), 30.0, ALIVE),
    "routed_worker_gone_and_its_pool_empty": (Observed(60, None, (routed(**GONE_ALONE),)), None, LOST),
    "routed_worker_stale_and_its_pool_too": (Observed(60, None, (routed(**STALE_ALONE),)), None, LOST),
    "routed_worker_gone_its_pool_live": (Observed(60, None, (routed(**GONE),)), None, SUSPECT),
    "suspect_less_than_a_further_ttl": (Observed(60, None, (routed(**GONE),)), TTL, SUSPECT),
    "suspect_more_than_a_further_ttl": (Observed(60, None, (routed(**GONE),)), TTL + 0.1, LOST),
    "routed_worker_gone_its_pool_queue_holds_tasks": (
        Observed(60, None, (routed(**GONE, queued=3),)),
        30.0,
        ALIVE,
    ),
    "prefill_gone_after_its_part": (
        Observed(60, None, (routed("prefill", "p1", **GONE_ALONE), routed()), streamed=True),
        None,
        ALIVE,
    ),
    "prefill_gone_in_the_middle_of_its_part": (
        Observed(60, None, (routed("prefill", "p1", **GONE_ALONE, in_flight=True), routed()), streamed=True),
        None,
        LOST,
    ),
    "prefill_gone_before_streaming": (
        Observed(60, None, (routed("prefill", "p1", **GONE_ALONE), routed())),
        None,
        LOST,
    ),
    "decode_gone_after_streaming_is_not_let_off": (
        Observed(60, None, (routed(**GONE_ALONE),), streamed=True),
        None,
        LOST,
    ),
    "first_suspect_routed_worker_decides_before_a_later_empty_pool": (
        Observed(60, None, (routed("prefill", "p1", **GONE), routed(**GONE_ALONE))),
        None,
        SUSPECT,
    ),
    "peer_took_it_up_and_died_outside_every_pool": (
        Observed(60, None, (routed(),), streamed=True, last_holder="peer", last_holder_in_flight=True),
        None,
        SUSPECT,
    ),
    "peer_died_outside_every_pool_a_ttl_ago": (
        Observed(60, None, (routed(),), streamed=True, last_holder="peer", last_holder_in_flight=True),
        TTL + 1,
        LOST,
    ),
    "peer_still_live_in_some_pool": (
        Observed(
            60,
            None,
            (routed(),),
            last_holder="peer",
            last_holder_in_flight=True,
            last_holder_heartbeat_age_s=1.0,
        ),
        TTL + 1,
        ALIVE,
    ),
    "peer_ended_its_attempt": (
        Observed(60, None, (routed(),), last_holder="peer", last_holder_in_flight=False),
        TTL + 1,
        ALIVE,
    ),
    "last_holder_a_routed_worker_is_judged_as_routed": (
        Observed(60, None, (routed(),), last_holder="w1", last_holder_in_flight=True),
        TTL + 1,
        ALIVE,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_quiet_request_is_judged_from_what_is_observed(case):
    seen, suspect_for_s, expected = CASES[case]
    assert judge(seen, TTL, suspect_for_s) is expected


@pytest.mark.parametrize(
    ("idle_s", "since_check_s", "due"),
    [(7.5, 100.0, False), (10.0, 100.0, False), (10.5, 100.0, True), (11.0, 2.4, False), (11.0, 2.5, True)],
)
def test_a_quiet_stream_is_looked_at_after_a_ttl_at_most_every_quarter_ttl(idle_s, since_check_s, due):
    assert quiet_check_due(idle_s, since_check_s, TTL) is due


@pytest.mark.parametrize(("age", "is_live"), [(None, False), (-60.0, True), (TTL, True), (TTL + 0.01, False)])
def test_a_worker_is_live_while_its_heartbeat_is_at_most_a_ttl_old(age, is_live):
    assert live(age, TTL) is is_live


def test_observe_reads_the_lease_heartbeats_in_flight_records_and_queues_of_a_request():
    deployment = f"@life/{uuid.uuid4().hex[:8]}"
    rid = f"req_life_{uuid.uuid4().hex[:10]}"
    sync = redis.Redis.from_url(REDIS_URL)
    now = float(int(time.time()))  # whole seconds: the ages below come out exact

    def beat(pool: str, worker_id: str, age_s: float) -> None:
        info = WorkerInfo(worker_id, deployment, pool, f"q.{worker_id}", "h", 1, now - age_s)
        sync.hset(workers_key(deployment, pool), worker_id, info.to_json())

    beat("prefill", "p2", 3.0)  # p1, the routed prefill worker, is gone; a peer is live
    beat("decode", "d1", 1.0)
    beat("serve", "peer", 50.0)  # the peer that took the request up: stale
    sync.hset(inflight_key("peer"), rid, "{}")
    sync.rpush(pool_queue(deployment, "decode"), "a", "b")

    async def run() -> Observed:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            return await observe(
                client,
                rid,
                deployment,
                (("prefill", "p1"), ("decode", "d1")),
                idle_s=12.0,
                streamed=True,
                last_holder="peer",
                now=now,
            )
        finally:
            await client.aclose()

    try:
        seen = asyncio.run(run())
        assert seen == Observed(
            idle_s=12.0,
            lease_holder=None,
            routed=(
                Routed("prefill", "p1", None, 3.0, False, 0),
                Routed("decode", "d1", 1.0, 1.0, False, 2),
            ),
            streamed=True,
            last_holder="peer",
            last_holder_in_flight=True,
            last_holder_heartbeat_age_s=50.0,
        )
        assert judge(seen, TTL) is SUSPECT
        sync.set(lease_key(rid), "peer", px=5000)
        assert asyncio.run(run()).lease_holder == "peer"
    finally:
        for pool in ("prefill", "decode", "serve"):
            sync.delete(workers_key(deployment, pool), pool_queue(deployment, pool))
        sync.delete(inflight_key("peer"), lease_key(rid))
        sync.close()
