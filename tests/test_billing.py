"""Billing: the ledger charges every request exactly once, priced from a versioned price book, with rollups
that always equal the ledger; ``/v1/usage`` answers from the rollups for the caller's tenant only.

Real Redis (a stream of each test's own), real consumer threads and processes (killed by SIGKILL before
their commit, and after their commit but before their XACK), real SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import test_db
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from tessera import auth, db, records, tenancy
from tessera.app import create_app
from tessera.models import RequestRecord
from tessera.records import Recorder, RecordWriter, RequestOutcome
from tessera.settings import Settings

import billing
from billing import BillingConsumer, LedgerEvent, PriceSpec, Rollup, UsageEvent

postgres_admin = test_db.postgres_admin
migrated_sqlite_file = test_db.migrated_sqlite_file
migrated_postgres_url = test_db.migrated_postgres_url
migrated_url = test_db.migrated_url

REPO = Path(__file__).resolve().parents[1]
REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "@tessera/pycode-tiny"
DEFAULT = billing.DEFAULT_PRICES[MODEL]

# A consumer in a process of its own that SIGKILLs itself at a chosen point of its first batch.
CONSUMER_PROCESS = """
import os, signal, sys
import redis
from sqlalchemy import event
from billing import BillingConsumer
from tessera import db
redis_url, database_url, stream, fault = sys.argv[1:]
sessions = db.session_factory(db.make_engine(database_url))
die = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
if fault == "before_commit":  # the ledger and rollup statements ran; their transaction is open
    event.listen(sessions, "before_commit", lambda session: die())
else:  # "before_ack": committed, not yet acknowledged
    redis.Redis.xack = die
BillingConsumer(redis.Redis.from_url(redis_url), sessions, stream, claim_idle_s=60).run()
"""


@pytest.fixture(scope="module")
def client():
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    client.ping()
    yield client
    client.close()


@pytest.fixture
def stream(client):
    name = f"tessera:test:billing:{uuid.uuid4().hex}"
    yield name
    client.delete(name, records.dead_letters(name), billing.billing_dead_letters(name))


@pytest.fixture
def url(migrated_url):
    """A migrated database of each kind; billing's tables emptied afterwards (default prices kept)."""
    yield migrated_url
    engine = db.make_engine(migrated_url)
    with engine.begin() as conn:
        for table in (
            billing.InvoiceLine,
            billing.InvoiceSum,
            billing.Invoice,
            LedgerEvent,
            Rollup,
            billing.LatencyBucket,
            billing.OutcomeCount,
        ):
            conn.execute(table.__table__.delete())
        conn.execute(billing.Price.__table__.delete().where(billing.Price.version > 1))
    engine.dispose()


@pytest.fixture
def sessions(url):
    engine = db.make_engine(url)
    yield db.session_factory(engine)
    engine.dispose()


@pytest.fixture
def caller(sessions) -> tuple[str, str]:
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
        "deployment": MODEL,
        "model": MODEL,
        "status": "completed",
        "prompt_tokens": 100 + 7 * n,
        "cached_tokens": 16 * (n % 5),
        "output_tokens": 5 + 3 * n,
        "started_at": started,
        "first_token_at": started + timedelta(milliseconds=40),
        "finished_at": started + timedelta(milliseconds=300),
        **changes,
    }
    return RequestOutcome(**values)


def event(o: RequestOutcome) -> UsageEvent:
    return UsageEvent.model_validate_json(o.model_dump_json())


def publish(stream: str, outcomes: list[RequestOutcome]) -> None:
    """Add outcomes the way the gateway does."""

    async def add() -> None:
        r = aioredis.Redis.from_url(REDIS_URL)
        recorder = Recorder(r, stream, 100_000)
        for o in outcomes:
            await recorder.add(o)
        await r.aclose()

    asyncio.run(add())


