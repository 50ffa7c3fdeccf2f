"""Request outcomes on a Redis Stream, drained into the database: nothing lost, nothing stored twice.

Real Redis (a stream of each test's own), real writer threads and processes, real SQLite and PostgreSQL.
Faults go through the real path: a writer process killed by a signal while it holds delivered entries, a
database that refuses writes (a held lock), a database connection dropped by the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import test_db
from sqlalchemy import func, select
from tessera import db, records, tenancy
from tessera.models import ApiKey, RequestRecord
from tessera.records import GROUP, Recorder, RecordWriter, RequestOutcome

import billing

# test_db's database fixtures: each test gets an empty migrated SQLite and PostgreSQL database.
postgres_admin = test_db.postgres_admin
migrated_sqlite_file = test_db.migrated_sqlite_file
migrated_postgres_url = test_db.migrated_postgres_url
migrated_url = test_db.migrated_url

REPO = Path(__file__).resolve().parents[1]
REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
MAXLEN = 10_000

# A writer in a process of its own, so a test can kill it with a signal mid-write.
WRITER_PROCESS = """
import sys
from gpu_workers.protocol import connect_redis
from tessera import db
from tessera.records import RecordWriter
redis_url, database_url, stream = sys.argv[1:]
sessions = db.session_factory(db.make_engine(database_url))
RecordWriter(connect_redis(redis_url), sessions, stream, maxlen=10_000, claim_idle_s=60).run()
"""


@pytest.fixture(scope="module")
def client():
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    client.ping()  # CI runs Redis; a missing one is a broken environment, not a reason to skip
    yield client
    client.close()


@pytest.fixture
def stream(client):
    name = f"tessera:test:records:{uuid.uuid4().hex}"
    yield name
    client.delete(name, records.dead_letters(name))


@pytest.fixture
def sessions(migrated_url):
    engine = db.make_engine(migrated_url)
    yield db.session_factory(engine)
    engine.dispose()


@pytest.fixture
def caller(sessions) -> tuple[str, str]:
    """(tenant id, key id) the outcomes belong to."""
    with sessions() as session:
        tenant = tenancy.create_tenant(session, "acme")
        key, _ = tenancy.create_key(session, "acme")
        return tenant.id, key.id


def outcome(caller: tuple[str, str], n: int, **changes) -> RequestOutcome:
    started = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc) + timedelta(seconds=n)
    values = {
        "request_id": f"req_{n:04d}",
        "tenant_id": caller[0],
        "key_id": caller[1],
        "deployment": "@tessera/demo",
        "model": "@tessera/demo",
        "status": "completed",
        "prompt_tokens": 10 + n,
        "cached_tokens": n % 8,
        "output_tokens": 5 + n,
        "started_at": started,
        "first_token_at": started + timedelta(milliseconds=40),
        "finished_at": started + timedelta(milliseconds=300),
        **changes,
    }
    return RequestOutcome(**values)


def publish(stream: str, outcomes: list[RequestOutcome]) -> None:
    """Add outcomes the way the gateway does."""

    async def add() -> None:
        client = aioredis.Redis.from_url(REDIS_URL)
        recorder = Recorder(client, stream, MAXLEN)
        for o in outcomes:
            recorder.submit(o)
        await recorder.close()
        await client.aclose()

    asyncio.run(add())


def stored(sessions) -> dict[str, RequestRecord]:
    with sessions() as session:
        return {r.request_id: r for r in session.scalars(select(RequestRecord))}


def stored_count(sessions) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(RequestRecord))


def drained(client: redis.Redis, stream: str) -> bool:
    """Every entry delivered to a writer and acknowledged."""
    groups = client.xinfo_groups(stream)
    last = client.xinfo_stream(stream)["last-generated-id"]
    return bool(groups) and groups[0]["pending"] == 0 and groups[0]["last-delivered-id"] == last


def pending_by_consumer(client: redis.Redis, stream: str) -> dict[str, int]:
    try:
        info = client.xpending(stream, GROUP)
    except redis.ResponseError:  # no group yet
        return {}
    return {c["name"].decode(): c["pending"] for c in info["consumers"]}


def wait_for(predicate: Callable[[], object], timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@contextlib.contextmanager
def running(writer: RecordWriter) -> Iterator[RecordWriter]:
    writer.start()
    try:
        yield writer
    finally:
        writer.stop()


def new_writer(client, sessions, stream, **options) -> RecordWriter:
    return RecordWriter(client, sessions, stream, maxlen=MAXLEN, **options)


@contextlib.contextmanager
def writes_refused(url: str) -> Iterator[None]:
    """Hold the database's write lock (reads still work): a writer's INSERT waits behind it."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=10)
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            conn.rollback()
            conn.close()
        return
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        conn.execute("LOCK TABLE request_records IN EXCLUSIVE MODE")
        try:
            yield
        finally:
            conn.rollback()


