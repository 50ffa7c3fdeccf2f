"""``tessera bench usage``: billing at scale on PostgreSQL.

In a scratch database of its own (created on the given server, dropped after), it first times the usage
routes of a real ``tessera api`` process on an empty ledger (the baseline), then seeds ``rows`` ledger rows
and their rollups in the server (three months, ``tenants`` tenants, the first of them with a quarter of the
rows), and times the same routes again: ``GET /v1/usage`` for a month grouped by day, the first page of
``/v1/usage/requests``, the month's draft invoice and ``/metrics`` (every tenant's usage counters, summed from
the rollups at each scrape). Last, ingestion: outcome events put on a Redis Stream
in the gateway's format are charged by a ``BillingConsumer`` through the real ledger insert path, events/s.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import date, datetime, timedelta, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tessera.bench import BenchError
from tessera.bench.console import print_report, progress
from tessera.bench.gateway_harness import TESSERA, _free_port, _spawn, _stop, _wait_ready
from tessera.bench.stats import quantile, spread

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
MONTHS = ("2026-09", "2026-10", "2026-11")  # seeded; the routes are timed on the last
MEASURED = MONTHS[-1]
MODELS = ("@tessera/pycode-tiny", "@bench/a", "@bench/b", "@bench/c")
KEYS_PER_TENANT = 10


def run_usage(
    rows: int,
    tenants: int,
    requests: int,
    events: int,
    repeat: int,
    batches: list[int],
    postgres_url: str | None,
    redis_url: str | None,
    as_json: bool,
) -> None:
    """Measure, print the report (a table, or JSON)."""
    load_before = os.getloadavg()[0]
    measured = measure(rows, tenants, requests, events, repeat, batches, postgres_url, redis_url)
    report = {
        "bench": "usage",
        "date": date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core CPU, Python {sys.version.split()[0]}, PostgreSQL "
        f"(psycopg {version('psycopg')}), SQLAlchemy {version('sqlalchemy')}",
        "settings": {
            "rows": rows,
            "tenants": tenants,
            "requests_per_route": requests,
            "events_per_repeat": events,
            "repeat": repeat,
            "consumer_batches": batches,
            "month": MEASURED,
        },
        # The machine may be shared: its 1-minute load average before and after the run.
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        **measured,
    }
    print_report(report, as_json, _tables)


def measure(
    rows: int,
    tenants: int,
    requests: int,
    events: int,
    repeat: int,
    batches: list[int],
    postgres_url: str | None,
    redis_url: str | None,
) -> dict[str, Any]:
    """The report's measurements (``run_usage`` without the printing; tests call this)."""
    import redis

    from gpu_workers.protocol import connect_redis
    from tessera import db, tenancy
    from tessera.models import SCOPE_ADMIN

    redis_url = redis_url or os.environ.get("TESSERA_REDIS_URL") or "redis://127.0.0.1:6379/0"
    client = connect_redis(redis_url, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        raise BenchError(f"can't reach Redis at {redis_url} ({exc}); start it or pass --redis-url") from None
    with scratch_database(postgres_url or DEFAULT_POSTGRES_URL) as url, progress(5) as advance:
        db.upgrade(url)
        engine = db.make_engine(url)
        sessions = db.session_factory(engine)
        ids = [f"t{n:04d}{secrets.token_hex(6)}" for n in range(tenants)]
        with sessions() as session:
            tenant = tenancy.create_tenant(session, "bench-0")
            ids[0] = tenant.id
            _, key = tenancy.create_key(session, "bench-0")
            tenancy.create_tenant(session, "bench-ops")
            _, admin_key = tenancy.create_key(session, "bench-ops", scopes=(SCOPE_ADMIN,))
        with serving(url, redis_url) as base:
            baseline = time_routes(base, key, requests, admin_key)
            advance()
            started = time.perf_counter()
            seeded = seed(engine, ids, rows)
            seed_s = time.perf_counter() - started
            advance()
            scaled = time_routes(base, key, requests, admin_key)
            advance()
        with sessions() as session:
            import billing

            started = time.perf_counter()
            check = billing.reconcile(session, MEASURED, tenant_id=ids[0])
            reconcile_s = time.perf_counter() - started
        advance()
        ingestion = ingest(client, sessions, ids, events, repeat, batches)
        advance()
        engine.dispose()
    client.close()
    routes = {
        name: {
            "empty_ledger": baseline[name],
            "seeded": scaled[name],
            "p95_ratio": round(scaled[name]["p95_ms"] / baseline[name]["p95_ms"], 2),
        }
        for name in scaled
    }
    return {
        "seeded": {**seeded, "seconds": round(seed_s, 1)},
        "routes": routes,
        "reconcile": {
            "tenant_rows_in_month": check.used_events,
            "ok": check.ok,
            "seconds": round(reconcile_s, 3),
        },
        "ingestion": ingestion,
    }


@contextlib.contextmanager
def scratch_database(server_url: str) -> Iterator[str]:
    """A new, empty database on ``server_url``'s server, dropped afterwards."""
    try:
        import psycopg
    except ImportError:
        raise BenchError("the usage bench needs psycopg: pip install 'tessera[postgres]'") from None

    from tessera import db

    name = f"tessera_bench_{secrets.token_hex(6)}"
    try:
        admin = psycopg.connect(server_url, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        raise BenchError(
            f"can't reach PostgreSQL at {db.redact(server_url)} ({str(exc).strip()}); pass --postgres-url"
        ) from None
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield db.normalize_url(server_url).set(database=name).render_as_string(hide_password=False)
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def serving(database_url: str, redis_url: str) -> Iterator[str]:
    """``tessera api`` on a free port over ``database_url``; yields its base URL."""
    with tempfile.TemporaryDirectory(prefix="tessera-bench-usage-") as tmp:
        data = Path(tmp)
        env = {
            **os.environ,
            "TESSERA_DATA_DIR": str(data),
            "TESSERA_DATABASE_URL": database_url,
            "TESSERA_REDIS_URL": redis_url,
            "TESSERA_RECORDS_STREAM": f"tessera:bench:usage:{secrets.token_hex(4)}",
        }
        port = _free_port()
        api = _spawn("api", [*TESSERA, "api", "--host", "127.0.0.1", "--port", str(port)], env, data)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ready([api], "GET", f"{base}/healthz")
            yield base
        finally:
            _stop([api])


def time_routes(base: str, key: str, requests: int, admin_key: str) -> dict[str, dict[str, float]]:
    """p50 / p95 / max latency of each route over ``requests`` sequential calls (after 10 unmeasured);
    ``/metrics`` (its usage counters summed from every tenant's rollups) with the admin key."""
    import httpx

    first, last = f"{MEASURED}-01", f"{MEASURED}-30"
    routes = {
        "usage_month_by_day": ("/v1/usage", {"start": first, "end": last, "group_by": "day"}),
        "usage_requests_page": ("/v1/usage/requests", {"start": first, "end": last, "limit": 100}),
        "invoice_draft": (f"/v1/invoices/{MEASURED}", {}),
        "healthz": ("/healthz", {}),
        "metrics": ("/metrics", {}),
    }
    headers = {"Authorization": f"Bearer {key}"}
    admin = {"Authorization": f"Bearer {admin_key}"}
    out = {}
    with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
        for name, (path, params) in routes.items():
            latencies = []
            for n in range(10 + requests):
                started = time.perf_counter()
                response = client.get(path, params=params, headers=admin if name == "metrics" else None)
                elapsed = time.perf_counter() - started
                if response.status_code not in (200, 404):  # 404: no invoice yet, on the empty ledger
                    raise BenchError(f"GET {path} answered {response.status_code}: {response.text[:300]}")
                if n >= 10:
                    latencies.append(elapsed)
            out[name] = {
                "p50_ms": round(1e3 * quantile(latencies, 0.5), 2),
                "p95_ms": round(1e3 * quantile(latencies, 0.95), 2),
                "max_ms": round(1e3 * max(latencies), 2),
            }
    return out


def seed(engine: Any, tenant_ids: list[str], rows: int) -> dict[str, int]:
    """Generate ``rows`` priced ledger rows over MONTHS in the server (one INSERT ... SELECT over
    generate_series: nothing crosses the wire per row), then their rollups, invoice sums and draft invoices from them."""
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    import billing
    from billing.invoices import period_days

    with Session(engine) as session:
        book = billing.PriceBook(session)
        prices = [(model, book.at(model, datetime(2026, 9, 1, tzinfo=timezone.utc))) for model in MODELS]
    first, _ = period_days(MONTHS[0])
    _, last = period_days(MONTHS[-1])
    values = ", ".join(
        f"({n}, '{model}', {p.id}, {p.cached_input_per_mtok}, {p.fresh_input_per_mtok}, {p.output_per_mtok})"
        for n, (model, p) in enumerate(prices)
    )
    # The rounding rule of billing.prices, in SQL: (tokens * price + 500000) / 1000000 on bigints.
    half_up = "(({t})::bigint * p.{price}_price + 500000) / 1000000"
    ledger = f"""
        INSERT INTO billing_ledger (request_id, tenant_id, key_id, deployment, model, status, error_code,
            cached_input_tokens, fresh_input_tokens, output_tokens, price_id, cached_input_cost,
            fresh_input_cost, output_cost, cost, ttft_s, duration_s, started_at, finished_at, day,
            recorded_at, invoice_period)
        SELECT 'bench-' || lpad(g::text, 9, '0'), (CAST(:tenants AS text[]))[t + 1],
            'k' || lpad(t::text, 4, '0') || '_' || k, p.model, p.model, 'completed', NULL,
            r.cached, r.prompt - r.cached, r.output, p.price_id,
            {half_up.format(t="r.cached", price="cached")}, {half_up.format(t="r.prompt - r.cached", price="fresh")},
            {half_up.format(t="r.output", price="output")},
            {half_up.format(t="r.cached", price="cached")} + {half_up.format(t="r.prompt - r.cached", price="fresh")}
                + {half_up.format(t="r.output", price="output")},
            0.05, 0.5, finished, finished, day, finished, to_char(day, 'YYYY-MM')
        FROM (
            SELECT g, t, k, m, day, (day::timestamp + s * interval '1 second') AT TIME ZONE 'UTC' AS finished,
                prompt, CASE WHEN half THEN floor(random() * prompt)::int ELSE 0 END AS cached, output
            FROM (
                SELECT g,
                    CASE WHEN :others = 0 OR random() < 0.25 THEN 0
                         ELSE 1 + floor(random() * :others)::int END AS t,
                    floor(random() * {KEYS_PER_TENANT})::int AS k,
                    floor(random() * {len(MODELS)})::int AS m,
                    CAST(:first AS date) + floor(random() * :days)::int AS day,
                    floor(random() * 86400)::int AS s,
                    16 + floor(random() * 4080)::int AS prompt,
                    random() < 0.5 AS half,
                    1 + floor(random() * 511)::int AS output
                FROM generate_series(0, :rows - 1) AS g
            ) AS draw
        ) AS r
        JOIN (VALUES {values}) AS p(m, model, price_id, cached_price, fresh_price, output_price) ON p.m = r.m
    """
    indexes = list(billing.LedgerEvent.__table__.indexes)  # built once after the rows: faster than kept up
    with engine.begin() as conn:
        for index in indexes:
            index.drop(conn)
        conn.execute(text("SELECT setseed(0)"))
        conn.execute(
            text(ledger),
            {
                "tenants": tenant_ids,
                "others": len(tenant_ids) - 1,
                "first": first,
                "days": (last - first).days + 1,
                "rows": rows,
            },
        )
        conn.execute(
            text(
                "INSERT INTO billing_rollups SELECT tenant_id, day, model, coalesce(key_id, ''), count(*), "
                "sum(cached_input_tokens), sum(fresh_input_tokens), sum(output_tokens), sum(cost) "
                "FROM billing_ledger GROUP BY tenant_id, day, model, coalesce(key_id, '')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO billing_invoice_sums SELECT tenant_id, invoice_period, to_char(day, 'YYYY-MM'), "
                "model, coalesce(price_id, 0), count(*), sum(cached_input_tokens), sum(fresh_input_tokens), "
                "sum(output_tokens), sum(cached_input_cost), sum(fresh_input_cost), sum(output_cost) "
                "FROM billing_ledger GROUP BY 1, 2, 3, 4, 5"
            )
        )
        conn.execute(
            text(
                "INSERT INTO billing_invoices (tenant_id, period, status, created_at) "
                "SELECT DISTINCT tenant_id, invoice_period, 'draft', now() FROM billing_ledger"
            )
        )
        rollups = conn.scalar(text("SELECT count(*) FROM billing_rollups"))
        for index in indexes:
            index.create(conn)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE"))
    return {"ledger_rows": rows, "rollup_rows": rollups, "tenants": len(tenant_ids)}


def ingest(
    redis: Any, sessions: Any, tenant_ids: list[str], events: int, repeat: int, batches: list[int]
) -> dict:
    """Per consumer batch size: ``events`` new outcomes per repeat, put on a Redis Stream the way the gateway
    does and charged by ``BillingConsumer.drain`` (its real insert path); events/s and the consumer's own
    CPU per event (what a busy machine does not inflate), median [min, max] over the repeats."""
    from billing import BillingConsumer
    from billing.consumer import OUTCOME_FIELD

    out = {}
    rng = random.Random(1)
    for batch in batches:
        rates, cpu = [], []
        for r in range(repeat):
            stream = f"tessera:bench:usage:ingest:{secrets.token_hex(4)}"
            try:
                pipe = redis.pipeline(transaction=False)
                now = datetime.now(timezone.utc)
                for n in range(events):
                    prompt = rng.randrange(16, 4096)
                    outcome = {
                        "request_id": f"ingest-{batch}-{r}-{n:08d}-{secrets.token_hex(3)}",
                        "tenant_id": tenant_ids[n % len(tenant_ids)],
                        "key_id": f"k{n % len(tenant_ids):04d}_{n % KEYS_PER_TENANT}",
                        "deployment": MODELS[n % len(MODELS)],
                        "model": MODELS[n % len(MODELS)],
                        "status": "completed",
                        "prompt_tokens": prompt,
                        "cached_tokens": prompt // 2,
                        "output_tokens": rng.randrange(1, 512),
                        "started_at": (now - timedelta(seconds=1)).isoformat(),
                        "first_token_at": None,
                        "finished_at": now.isoformat(),
                    }
                    pipe.xadd(stream, {OUTCOME_FIELD: json.dumps(outcome)})
                    if n % 1000 == 999:
                        pipe.execute()
                pipe.execute()
                consumer = BillingConsumer(redis, sessions, stream, batch=batch)
                started, cpu_started = time.perf_counter(), time.process_time()
                consumer.drain()
                elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
                if consumer.charged != events:
                    raise BenchError(f"the consumer charged {consumer.charged} of {events} events")
                rates.append(events / elapsed)
                cpu.append(1e6 * cpu_s / events)
            finally:
                redis.delete(stream)
        out[str(batch)] = {"events_per_s": spread(rates), "consumer_cpu_us_per_event": spread(cpu)}
    return out


def _tables(report: dict) -> list:
    from rich.table import Table

    s, seeded = report["settings"], report["seeded"]
    routes = Table(
        title=f"GET routes of `tessera api` on PostgreSQL for tenant bench-0, month {s['month']}: an empty "
        f"ledger vs {seeded['ledger_rows']:,} ledger rows ({seeded['rollup_rows']:,} rollup rows, "
        f"{seeded['tenants']} tenants), {s['requests_per_route']} sequential requests each"
    )
    for column in ("route", "empty p50 ms", "empty p95 ms", "seeded p50 ms", "seeded p95 ms", "p95 ratio"):
        routes.add_column(column, justify="left" if column == "route" else "right")
    for name, values in report["routes"].items():
        empty, full = values["empty_ledger"], values["seeded"]
        routes.add_row(
            name,
            f"{empty['p50_ms']:.2f}",
            f"{empty['p95_ms']:.2f}",
            f"{full['p50_ms']:.2f}",
            f"{full['p95_ms']:.2f}",
            f"{values['p95_ratio']:.2f}",
        )
    ingestion = Table(
        title=f"ingestion: {s['events_per_repeat']:,} outcomes per repeat on a Redis Stream charged by "
        f"BillingConsumer into the seeded ledger, median [min, max] of {s['repeat']} repeats"
    )
    for column in ("consumer batch", "events/s", "consumer CPU us/event"):
        ingestion.add_column(column, justify="right")
    for batch, values in report["ingestion"].items():
        rate, cpu = values["events_per_s"], values["consumer_cpu_us_per_event"]
        ingestion.add_row(
            batch,
            f"{rate['median']:,.0f} [{rate['min']:,.0f}, {rate['max']:,.0f}]",
            f"{cpu['median']:,.0f} [{cpu['min']:,.0f}, {cpu['max']:,.0f}]",
        )
    check = report["reconcile"]
    notes = (
        f"load average {report['load_average'][0]} before, {report['load_average'][1]} after; seeded in {seeded['seconds']} s (INSERT ... SELECT in the server); reconcile of bench-0's {check['tenant_rows_in_month']:,} "
        f"events in {s['month']}: {'ok' if check['ok'] else 'MISMATCH'} in {check['seconds']} s"
    )
    return [routes, ingestion, notes]