def expected_cost(o: RequestOutcome, spec: PriceSpec = DEFAULT) -> int:
    half_up = lambda tokens, price: (tokens * price + 500_000) // 1_000_000  # noqa: E731
    return (
        half_up(o.cached_tokens, spec.cached_input)
        + half_up(o.fresh_tokens, spec.fresh_input)
        + half_up(o.output_tokens, spec.output)
    )


def assert_charged_once(sessions, outcomes: list[RequestOutcome]) -> None:
    """Ledger rows = distinct request ids, each priced right; rollups = sums of the ledger, to the micro-USD."""
    distinct = {o.request_id: o for o in outcomes}
    with sessions() as session:
        rows = {e.request_id: e for e in session.scalars(select(LedgerEvent))}
        assert sorted(rows) == sorted(distinct)
        for request_id, o in distinct.items():
            row = rows[request_id]
            assert (row.cached_input_tokens, row.fresh_input_tokens, row.output_tokens) == (
                o.cached_tokens,
                o.fresh_tokens,
                o.output_tokens,
            )
            assert row.cost == expected_cost(o)
        ledger = session.execute(
            select(
                func.count(),
                func.sum(LedgerEvent.cached_input_tokens),
                func.sum(LedgerEvent.fresh_input_tokens),
                func.sum(LedgerEvent.output_tokens),
                func.sum(LedgerEvent.cost),
            )
        ).one()
        rollups = session.execute(
            select(
                func.sum(Rollup.requests),
                func.sum(Rollup.cached_input_tokens),
                func.sum(Rollup.fresh_input_tokens),
                func.sum(Rollup.output_tokens),
                func.sum(Rollup.cost),
            )
        ).one()
        outcomes = session.scalar(select(func.sum(billing.OutcomeCount.requests)))
    assert tuple(ledger) == tuple(rollups)
    assert ledger[4] == sum(expected_cost(o) for o in distinct.values())
    assert outcomes == ledger[0]  # the quality counts move with the ledger too


def pending(client, stream) -> int:
    try:
        return client.xpending(stream, billing.GROUP)["pending"]
    except redis.ResponseError:
        return 0