def assert_stored_once(sessions, outcomes: list[RequestOutcome]) -> None:
    rows = stored(sessions)
    assert sorted(rows) == sorted(o.request_id for o in outcomes)
    for o in outcomes:
        row = rows[o.request_id]
        assert (row.tenant_id, row.key_id, row.status, row.model) == (
            o.tenant_id,
            o.key_id,
            o.status,
            o.model,
        )
        assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
            o.prompt_tokens,
            o.cached_tokens,
            o.output_tokens,
        )
        assert (row.created_at, row.finished_at) == (o.started_at, o.finished_at)
        assert row.ttft_s == pytest.approx(0.04) and row.duration_s == pytest.approx(0.3)


# --- the writer ------------------------------------------------------------------------------------------


def test_outcomes_added_before_any_writer_ran_are_stored(client, stream, sessions, caller):
    outcomes = [outcome(caller, n) for n in range(5)]
    publish(stream, outcomes)
    with running(new_writer(client, sessions, stream)) as writer:
        wait_for(lambda: drained(client, stream))
    assert_stored_once(sessions, outcomes)
    assert writer.written == 5
    with sessions() as session:
        key = session.get(ApiKey, caller[1])
        assert key.last_used_at == max(o.started_at for o in outcomes)


def test_duplicates_of_one_outcome_write_one_row(client, stream, sessions, caller):
    first, other = outcome(caller, 1), outcome(caller, 2)
    # The same outcome added three times (e.g. an XADD retried after a reply was lost), one batch and a later one.
    publish(stream, [first, first, other])
    with running(new_writer(client, sessions, stream)) as writer:
        wait_for(lambda: drained(client, stream))
        publish(stream, [first.model_copy(update={"output_tokens": 999})])
        wait_for(lambda: drained(client, stream))
    assert_stored_once(sessions, [first, other])
    assert writer.written == 2
    assert client.xlen(records.dead_letters(stream)) == 0


def test_a_writer_killed_before_its_commit_loses_nothing_and_a_restarted_one_writes_nothing_twice(
    client, stream, sessions, caller, migrated_url
):
    before, during = [outcome(caller, n) for n in range(5)], [outcome(caller, n) for n in range(5, 12)]
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER_PROCESS, REDIS_URL, migrated_url, stream], cwd=REPO
    )
    try:
        publish(stream, before)
        wait_for(lambda: drained(client, stream))
        with writes_refused(migrated_url):
            publish(stream, during)
            # Delivered to the writer, which is now inside its transaction, waiting for the lock (the rest
            # may not have been delivered yet: they wait in the stream).
            wait_for(lambda: sum(pending_by_consumer(client, stream).values()) >= 1)
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
            assert stored_count(sessions) == len(before)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert stored_count(sessions) == len(before)  # the killed writer committed nothing
    with running(new_writer(client, sessions, stream, claim_idle_s=0.2, block_s=0.1)) as restarted:
        wait_for(lambda: drained(client, stream))
    assert restarted.written == len(during)  # it claimed the dead writer's entries and stored each once
    assert_stored_once(sessions, before + during)


def test_an_entry_claimed_by_a_second_writer_while_the_first_still_writes_it_is_stored_once(
    client, stream, sessions, caller, migrated_url
):
    outcomes = [outcome(caller, n) for n in range(6)]
    slow = new_writer(client, sessions, stream, claim_idle_s=600)
    fast = new_writer(client, sessions, stream, claim_idle_s=0.2, block_s=0.1)
    with contextlib.ExitStack() as writers:
        with writes_refused(migrated_url):
            publish(stream, outcomes)  # before the writers start, so the first read delivers them all at once
            writers.enter_context(running(slow))
            wait_for(lambda: pending_by_consumer(client, stream).get(slow.consumer) == len(outcomes))
            # The stalled writer's entries go to the other one; both now hold the same entries mid-write.
            writers.enter_context(running(fast))
            wait_for(lambda: pending_by_consumer(client, stream).get(fast.consumer) == len(outcomes))
        wait_for(lambda: drained(client, stream))
    assert slow.written + fast.written == len(outcomes)
    assert_stored_once(sessions, outcomes)


