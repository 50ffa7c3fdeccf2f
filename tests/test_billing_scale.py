"""``tessera bench usage`` at a small size: its seeded ledger agrees with its rollups and invoices (reconcile),
the routes it times answer, and every ingested event is charged once. Speed is the bench's report, not a
test's assertion. Real PostgreSQL (a scratch database the bench creates and drops), real Redis, a real
``tessera api`` process."""

from __future__ import annotations

import pytest
import test_db
from sqlalchemy import text
from tessera import db
from tessera.bench import usage
from tessera.cli import main

import billing

postgres_admin = test_db.postgres_admin


def test_the_bench_seeds_a_consistent_ledger_and_charges_every_event(postgres_admin):
    before = {r[0] for r in postgres_admin.execute("SELECT datname FROM pg_database")}
    report = usage.measure(
        rows=3000,
        tenants=4,
        requests=3,
        events=300,
        repeat=1,
        batches=[50, 300],
        postgres_url=test_db.POSTGRES_URL,
        redis_url=None,
    )
    assert report["seeded"]["ledger_rows"] == 3000 and report["seeded"]["tenants"] == 4
    assert 0 < report["seeded"]["rollup_rows"] <= 3000
    # bench-0 holds about a quarter of three months: some hundreds of rows in the month, all reconciled.
    assert report["reconcile"]["ok"] and 100 < report["reconcile"]["tenant_rows_in_month"] < 600
    assert set(report["routes"]) == {
        "usage_month_by_day",
        "usage_requests_page",
        "invoice_draft",
        "healthz",
        "metrics",
    }
    for route in report["routes"].values():
        assert 0 < route["seeded"]["p50_ms"] <= route["seeded"]["p95_ms"] <= route["seeded"]["max_ms"]
    assert set(report["ingestion"]) == {"50", "300"}  # measure() raises unless each charged all 300
    assert all(v["events_per_s"]["median"] > 0 for v in report["ingestion"].values())
    after = {r[0] for r in postgres_admin.execute("SELECT datname FROM pg_database")}
    assert after == before  # the scratch database is gone


def test_the_bench_cli_refuses_bad_flags_and_an_unreachable_server(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["bench", "usage", "--batches", "x"])
    assert refused.value.code == 2
    assert main(["bench", "usage", "--rows", "0"]) == 2
    assert "--rows" in capsys.readouterr().err
    code = main(["bench", "usage", "--rows", "10", "--postgres-url", "postgresql://nobody@127.0.0.1:1/none"])
    assert code == 1 and "can't reach PostgreSQL" in capsys.readouterr().err


def test_the_seeded_costs_follow_the_rounding_rule(postgres_admin):
    with usage.scratch_database(test_db.POSTGRES_URL) as url:
        db.upgrade(url)
        engine = db.make_engine(url)
        usage.seed(engine, ["tenant-a", "tenant-b"], 500)
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT l.cached_input_tokens, l.fresh_input_tokens, l.output_tokens, l.cached_input_cost, "
                    "l.fresh_input_cost, l.output_cost, l.cost, p.cached_input_per_mtok, "
                    "p.fresh_input_per_mtok, p.output_per_mtok "
                    "FROM billing_ledger l JOIN billing_prices p ON p.id = l.price_id"
                )
            ).all()
        engine.dispose()
    assert len(rows) == 500
    for cached, fresh, output, c_cost, f_cost, o_cost, cost, c_price, f_price, o_price in rows:
        assert (c_cost, f_cost, o_cost) == (
            billing.amount(cached, c_price),
            billing.amount(fresh, f_price),
            billing.amount(output, o_price),
        )
        assert cost == c_cost + f_cost + o_cost