def wait_for(predicate: Callable[[], object], timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


# --- prices ----------------------------------------------------------------------------------------------


def test_the_rounding_rule_is_half_up_per_kind_in_integers():
    assert billing.amount(0, 100_000) == 0
    assert billing.amount(4, 100_000) == 0  # 0.4 micro-USD
    assert billing.amount(5, 100_000) == 1  # 0.5 rounds up
    assert billing.amount(15, 100_000) == 2  # 1.5 rounds up
    assert billing.amount(1_000_000, 950_000) == 950_000
    with pytest.raises(ValueError, match="non-negative integer"):
        PriceSpec(fresh_input=1.5, cached_input=0, output=0)


def test_the_migration_seeds_the_default_prices(sessions):
    with sessions() as session:
        prices = {p.model: p for p in billing.list_prices(session)}
    assert set(prices) == set(billing.DEFAULT_PRICES)
    for model, spec in billing.DEFAULT_PRICES.items():
        p = prices[model]
        assert (p.version, p.effective_from) == (1, billing.prices.EPOCH)
        assert (p.fresh_input_per_mtok, p.cached_input_per_mtok, p.output_per_mtok) == (
            spec.fresh_input,
            spec.cached_input,
            spec.output,
        )


def test_an_event_keeps_the_price_version_it_was_priced_with(sessions, caller):
    change = datetime(2026, 12, 1, 12, 0, 10, tzinfo=timezone.utc)
    new = PriceSpec(fresh_input=950_000, cached_input=160_000, output=4_000_000)
    with sessions() as session:
        v2 = billing.set_price(session, MODEL, new, effective_from=change)
        assert v2.version == 2
        early, late = outcome(caller, 1), outcome(caller, 20)  # started before / after the change
        billing.record_events(session, [event(early), event(late)])
        billing.set_price(session, MODEL, PriceSpec(fresh_input=1, cached_input=1, output=1))  # v3, now
        rows = {e.request_id: e for e in session.scalars(select(LedgerEvent))}
        versions = {p.id: p.version for p in billing.list_prices(session, MODEL)}
    assert versions[rows[early.request_id].price_id] == 1 and rows[early.request_id].cost == expected_cost(
        early
    )
    assert versions[rows[late.request_id].price_id] == 2 and rows[late.request_id].cost == expected_cost(
        late, new
    )
    other = outcome(caller, 2, request_id="other", model="@someone/else")  # no price of its own: "*"
    with sessions() as session:
        (row,) = billing.record_events(session, [event(other)])
    assert row["cost"] == expected_cost(other)


def test_a_replayed_long_prompt_pays_the_cached_rate_for_its_cached_part(sessions, caller):
    first = outcome(caller, 0, request_id="first", prompt_tokens=4000, cached_tokens=0, output_tokens=10)
    replay = outcome(caller, 1, request_id="replay", prompt_tokens=4000, cached_tokens=3984, output_tokens=10)
    with sessions() as session:
        rows = {r["request_id"]: r for r in billing.record_events(session, [event(first), event(replay)])}
    assert rows["first"]["fresh_input_cost"] == 4000 * DEFAULT.fresh_input // 10**6 == 400
    assert (rows["replay"]["cached_input_tokens"], rows["replay"]["fresh_input_tokens"]) == (3984, 16)
    assert rows["replay"]["cached_input_cost"] == (3984 * DEFAULT.cached_input + 500_000) // 10**6 == 80
    assert rows["replay"]["fresh_input_cost"] == (16 * DEFAULT.fresh_input + 500_000) // 10**6 == 2
    assert rows["replay"]["cost"] < rows["first"]["cost"]
    assert_charged_once(sessions, [first, replay])


def test_a_request_that_failed_before_its_first_token_bills_no_tokens(sessions, caller):
    failed = outcome(
        caller, 0, request_id="failed", status="failed", error_code="worker_lost", output_tokens=0
    )
    late = outcome(caller, 1, request_id="late", status="failed", error_code="worker_lost", output_tokens=3)
    gone = outcome(caller, 2, request_id="gone", status="cancelled", output_tokens=0)
    with sessions() as session:
        rows = {
            r["request_id"]: r
            for r in billing.record_events(session, [event(failed), event(late), event(gone)])
        }
    assert (rows["failed"]["cached_input_tokens"], rows["failed"]["fresh_input_tokens"]) == (0, 0)
    assert rows["failed"]["cost"] == 0 and rows["failed"]["status"] == "failed"  # recorded, not billed
    assert rows["late"]["fresh_input_tokens"] == late.fresh_tokens and rows["late"]["cost"] == expected_cost(
        late
    )
    assert rows["gone"]["cost"] == expected_cost(gone) > 0  # a cancel the client made pays for its prompt


# --- the ledger ------------------------------------------------------------------------------------------


def test_duplicates_within_and_across_batches_count_once(sessions, caller):
    outcomes = [outcome(caller, n) for n in range(30)]
    with sessions() as session:
        new = billing.record_events(session, [event(o) for o in outcomes + outcomes[:10]])
        assert len(new) == 30
        assert billing.record_events(session, [event(o) for o in outcomes[5:]]) == []
        assert len(billing.record_events(session, [event(outcome(caller, 99))])) == 1
    assert_charged_once(sessions, [*outcomes, outcome(caller, 99)])


def test_concurrent_writers_of_the_same_events_charge_each_once(url, caller):
    engine = db.make_engine(url)
    sessions = db.session_factory(engine)
    outcomes = [outcome(caller, n) for n in range(40)]
    barrier = threading.Barrier(4)
    inserted: list[int] = []
    errors: list[BaseException] = []

    def write(offset: int) -> None:
        try:
            with sessions() as session:
                barrier.wait()
                batch = outcomes[offset:] + outcomes[:offset]  # overlapping, in different orders
                inserted.append(len(billing.record_events(session, [event(o) for o in batch])))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n * 10,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(inserted) == 40
    assert_charged_once(sessions, outcomes)
    engine.dispose()


# --- the consumer ----------------------------------------------------------------------------------------


def test_billing_has_its_own_group_beside_the_records_writer(client, stream, sessions, caller):
    outcomes = [outcome(caller, n) for n in range(25)]
    publish(stream, outcomes)
    writer = RecordWriter(client, sessions, stream, maxlen=100_000)
    writer.start()
    consumer = BillingConsumer(client, sessions, stream, block_s=0.1)
    consumer.start()
    try:
        wait_for(lambda: consumer.charged == 25 and writer.written == 25)
    finally:
        consumer.stop()
        writer.stop()
    groups = {g["name"].decode(): g for g in client.xinfo_groups(stream)}
    assert set(groups) == {records.GROUP, billing.GROUP}
    assert all(g["pending"] == 0 for g in groups.values())
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(RequestRecord)) == 25
    assert_charged_once(sessions, outcomes)


