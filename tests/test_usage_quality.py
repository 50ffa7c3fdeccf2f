"""Usage quality: latency histograms and outcomes kept with the ledger (a duplicate moves nothing), 429s counted
by the gateway and moved into the database exactly once, and ``/v1/usage/quality`` answering from them for
the caller's tenant only. Real Redis, real SQLite and PostgreSQL, the real app with its own consumer.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
import uuid
from datetime import date, datetime, timedelta, timezone

import pytest
import redis
import test_db
from fastapi.testclient import TestClient
from sqlalchemy import event, func, select
from tessera import auth, db, deployments, quota_config, tenancy
from tessera.app import create_app
from tessera.limits import Limits
from tessera.models import SCOPE_ADMIN
from tessera.settings import Settings

import billing
from billing import LatencyBucket, OutcomeCount, RejectionCount, UsageEvent
from billing.quality import BOUNDS, bucket_of, flush_rejections, quantile, rejection_field, rejections_key
from gpu_workers.protocol import WorkerInfo, worker_queue, workers_key

postgres_admin = test_db.postgres_admin
postgres_url = test_db.postgres_url
database_url = test_db.database_url
migrated_sqlite_file = test_db.migrated_sqlite_file
migrated_postgres_url = test_db.migrated_postgres_url
migrated_url = test_db.migrated_url

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "@tessera/pycode-tiny"
DEPLOYMENT = f"@test/quality-{uuid.uuid4().hex[:8]}"  # its own: other runs share this Redis
QUALITY_TABLES = (LatencyBucket, OutcomeCount, RejectionCount, billing.RejectionFlush)


@pytest.fixture
def url(migrated_url):
    yield migrated_url
    engine = db.make_engine(migrated_url)
    with engine.begin() as conn:
        for table in (*QUALITY_TABLES, billing.InvoiceSum, billing.LedgerEvent, billing.Rollup):
            conn.execute(table.__table__.delete())
    engine.dispose()


@pytest.fixture
def sessions(url):
    engine = db.make_engine(url)
    yield db.session_factory(engine)
    engine.dispose()


@pytest.fixture
def client():
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    client.ping()
    yield client
    client.close()


def usage(n: int, *, ttft_ms: float | None, duration_ms: float, output_tokens: int, **changes) -> UsageEvent:
    started = datetime(2026, 11, 3, 12, 0, tzinfo=timezone.utc) + timedelta(seconds=n)
    values = {
        "request_id": f"req-{n}",
        "tenant_id": "t-acme",
        "key_id": "k-1",
        "deployment": MODEL,
        "model": MODEL,
        "status": "completed",
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "output_tokens": output_tokens,
        "started_at": started,
        "first_token_at": None if ttft_ms is None else started + timedelta(milliseconds=ttft_ms),
        "finished_at": started + timedelta(milliseconds=duration_ms),
        **changes,
    }
    return UsageEvent(**values)


# --- histograms -------------------------------------------------------------------------------------------


def test_buckets_are_log_spaced_from_one_millisecond_to_one_hundred_seconds():
    assert len(BOUNDS) == 31 and BOUNDS[0] == pytest.approx(1e-3) and BOUNDS[-1] == pytest.approx(100.0)
    ratios = {round(b / a, 9) for a, b in zip(BOUNDS, BOUNDS[1:], strict=False)}
    assert ratios == {round(10 ** (1 / 6), 9)}
    assert bucket_of(0.0) == 0 and bucket_of(0.0009) == 0 and bucket_of(BOUNDS[0]) == 1
    assert bucket_of(1e9) == len(BOUNDS) and bucket_of(-1.0) == 0  # a clock step back counts as zero


def test_percentiles_interpolate_inside_the_bucket_the_rank_falls_in():
    b = bucket_of(0.05)  # [BOUNDS[b-1], BOUNDS[b])
    lower, upper = BOUNDS[b - 1], BOUNDS[b]
    assert quantile({b: 4}, 0.5) == pytest.approx(lower + (upper - lower) * 0.5)
    # 90 fast, 10 slow: the median is among the fast, p95 half-way through the slow bucket.
    slow = bucket_of(2.0)
    counts = {b: 90, slow: 10}
    assert lower <= quantile(counts, 0.5) < upper
    assert quantile(counts, 0.95) == pytest.approx(BOUNDS[slow - 1] + (BOUNDS[slow] - BOUNDS[slow - 1]) * 0.5)
    assert quantile({len(BOUNDS): 3}, 0.5) == BOUNDS[-1]  # overflow: its lower bound
    assert quantile({}, 0.5) is None


def test_a_percentile_is_within_one_bucket_of_the_exact_one():
    values = [0.003 * 1.07**i for i in range(120)]  # 3 ms to ~10 s
    counts: dict[int, int] = {}
    for v in values:
        counts[bucket_of(v)] = counts.get(bucket_of(v), 0) + 1
    for q in (0.5, 0.95):
        exact = sorted(values)[int(q * len(values)) - 1]
        assert exact / 10 ** (1 / 6) <= quantile(counts, q) <= exact * 10 ** (1 / 6)


# --- kept with the ledger ---------------------------------------------------------------------------------


def test_ledger_rows_fill_buckets_and_outcomes_and_a_duplicate_moves_nothing(sessions):
    events = [
        usage(0, ttft_ms=40, duration_ms=240, output_tokens=11),  # tpot 20 ms
        usage(1, ttft_ms=40, duration_ms=40, output_tokens=1),  # one token: no tpot
        usage(2, ttft_ms=None, duration_ms=5, output_tokens=0, status="failed", error_code="engine_failed"),
        usage(3, ttft_ms=900, duration_ms=1000, output_tokens=3, status="cancelled", key_id=None),
        # On bounds (1 s, 10 ms per token), and a clock that stepped back: the same bucket on every database.
        usage(4, ttft_ms=1000, duration_ms=1010, output_tokens=2, key_id="k-2"),
        usage(5, ttft_ms=-3, duration_ms=-1, output_tokens=2, key_id="k-2"),
    ]
    with sessions() as session:
        assert len(billing.record_events(session, events)) == 6

    def counts():
        with sessions() as session:
            latency = session.execute(
                select(
                    LatencyBucket.metric, LatencyBucket.bucket, LatencyBucket.key_id, LatencyBucket.requests
                )
            ).all()
            outcomes = session.execute(
                select(
                    OutcomeCount.status, OutcomeCount.error_code, func.sum(OutcomeCount.requests)
                ).group_by(OutcomeCount.status, OutcomeCount.error_code)
            ).all()
        return sorted(map(tuple, latency)), sorted((s, c, int(n)) for s, c, n in outcomes)

    latency, outcomes = counts()
    assert latency == sorted(
        [
            ("ttft", bucket_of(0.04), "k-1", 2),
            ("ttft", bucket_of(0.9), billing.NO_KEY, 1),
            ("tpot", bucket_of(0.02), "k-1", 1),
            ("tpot", bucket_of(0.05), billing.NO_KEY, 1),
            ("ttft", bucket_of(1.0), "k-2", 1),
            ("tpot", bucket_of(0.01), "k-2", 1),
            ("ttft", 0, "k-2", 1),
            ("tpot", bucket_of(0.002), "k-2", 1),
        ]
    )
    assert bucket_of(1.0) == BOUNDS.index(1.0) + 1  # a bound opens its bucket
    assert outcomes == [("cancelled", "", 1), ("completed", "", 4), ("failed", "engine_failed", 1)]
    with sessions() as session:  # redelivered, and repeated within the batch
        assert billing.record_events(session, [events[0], events[0], events[2]]) == []
    assert counts() == (latency, outcomes)


def test_the_migration_counts_the_ledger_already_there(database_url, tmp_path):
    """A ledger written before 0008 gets the counts record_events would have kept."""
    events = [
        usage(n, ttft_ms=None if n % 9 == 0 else 7 * n, duration_ms=7 * n + 30 * (n % 4), output_tokens=n % 6)
        for n in range(60)
    ] + [usage(60, ttft_ms=50, duration_ms=70, output_tokens=4, status="failed", error_code="timeout")]
    db.upgrade(database_url, "0007")
    engine = db.make_engine(database_url)
    with db.session_factory(engine)() as session:
        rows = [billing.price_row(e, billing.PriceBook(session)) for e in events]
        for row in rows:
            row.update(invoice_period=row["day"].strftime("%Y-%m"), recorded_at=row["finished_at"])
        session.execute(billing.LedgerEvent.__table__.insert(), rows)
        session.commit()
    db.upgrade(database_url)
    fresh = db.make_engine(f"sqlite:///{tmp_path / 'fresh.db'}")
    db.upgrade(fresh.url)
    reports = []
    for e in (engine, fresh):
        with db.session_factory(e)() as session:
            if e is fresh:
                billing.record_events(session, events)
            reports.append(
                billing.quality_report(session, "t-acme", start=date(2026, 11, 1), end=date(2026, 11, 30))
            )
        e.dispose()
    migrated, recorded = reports
    assert migrated == recorded
    assert migrated[1].samples("ttft") == 54 and migrated[1].errors == {"timeout": 1}


def test_the_migrations_bounds_are_billings():
    spec = importlib.util.spec_from_file_location(
        "m0008", db.MIGRATIONS_DIR / "versions" / "0008_usage_quality.py"
    )
    migration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migration)
    assert migration.BOUNDS == BOUNDS


# --- 429 counters -----------------------------------------------------------------------------------------


@pytest.fixture
def counters(client):
    key = rejections_key(f"tessera:test:quality:{uuid.uuid4().hex}")
    yield key
    client.delete(key, f"{key}:inflight")


def rejected(sessions) -> dict[str, int]:
    with sessions() as session:
        rows = session.execute(
            select(RejectionCount.limit_name, func.sum(RejectionCount.requests)).group_by(
                RejectionCount.limit_name
            )
        ).all()
    return {limit: int(n) for limit, n in rows}


def test_429_counters_move_into_the_database_once(client, sessions, counters):
    day = date(2026, 11, 3)
    client.hincrby(counters, rejection_field("t-acme", day, MODEL, "k-1", "rpm"), 3)
    client.hincrby(counters, rejection_field("t-acme", day, "@m/with|bar", None, "tpm"), 2)
    assert flush_rejections(client, sessions, counters) == 5
    assert rejected(sessions) == {"rpm": 3, "tpm": 2}
    assert not client.exists(counters, f"{counters}:inflight")
    assert flush_rejections(client, sessions, counters) == 0  # nothing new: nothing moves
    client.hincrby(counters, rejection_field("t-acme", day, MODEL, "k-1", "rpm"), 1)
    assert flush_rejections(client, sessions, counters) == 1
    assert rejected(sessions) == {"rpm": 4, "tpm": 2}


def test_a_flush_that_died_after_its_commit_is_not_added_again(client, sessions, counters):
    day = date(2026, 11, 3)
    client.hincrby(counters, rejection_field("t-acme", day, MODEL, "k-1", "concurrency"), 7)

    flusher = redis.Redis.from_url(REDIS_URL)

    def died(*args, **kwargs):
        raise RuntimeError("flusher died")

    def cut_off(session):  # committed; the in-flight batch will not be deleted
        flusher.eval = died

    event.listen(sessions, "after_commit", cut_off)
    with pytest.raises(RuntimeError, match="flusher died"):
        flush_rejections(flusher, sessions, counters)
    event.remove(sessions, "after_commit", cut_off)
    flusher.close()
    assert rejected(sessions) == {"concurrency": 7} and client.exists(f"{counters}:inflight")
    client.hincrby(counters, rejection_field("t-acme", day, MODEL, "k-1", "concurrency"), 1)  # meanwhile
    assert flush_rejections(client, sessions, counters) == 0  # the left-over batch: recognised, dropped
    assert flush_rejections(client, sessions, counters) == 1  # then the live counters
    assert rejected(sessions) == {"concurrency": 8}


def test_a_flush_that_died_before_its_commit_is_added_by_the_next(client, sessions, counters):
    client.hincrby(counters, rejection_field("t-acme", date(2026, 11, 3), MODEL, "k-1", "rpm"), 2)

    def die(session):
        raise RuntimeError("flusher died")

    event.listen(sessions, "before_commit", die)
    with pytest.raises(RuntimeError):
        flush_rejections(client, sessions, counters)
    event.remove(sessions, "before_commit", die)
    assert rejected(sessions) == {}
    assert flush_rejections(client, sessions, counters) == 2
    assert rejected(sessions) == {"rpm": 2}


def test_concurrent_flushers_move_every_429_exactly_once(client, sessions, counters):
    stop = threading.Event()
    errors: list[BaseException] = []

    def flusher() -> None:
        own = redis.Redis.from_url(REDIS_URL)
        while not stop.is_set():
            try:
                flush_rejections(own, sessions, counters)
            except BaseException as exc:  # reported below
                errors.append(exc)
                return
        own.close()

    threads = [threading.Thread(target=flusher) for _ in range(3)]
    for t in threads:
        t.start()
    field = rejection_field("t-acme", date(2026, 11, 3), MODEL, "k-1", "rpm")
    for _ in range(300):  # the gateway's side, while the flushers take batches away
        client.hincrby(counters, field, 1)
    stop.set()
    for t in threads:
        t.join()
    flush_rejections(client, sessions, counters)
    assert errors == [] and rejected(sessions) == {"rpm": 300}


# --- /v1/usage/quality ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(tmp_path_factory, demo_model_dir):
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("quality"),
        redis_url=REDIS_URL,
        secret_key="quality-test-secret-" * 4,
        records_stream=f"tessera:test:quality:{uuid.uuid4().hex}",
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    keys: dict[str, tuple[str, str, str]] = {}
    with sessions() as session:
        deployments.create_deployment(
            session,
            {
                "name": DEPLOYMENT,
                "checkpoint": str(demo_model_dir),
                "max_model_len": 128,
                "max_tokens_limit": 16,
            },
            actor="test",
        )
        for name in ("acme", "globex"):
            tenant = tenancy.create_tenant(session, name)
            key, raw = tenancy.create_key(session, name)
            keys[name] = (tenant.id, key.id, raw)
        tenancy.create_tenant(session, "ops")
        _, admin_raw = tenancy.create_key(session, "ops", scopes=(SCOPE_ADMIN,))
    keys["admin"] = ("", "", admin_raw)
    auth.key_cache.clear()
    with TestClient(create_app(settings)) as test_client:
        yield test_client, sessions, keys, settings
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(settings.records_stream, rejections_key(settings.records_stream))
    client.delete(*(workers_key(DEPLOYMENT, pool) for pool in ("prefill", "decode", "serve")))


def bearer(raw: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {raw}"}


def test_quality_per_day_and_in_total_for_the_callers_tenant_only(api):
    test_client, sessions, keys, _ = api
    acme, _, acme_raw = keys["acme"]
    globex, _, globex_raw = keys["globex"]
    events = []
    for n in range(40):  # acme: two days, ttft 20 ms or (every 10th) 3 s; globex: all 900 ms
        day = 1 + n % 2
        started = datetime(2026, 10, day, 9, tzinfo=timezone.utc) + timedelta(seconds=n)
        ttft = 3.0 if n % 10 == 0 else 0.02
        failed = n % 8 == 7
        for tenant, t in ((acme, ttft), (globex, 0.9)):
            events.append(
                UsageEvent(
                    request_id=f"{tenant}-{n}",
                    tenant_id=tenant,
                    key_id=None,
                    deployment=MODEL,
                    model=MODEL,
                    status="failed" if failed else "completed",
                    error_code="timeout" if failed else None,
                    prompt_tokens=5,
                    output_tokens=6,
                    started_at=started,
                    first_token_at=started + timedelta(seconds=t),
                    finished_at=started + timedelta(seconds=t + 0.05),  # 10 ms per token after the first
                )
            )
    with sessions() as session:
        billing.record_events(session, events)
    params = {"start": "2026-10-01", "end": "2026-10-31"}
    body = test_client.get("/v1/usage/quality", params=params, headers=bearer(acme_raw)).json()
    total = body["total"]
    assert total["requests"] == 40 and total["by_status"] == {"completed": 35, "failed": 5}
    assert total["errors"] == {"timeout": 5} and total["rejected"] == 0
    acme_ttft = {bucket_of(0.02): 36, bucket_of(3.0): 4}
    assert total["ttft"] == {
        "samples": 40,
        "p50_s": pytest.approx(quantile(acme_ttft, 0.5)),
        "p95_s": pytest.approx(quantile(acme_ttft, 0.95)),
    }
    assert BOUNDS[bucket_of(0.02) - 1] <= total["ttft"]["p50_s"] < BOUNDS[bucket_of(0.02)]
    assert BOUNDS[bucket_of(3.0) - 1] <= total["ttft"]["p95_s"] < BOUNDS[bucket_of(3.0)]
    assert BOUNDS[bucket_of(0.01) - 1] <= total["tpot"]["p50_s"] < BOUNDS[bucket_of(0.01)]
    assert [d["day"] for d in body["data"]] == ["2026-10-01", "2026-10-02"]
    assert [d["requests"] for d in body["data"]] == [20, 20]
    assert sum(d["by_status"].get("failed", 0) for d in body["data"]) == 5
    theirs = test_client.get("/v1/usage/quality", params=params, headers=bearer(globex_raw)).json()
    assert BOUNDS[bucket_of(0.9) - 1] <= theirs["total"]["ttft"]["p95_s"] < BOUNDS[bucket_of(0.9)]
    other_model = test_client.get(
        "/v1/usage/quality", params={**params, "model": "@m/none"}, headers=bearer(acme_raw)
    ).json()
    assert other_model["total"]["requests"] == 0 and other_model["total"]["ttft"]["p50_s"] is None
    admin = test_client.get(
        "/admin/usage/quality", params={**params, "tenant": "globex"}, headers=bearer(keys["admin"][2])
    ).json()
    assert admin["total"] == theirs["total"]
    everyone = test_client.get("/admin/usage/quality", params=params, headers=bearer(keys["admin"][2]))
    assert everyone.json()["total"]["requests"] == 80


def test_bad_ranges_are_400_and_the_admin_twin_is_admin_only(api):
    test_client, _, keys, _ = api
    raw = keys["acme"][2]
    response = test_client.get(
        "/v1/usage/quality", params={"start": "2026-10-05", "end": "2026-10-01"}, headers=bearer(raw)
    )
    assert response.status_code == 400 and "after end" in response.json()["error"]["message"]
    response = test_client.get(
        "/v1/usage/quality", params={"start": "2024-01-01", "end": "2026-10-01"}, headers=bearer(raw)
    )
    assert response.status_code == 400 and "366 days" in response.json()["error"]["message"]
    response = test_client.get("/v1/usage/quality", params={"start": "yesterday"}, headers=bearer(raw))
    assert response.status_code == 400 and "start" in response.text
    assert test_client.get("/admin/usage/quality", headers=bearer(raw)).status_code == 403
    assert test_client.get("/v1/usage/quality").status_code == 401
    missing = test_client.get(
        "/admin/usage/quality", params={"tenant": "nobody"}, headers=bearer(keys["admin"][2])
    )
    assert missing.status_code == 404
    schema = test_client.get("/openapi.json").json()
    ok = schema["paths"]["/v1/usage/quality"]["get"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"]["$ref"].endswith("/QualityReport")
    assert "rejected_by_limit" in schema["components"]["schemas"]["QualityStats"]["properties"]


def test_a_429_from_the_gateway_shows_by_its_limit(api):
    test_client, sessions, keys, settings = api
    tenant_id, _, raw = keys["globex"]
    with sessions() as session:
        quota_config.set_limits(session, "globex", Limits(rpm=1))
    time.sleep(quota_config.CACHE_TTL_S + 0.1)  # the gateway's limits cache
    body = {"model": DEPLOYMENT, "prompt": [1, 2, 3], "max_tokens": 2}
    first = test_client.post("/v1/completions", json=body, headers=bearer(raw))
    assert first.status_code == 503  # admitted (the minute's one request), then no worker is live
    second = test_client.post("/v1/completions", json=body, headers=bearer(raw))
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
    got = wait_rejected(test_client, raw)
    today = datetime.now(timezone.utc).date().isoformat()
    assert got["total"]["rejected_by_limit"] == {"rpm": 1}
    assert got["data"][0]["day"] == today and got["data"][0]["rejected"] == 1
    acme = test_client.get(
        "/v1/usage/quality", params={"start": today, "end": today}, headers=bearer(keys["acme"][2])
    ).json()
    assert acme["total"]["rejected"] == 0


def wait_rejected(test_client, raw: str) -> dict:
    today = datetime.now(timezone.utc).date().isoformat()
    deadline = time.monotonic() + 30
    while True:  # the app's consumer moves the counters every second
        got = test_client.get(
            "/v1/usage/quality", params={"start": today, "end": today}, headers=bearer(raw)
        ).json()
        if got["total"]["rejected"] or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_a_busy_model_refusing_with_429_counts_as_capacity(api):
    test_client, sessions, _, settings = api
    name = f"busy-{uuid.uuid4().hex[:6]}"
    with sessions() as session:
        tenancy.create_tenant(session, name)
        _, raw = tenancy.create_key(session, name)
    client = redis.Redis.from_url(REDIS_URL)
    queues = []
    for pool in ("prefill", "decode", "serve"):  # live workers whose queues are full
        worker = f"{pool}-{uuid.uuid4().hex[:6]}"
        info = WorkerInfo(
            worker_id=worker,
            deployment=DEPLOYMENT,
            pool=pool,
            queue=worker_queue(worker),
            host="test",
            pid=1,
            last_seen=time.time() + 60,
        )
        client.hset(workers_key(DEPLOYMENT, pool), worker, info.to_json())
        client.rpush(worker_queue(worker), *["waiting"] * settings.max_queue_depth)
        queues.append(worker_queue(worker))
    try:
        response = test_client.post(
            "/v1/completions",
            json={"model": DEPLOYMENT, "prompt": [1, 2, 3], "max_tokens": 2},
            headers={**bearer(raw), "x-reject-if-busy": "true"},
        )
    finally:
        client.delete(*queues, *(workers_key(DEPLOYMENT, pool) for pool in ("prefill", "decode", "serve")))
    assert response.status_code == 429 and response.json()["error"]["code"] == "out_of_capacity"
    assert wait_rejected(test_client, raw)["total"]["rejected_by_limit"] == {"capacity": 1}