@pytest.mark.parametrize("migrated_url", ["postgresql"], indirect=True)  # SQLite has no connection to drop
def test_a_dropped_database_connection_mid_write_loses_nothing(
    client, stream, sessions, caller, migrated_url, postgres_admin
):
    outcomes = [outcome(caller, n) for n in range(4)]
    database = db.normalize_url(migrated_url).database
    with running(new_writer(client, sessions, stream)) as writer:
        with writes_refused(migrated_url):
            publish(stream, outcomes)
            blocked = wait_for(
                lambda: postgres_admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
                    (database,),
                ).fetchall()
            )
            for (pid,) in blocked:
                postgres_admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: drained(client, stream))
    assert writer.written == len(outcomes)
    assert_stored_once(sessions, outcomes)


def test_outcomes_that_can_never_be_stored_move_aside_and_the_rest_are_stored(
    client, stream, sessions, caller
):
    good = [outcome(caller, n) for n in range(3)]
    orphan = outcome(("no-such-tenant", None), 9)  # the database refuses it: no such tenant
    publish(stream, [good[0], orphan, good[1]])
    client.xadd(stream, {records.OUTCOME_FIELD: b'{"request_id": "req_bad"}'})  # not an outcome
    client.xadd(stream, {b"something": b"else"})
    publish(stream, [good[2]])
    with running(new_writer(client, sessions, stream)):
        wait_for(lambda: drained(client, stream))
    assert_stored_once(sessions, good)
    dead = client.xrange(records.dead_letters(stream))
    assert len(dead) == 3
    reasons = {
        fields.get(records.OUTCOME_FIELD.encode(), b"").decode(): fields[b"reason"].decode()
        for _, fields in dead
    }
    assert reasons[orphan.model_dump_json()].startswith("the database refused it")
    assert reasons['{"request_id": "req_bad"}'].startswith("malformed outcome: tenant_id: Field required")
    assert reasons[""] == "no 'outcome' field"


def test_a_writer_outlives_a_deleted_stream(client, stream, sessions, caller):
    with running(new_writer(client, sessions, stream, block_s=0.1)):
        publish(stream, [outcome(caller, 1)])
        wait_for(lambda: drained(client, stream))
        client.delete(stream)  # its consumer group goes with it
        publish(stream, [outcome(caller, 2)])
        wait_for(lambda: stored_count(sessions) == 2)
    assert_stored_once(sessions, [outcome(caller, 1), outcome(caller, 2)])


# --- the outcome -----------------------------------------------------------------------------------------


def test_an_outcome_derives_fresh_tokens_ttft_and_duration(caller):
    o = outcome(caller, 3)
    dumped = o.model_dump(mode="json")
    assert dumped["fresh_tokens"] == o.prompt_tokens - o.cached_tokens == 10
    assert dumped["ttft_s"] == pytest.approx(0.04) and dumped["duration_s"] == pytest.approx(0.3)
    assert RequestOutcome.model_validate_json(o.model_dump_json()) == o  # derived fields don't break a read
    assert outcome(caller, 3, first_token_at=None).ttft_s is None


def test_an_outcome_refuses_more_cached_than_prompt_tokens(caller):
    with pytest.raises(ValueError, match=r"cached_tokens \(11\) exceeds prompt_tokens \(10\)"):
        outcome(caller, 0, cached_tokens=11)


# --- 429 counters --------------------------------------------------------------------------------------------


def test_each_429_adds_one_to_its_counter_and_no_row_per_request(client, stream):
    async def reject() -> None:
        r = aioredis.Redis.from_url(REDIS_URL)
        recorder = Recorder(r, stream, MAXLEN)
        for limit in ("rpm", "rpm", "tpm"):
            await recorder.reject("t-1", "k-1", "@m/a", limit)
        await recorder.reject("t-1", None, "@m/a", "rpm")
        await r.aclose()

    asyncio.run(reject())
    key = billing.rejections_key(stream)
    try:
        today = datetime.now(timezone.utc).date()
        counts = {k.decode(): int(v) for k, v in client.hgetall(key).items()}
        assert counts == {
            billing.rejection_field("t-1", today, "@m/a", "k-1", "rpm"): 2,
            billing.rejection_field("t-1", today, "@m/a", "k-1", "tpm"): 1,
            billing.rejection_field("t-1", today, "@m/a", None, "rpm"): 1,
        }
        assert client.xlen(stream) == 0  # nothing on the outcome stream: the writer never sees a 429
    finally:
        client.delete(key)


def test_a_429_is_still_answered_when_redis_cannot_count_it(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens once the socket closes

    async def reject() -> None:
        r = aioredis.Redis.from_url(dead, socket_connect_timeout=1)
        await Recorder(r, "tessera:test:dead", MAXLEN).reject("t-1", "k-1", "@m/a", "rpm")
        await r.aclose()

    asyncio.run(reject())  # returns: losing a count never turns the 429 into a 500
    assert "could not count a 429 (rpm) of tenant t-1" in caplog.text