@pytest.mark.parametrize("fault", ["before_commit", "before_ack"])
def test_a_consumer_killed_mid_batch_and_restarted_never_double_counts(
    client, stream, sessions, caller, url, fault
):
    outcomes = [outcome(caller, n) for n in range(40)]
    publish(stream, outcomes + outcomes[:15])  # the gateway emitted some twice, too
    process = subprocess.Popen(
        [sys.executable, "-c", CONSUMER_PROCESS, REDIS_URL, url, stream, fault], cwd=REPO
    )
    try:
        assert process.wait(timeout=60) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert pending(client, stream) > 0  # it was delivered entries and acknowledged none
    with sessions() as session:
        in_ledger = session.scalar(select(func.count()).select_from(LedgerEvent))
    assert in_ledger == (0 if fault == "before_commit" else min(40, pending(client, stream)))
    restarted = BillingConsumer(client, sessions, stream, claim_idle_s=0.2, block_s=0.1)
    time.sleep(0.3)
    restarted.drain()
    assert pending(client, stream) == 0
    assert restarted.charged == 40 - in_ledger
    restarted.drain()  # a second run over the stream changes nothing
    assert_charged_once(sessions, outcomes)


class CountingConsumer(BillingConsumer):
    """The billing consumer, counting its transactions (each ``write`` is one)."""

    transactions = 0

    def write(self, items):
        self.transactions += 1
        super().write(items)


@pytest.mark.parametrize("linger_s, most", [(0.3, 12), (0.0, None)])
def test_under_steady_traffic_a_lingering_consumer_charges_in_batches(
    client, stream, sessions, caller, linger_s, most
):
    outcomes = [outcome(caller, n) for n in range(40)]
    consumer = CountingConsumer(client, sessions, stream, block_s=0.1, linger_s=linger_s)
    consumer.start()
    try:
        for o in outcomes:  # one outcome every 40 ms, as requests end one by one
            publish(stream, [o])
            time.sleep(0.04)
        wait_for(lambda: consumer.charged == 40)
    finally:
        consumer.stop()
    assert_charged_once(sessions, outcomes)
    if most is None:  # without a linger, about one transaction per outcome
        assert consumer.transactions >= 16, consumer.transactions
    else:  # ~1.6 s of traffic: a transaction per read, and a read per linger
        assert consumer.transactions <= most, consumer.transactions


def test_malformed_entries_move_aside_and_the_rest_are_charged(client, stream, sessions, caller):
    outcomes = [outcome(caller, n) for n in range(5)]
    client.xadd(stream, {"outcome": b"{not json"})
    client.xadd(stream, {"something": b"else"})
    publish(stream, outcomes)
    consumer = BillingConsumer(client, sessions, stream)
    consumer.drain()
    assert consumer.charged == 5 and pending(client, stream) == 0
    dead = client.xrange(billing.billing_dead_letters(stream))
    assert len(dead) == 2 and all(b"reason" in fields for _, fields in dead)
    assert_charged_once(sessions, outcomes)


# --- /v1/usage -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("billing"),
        redis_url=REDIS_URL,
        secret_key="billing-test-secret-" * 4,
        records_stream=f"tessera:test:billing:{uuid.uuid4().hex}",
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    keys: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    with sessions() as session:
        for name in ("acme", "globex"):
            tenant = tenancy.create_tenant(session, name)
            made = [tenancy.create_key(session, name) for _ in range(3)]
            keys[name] = (tenant.id, [(k.id, raw) for k, raw in made])
    auth.key_cache.clear()
    with TestClient(create_app(settings)) as test_client:
        yield test_client, sessions, keys, settings
    redis.Redis.from_url(REDIS_URL).delete(settings.records_stream)


def seed(sessions, keys) -> dict[str, list[RequestOutcome]]:
    """Events for both tenants over 12 days, 3 models and 3 keys."""
    made: dict[str, list[RequestOutcome]] = {}
    for name, (tenant_id, tenant_keys) in keys.items():
        made[name] = []
        for n in range(120):
            key_id = tenant_keys[n % 3][0]
            o = outcome(
                (tenant_id, key_id),
                n,
                request_id=f"{name}-{n}",
                model=[MODEL, "@m/b", "@m/c"][n % 3 if name == "acme" else 0],
                started_at=datetime(2026, 11, 1 + n % 12, 8, tzinfo=timezone.utc) + timedelta(seconds=n),
                first_token_at=None,
                finished_at=datetime(2026, 11, 1 + n % 12, 9, tzinfo=timezone.utc) + timedelta(seconds=n),
            )
            made[name].append(o)
    with sessions() as session:
        billing.record_events(session, [event(o) for os_ in made.values() for o in os_])
    return made


def test_usage_shows_only_the_callers_tenant_and_paginates_every_row_once(api):
    test_client, sessions, keys, _ = api
    made = seed(sessions, keys)
    acme_key = keys["acme"][1][0][1]
    headers = {"Authorization": f"Bearer {acme_key}"}
    for group_by, expected in (("day", 12), ("model", 3), ("key", 3)):
        rows, cursor, pages = [], None, 0
        while True:
            params = {"start": "2026-11-01", "end": "2026-11-30", "group_by": group_by, "limit": 5}
            if cursor:
                params["cursor"] = cursor
            r = test_client.get("/v1/usage", params=params, headers=headers)
            assert r.status_code == 200, r.text
            body = r.json()
            rows += body["data"]
            pages += 1
            cursor = body["next_cursor"]
            if cursor is None:
                break
        field = {"day": "day", "model": "model", "key": "key_id"}[group_by]
        groups = [row[field] for row in rows]
        assert len(groups) == len(set(groups)) == expected and groups == sorted(groups)
        assert pages == -(-expected // 5)
        assert sum(row["requests"] for row in rows) == 120  # acme's only; globex has 120 too
        assert sum(row["cost"] for row in rows) == sum(expected_cost(o) for o in made["acme"])
        assert sum(row["cached_input_tokens"] for row in rows) == sum(o.cached_tokens for o in made["acme"])
    acme_keys = {k for k, _ in keys["acme"][1]}
    r = test_client.get(
        "/v1/usage", params={"start": "2026-11-01", "end": "2026-11-30", "group_by": "key"}, headers=headers
    )
    assert {row["key_id"] for row in r.json()["data"]} == acme_keys
    # Filters: one model, one key, one day.
    r = test_client.get(
        "/v1/usage",
        params={"start": "2026-11-03", "end": "2026-11-03", "model": "@m/b", "key": keys["acme"][1][1][0]},
        headers=headers,
    )
    want = [
        o
        for o in made["acme"]
        if o.model == "@m/b" and o.finished_at.day == 3 and o.key_id == keys["acme"][1][1][0]
    ]
    assert [row["requests"] for row in r.json()["data"]] == ([len(want)] if want else [])
    # A globex key filter from acme shows nothing of globex.
    r = test_client.get(
        "/v1/usage",
        params={"start": "2026-11-01", "end": "2026-11-30", "key": keys["globex"][1][0][0]},
        headers=headers,
    )
    assert r.json()["data"] == []

    # Raw events: every one of acme's exactly once, none of globex's.
    seen, cursor = [], None
    while True:
        params = {
            "start": "2026-11-01",
            "end": "2026-11-30",
            "limit": 7,
            **({"cursor": cursor} if cursor else {}),
        }
        body = test_client.get("/v1/usage/requests", params=params, headers=headers).json()
        assert len(body["data"]) <= 7
        seen += [e["request_id"] for e in body["data"]]
        if not (cursor := body["next_cursor"]):
            break
    assert sorted(seen) == sorted(o.request_id for o in made["acme"]) and len(seen) == len(set(seen))


def test_usage_csv_has_cached_and_fresh_columns_and_errors_are_json(api):
    test_client, sessions, keys, _ = api
    headers = {"Authorization": f"Bearer {keys['globex'][1][0][1]}"}
    r = test_client.get(
        "/v1/usage",
        params={"start": "2026-11-01", "end": "2026-11-30", "group_by": "model", "format": "csv"},
        headers=headers,
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(r.text)))
    assert {"model", "cached_input_tokens", "fresh_input_tokens", "output_tokens", "cost", "cost_usd"} <= set(
        table[0]
    )
    assert sum(int(row["requests"]) for row in table) == 120
    assert {row["model"] for row in table} == {MODEL}
    for row in table:
        assert row["cost_usd"] == f"{int(row['cost']) // 10**6}.{int(row['cost']) % 10**6:06d}"
    assert test_client.get("/v1/usage").status_code == 401
    bad = test_client.get("/v1/usage", params={"cursor": "!!"}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
    backwards = test_client.get(
        "/v1/usage", params={"start": "2026-11-05", "end": "2026-11-01"}, headers=headers
    )
    assert backwards.status_code == 400
    schema = test_client.app.openapi()
    for path in ("/v1/usage", "/v1/usage/requests"):
        assert "$ref" in str(schema["paths"][path]["get"]["responses"]["200"]["content"]["application/json"])


def test_the_apps_consumer_charges_what_the_gateway_records(api):
    test_client, sessions, keys, settings = api
    tenant_id, tenant_keys = keys["acme"]
    today = datetime.now(timezone.utc).replace(microsecond=0)
    outcomes = [
        outcome(
            (tenant_id, tenant_keys[0][0]),
            n,
            request_id=f"live-{n}",
            started_at=today,
            first_token_at=None,
            finished_at=today,
        )
        for n in range(6)
    ]
    publish(settings.records_stream, outcomes + outcomes[:2])
    headers = {"Authorization": f"Bearer {tenant_keys[0][1]}"}
    day = today.date().isoformat()

    def charged():
        body = test_client.get("/v1/usage", params={"start": day, "end": day}, headers=headers).json()
        return body["data"] if body["data"] and body["data"][0]["requests"] == 6 else None

    (row,) = wait_for(charged)
    assert row["cost"] == sum(expected_cost(o) for o in outcomes)
    assert row["day"] == day and date.fromisoformat(row["day"]) == today.date()


def test_the_cli_sets_and_shows_versioned_prices(url, capsys):
    from tessera.cli import main

    args = ["--database-url", url, "--json"]
    assert (
        main(
            [
                "billing",
                "prices",
                "set",
                MODEL,
                "--fresh",
                "950000",
                "--cached",
                "160000",
                "--output",
                "4000000",
                *args,
            ]
        )
        == 0
    )
    assert main(["billing", "prices", "show", MODEL, *args]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    shown = [json.loads(line) for line in lines[1:]]
    assert [(p["version"], p["fresh_input"], p["cached_input"], p["output"]) for p in shown] == [
        (1, DEFAULT.fresh_input, DEFAULT.cached_input, DEFAULT.output),
        (2, 950_000, 160_000, 4_000_000),
    ]
    with pytest.raises(SystemExit) as refused:
        main(["billing", "prices", "set", MODEL, "--fresh", "0.5", "--cached", "0", "--output", "0", *args])
    assert refused.value.code == 2
