"""Invoices: lines per model × token kind × price version equal the ledger to the micro-USD; a period stays a
draft through its grace window, is then final and never changes; later events of that month are adjustment
lines on the next open invoice; ``reconcile`` catches a tampered rollup, a tampered invoice and a request
without a ledger event; the API shows a tenant only its own invoices (404 for others') and admins anyone's.

Real SQLite and PostgreSQL (the fixtures of test_db / test_billing), real Redis for the app.
"""

from __future__ import annotations

import json
import threading
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import redis
import test_billing
import test_db
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text, update
from tessera import auth, db, tenancy
from tessera.app import create_app
from tessera.cli import main
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE
from tessera.records import settle_records
from tessera.settings import Settings
from test_billing import DEFAULT, MODEL, REDIS_URL, event, expected_cost, outcome

import billing
from billing import LedgerEvent, PriceSpec, Rollup

postgres_admin = test_db.postgres_admin
postgres_url = test_db.postgres_url
database_url = test_db.database_url
migrated_sqlite_file = test_db.migrated_sqlite_file
migrated_postgres_url = test_db.migrated_postgres_url
migrated_url = test_db.migrated_url
url = test_billing.url
sessions = test_billing.sessions
caller = test_billing.caller

UTC = timezone.utc
NOV = "2026-11"
GRACE = billing.DEFAULT_GRACE  # three days: November closes on 2026-12-04 00:00 UTC


def at(day: int, hour: int = 12, month: int = 11) -> datetime:
    return datetime(2026, month, day, hour, tzinfo=UTC)


def used(caller, n: int, when: datetime, **changes):
    """An outcome that finished at ``when``."""
    return outcome(
        caller, n, started_at=when - timedelta(seconds=1), first_token_at=None, finished_at=when, **changes
    )


def record(session, outcomes, now: datetime) -> list[dict]:
    return billing.record_events(session, [event(o) for o in outcomes], now=now)


def ledger_sums(session, tenant_id: str, period: str) -> dict[str, int]:
    e = LedgerEvent
    row = session.execute(
        select(
            func.sum(e.cached_input_tokens),
            func.sum(e.fresh_input_tokens),
            func.sum(e.output_tokens),
            func.sum(e.cached_input_cost),
            func.sum(e.fresh_input_cost),
            func.sum(e.output_cost),
            func.sum(e.cost),
        ).where(e.tenant_id == tenant_id, e.invoice_period == period)
    ).one()
    names = ("cached_q", "fresh_q", "output_q", "cached_a", "fresh_a", "output_a", "cost")
    return {n: int(v or 0) for n, v in zip(names, row, strict=True)}


def invoice_sums(view: billing.InvoiceView) -> dict[str, int]:
    sums = dict.fromkeys(("cached_q", "fresh_q", "output_q", "cached_a", "fresh_a", "output_a"), 0)
    for line in view.lines:
        short = line.kind.split("_")[0]
        sums[f"{short}_q"] += line.quantity
        sums[f"{short}_a"] += line.amount
    return {**sums, "cost": view.total}


def snapshot(view: billing.InvoiceView) -> tuple:
    return (view.status, view.finalized_at, view.total, tuple(view.lines))


# --- lines, drafts, finalisation -------------------------------------------------------------------------


def test_invoice_lines_equal_the_ledger_per_model_kind_and_price_version(sessions, caller):
    new = PriceSpec(fresh_input=950_000, cached_input=160_000, output=4_000_000)
    with sessions() as session:
        billing.set_price(session, MODEL, new, effective_from=at(15, 0))
        made = [used(caller, n, at(1 + n % 28), model=[MODEL, "@m/b"][n % 2]) for n in range(60)]
        record(session, made, now=at(29))
        view = billing.get_invoice(session, caller[0], NOV, now=at(29))
        assert view.status == "draft" and view.closes_at == datetime(2026, 12, 4, tzinfo=UTC)
        assert invoice_sums(view) == ledger_sums(session, caller[0], NOV)
    want = sum(
        expected_cost(o, new if (o.model == MODEL and o.started_at >= at(15, 0)) else DEFAULT) for o in made
    )
    assert view.total == view.subtotal == want and view.adjustments == []
    # One line per model × price version × kind; quantities are the tokens, unit prices the version's.
    keys = [(line.model, line.price_version, line.kind) for line in view.lines]
    assert len(keys) == len(set(keys)) == 3 * 3  # MODEL v1, MODEL v2, "@m/b" priced by "*" v1
    for line in view.lines:
        spec = new if (line.model, line.price_version) == (MODEL, 2) else DEFAULT
        assert line.unit_price_per_mtok == getattr(spec, line.kind)
        mine = [
            o
            for o in made
            if o.model == line.model
            and ((o.started_at >= at(15, 0)) == (line.price_version == 2) or o.model != MODEL)
        ]
        tokens = {"cached_input": "cached_tokens", "fresh_input": "fresh_tokens", "output": "output_tokens"}
        assert line.quantity == sum(getattr(o, tokens[line.kind]) for o in mine)
        assert line.requests == len(mine)


def test_a_final_invoice_never_changes_and_late_usage_is_an_adjustment_next_period(sessions, caller):
    tenant = caller[0]
    with sessions() as session:
        record(session, [used(caller, n, at(10 + n)) for n in range(10)], now=at(25))
        # In the grace window: still a draft, and November's late usage still lands on it.
        assert billing.get_invoice(session, tenant, NOV, now=at(2, month=12)).status == "draft"
        (late,) = record(session, [used(caller, 50, at(30, 23))], now=at(3, month=12))
        assert late["invoice_period"] == NOV
        # The window is over: the first read finalises it.
        final = billing.get_invoice(session, tenant, NOV, now=at(4, 1, month=12))
        assert final.status == "final" and final.finalized_at == at(4, 1, month=12)
        assert (
            final.total == sum(expected_cost(used(caller, n, at(10 + n))) for n in range(10)) + late["cost"]
        )
        # Later November usage goes on December's invoice, naming November.
        later = [used(caller, 60, at(30, 23)), used(caller, 61, at(29, 8))]
        rows = record(session, later, now=at(5, month=12))
        assert {r["invoice_period"] for r in rows} == {"2026-12"}
        record(session, [used(caller, 70, at(5, month=12))], now=at(5, month=12))
        assert snapshot(billing.get_invoice(session, tenant, NOV, now=at(20, month=12))) == snapshot(final)
        december = billing.get_invoice(session, tenant, "2026-12", now=at(20, month=12))
        assert december.status == "draft"
        assert {line.usage_period for line in december.adjustments} == {NOV}
        assert sum(line.amount for line in december.adjustments) == sum(r["cost"] for r in rows)
        assert december.subtotal == expected_cost(used(caller, 70, at(5, month=12)))
        assert invoice_sums(december) == ledger_sums(session, tenant, "2026-12")
        # Usage by day still counts the late events on their own days; everything reconciles.
        nov_rollups = session.scalar(select(func.sum(Rollup.requests)).where(Rollup.tenant_id == tenant))
        assert nov_rollups == 14
        for period in (NOV, "2026-12"):
            result = billing.reconcile(session, period, now=at(20, month=12))
            assert result.ok, result.mismatches
        assert billing.reconcile(session, NOV, now=at(20, month=12)).used_events == 13


def test_an_invoice_finalised_early_by_another_clock_sends_later_events_to_the_next(sessions, caller):
    with sessions() as session:
        record(session, [used(caller, 1, at(2, month=12))], now=at(2, month=12))
        assert billing.finalize(session, caller[0], "2026-12", now=at(2, month=12))
        assert not billing.finalize(session, caller[0], "2026-12")  # once only
        (row,) = record(session, [used(caller, 2, at(3, month=12))], now=at(3, month=12))
    assert row["invoice_period"] == "2027-01"


def test_events_racing_finalisation_are_each_on_exactly_one_invoice(url, caller):
    engine = db.make_engine(url)
    sessions = db.session_factory(engine)
    batches = [[used(caller, 100 * w + n, at(1 + n % 28)) for n in range(40)] for w in range(4)]
    barrier = threading.Barrier(5)
    errors: list[BaseException] = []

    def insert(batch) -> None:
        try:
            with sessions() as session:
                barrier.wait()
                for start in range(0, len(batch), 5):  # many small transactions
                    record(session, batch[start : start + 5], now=at(1, month=12))
        except BaseException as exc:
            errors.append(exc)

    def close() -> None:
        try:
            with sessions() as session:
                record(session, [used(caller, 9999, at(1))], now=at(1, month=12))
                barrier.wait()
                billing.finalize(session, caller[0], NOV, now=at(1, month=12))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=insert, args=(b,)) for b in batches] + [threading.Thread(target=close)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(LedgerEvent)) == 161
        nov = billing.get_invoice(session, caller[0], NOV, now=at(2, month=12))
        dec = billing.get_invoice(session, caller[0], "2026-12", now=at(2, month=12))
        assert nov.status == "final"
        assert nov.total + dec.total == session.scalar(select(func.sum(LedgerEvent.cost)))
        assert invoice_sums(nov) == ledger_sums(session, caller[0], NOV)
        for period in (NOV, "2026-12"):
            assert billing.reconcile(session, period, now=at(2, month=12)).ok
    engine.dispose()


def test_periods_are_yyyy_mm():
    assert billing.parse_period("2026-11") == "2026-11"
    for bad in ("2026-13", "2026-1", "26-11", "2026-11-01", "", "november"):
        with pytest.raises(billing.BadPeriod, match="YYYY-MM"):
            billing.parse_period(bad)


# --- reconcile -------------------------------------------------------------------------------------------


def test_reconcile_detects_a_tampered_rollup_a_tampered_invoice_and_a_missing_event(
    url, sessions, caller, capsys, monkeypatch
):
    # The CLI reconciles as of the clock: a grace of a century keeps November 2026's invoice a draft until
    # the test finalises it itself, whatever today's date (it closed for real on 2026-12-04).
    monkeypatch.setenv("TESSERA_INVOICE_GRACE_DAYS", "36500")
    made = [used(caller, n, at(3 + n)) for n in range(8)]
    with sessions() as session:
        record(session, made, now=at(20))
        records = [
            {
                "request_id": o.request_id,
                "tenant_id": caller[0],
                "key_id": caller[1],
                "deployment": MODEL,
                "model": MODEL,
                "status": "completed",
                "prompt_tokens": o.prompt_tokens,
                "cached_tokens": o.cached_tokens,
                "completion_tokens": o.output_tokens,
                "created_at": o.started_at,
                "finished_at": o.finished_at,
            }
            for o in made
        ]
        settle_records(session, records)

    def reconcile(*extra: str) -> tuple[int, dict]:
        code = main(["billing", "reconcile", "--period", NOV, "--database-url", url, "--json", *extra])
        return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    code, report = reconcile("--tenant", "acme")
    assert code == 0 and report["ok"] and report["used_events"] == 8 and report["missing_events"] == 0
    assert report["ledger_cost"] == report["invoice_total"] == sum(expected_cost(o) for o in made)

    # A request that ended without a ledger event.
    with sessions() as session:
        settle_records(session, [{**records[0], "request_id": "never-charged"}])
    code, report = reconcile()
    assert code == 1 and report["mismatches"] == []
    assert report["missing_events"] == 1 and [m["request_id"] for m in report["missing"]] == ["never-charged"]
    with sessions() as session:
        session.execute(text("DELETE FROM request_records WHERE request_id = 'never-charged'"))
        session.commit()

    # A rollup one micro-USD off.
    with sessions() as session:
        session.execute(update(Rollup).where(Rollup.day == at(5).date()).values(cost=Rollup.cost + 1))
        session.commit()
    code, report = reconcile()
    assert code == 1
    assert [(m["what"], m["other"] - m["ledger"]) for m in report["mismatches"]] == [("rollups.cost", 1)]
    with sessions() as session:
        session.execute(update(Rollup).where(Rollup.day == at(5).date()).values(cost=Rollup.cost - 1))
        session.commit()
    assert reconcile()[0] == 0

    # A draft's invoice sums one token off.
    with sessions() as session:
        sums = billing.InvoiceSum
        session.execute(update(sums).values(fresh_input_tokens=sums.fresh_input_tokens + 1))
        session.commit()
        code, report = reconcile()
        assert code == 1 and [m["what"] for m in report["mismatches"]] == ["invoice.fresh_input.quantity"]
        session.execute(update(sums).values(fresh_input_tokens=sums.fresh_input_tokens - 1))
        session.commit()

    # A final invoice's stored line changed behind the ledger's back.
    with sessions() as session:
        assert billing.get_invoice(session, caller[0], NOV, now=at(10, month=12)).status == "final"
        line = billing.InvoiceLine
        session.execute(
            update(line)
            .where(line.kind == "output")
            .values(amount=line.amount + 7, quantity=line.quantity + 1)
        )
        session.commit()
    code, report = reconcile()
    assert code == 1
    assert {m["what"] for m in report["mismatches"]} == {"invoice.output.quantity", "invoice.output.amount"}


def test_the_cli_prints_an_invoice_and_refuses_bad_input(url, sessions, caller, capsys):
    made = [used(caller, n, at(3 + n)) for n in range(5)]
    with sessions() as session:
        record(session, made, now=at(20))
    args = ["--database-url", url]
    assert main(["billing", "invoice", "--tenant", "acme", "--period", NOV, "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == sum(expected_cost(o) for o in made) and len(out["lines"]) == 3
    assert out["total_usd"] == billing.usd(out["total"])
    assert main(["billing", "invoice", "--tenant", "acme", "--period", NOV, *args]) == 0
    table = capsys.readouterr().out
    assert "cached_input" in table and billing.usd(out["total"]) in table
    assert main(["billing", "invoice", "--tenant", "acme", "--period", "2026-10", *args]) == 1
    assert main(["billing", "invoice", "--tenant", "nobody", "--period", NOV, *args]) == 1
    with pytest.raises(SystemExit) as refused:
        main(["billing", "invoice", "--tenant", "acme", "--period", "2026-13", *args])
    assert refused.value.code == 2
    assert "YYYY-MM" in capsys.readouterr().err


# --- the migration ---------------------------------------------------------------------------------------


def test_the_migration_bills_existing_events_on_their_own_months_draft(database_url):
    db.upgrade(database_url, "0005")
    engine = db.make_engine(database_url)
    columns = (
        "request_id, tenant_id, deployment, model, status, cached_input_tokens, fresh_input_tokens, "
        "output_tokens, cached_input_cost, fresh_input_cost, output_cost, cost, duration_s, started_at, "
        "finished_at, day, recorded_at"
    )
    with engine.begin() as conn:
        for n, day in enumerate(("2026-10-31", "2026-11-02", "2026-11-30")):
            conn.execute(
                text(
                    f"INSERT INTO billing_ledger ({columns}) VALUES (:id, 't1', 'd', 'm', 'completed', 0, 1, 1, "
                    "0, 1, 1, 2, 0.1, :ts, :ts, :day, :ts)"
                ),
                {"id": f"r{n}", "ts": f"{day} 12:00:00", "day": day},
            )
    assert db.upgrade(database_url) is not None
    with engine.connect() as conn:
        periods = dict(conn.execute(text("SELECT request_id, invoice_period FROM billing_ledger")).all())
        invoices = conn.execute(text("SELECT period, status FROM billing_invoices ORDER BY period")).all()
        sums = conn.execute(
            text(
                "SELECT period, sum(requests), sum(output_cost) FROM billing_invoice_sums "
                "GROUP BY period ORDER BY period"
            )
        ).all()
    engine.dispose()
    assert periods == {"r0": "2026-10", "r1": NOV, "r2": NOV}
    assert [tuple(i) for i in invoices] == [("2026-10", "draft"), (NOV, "draft")]
    assert [tuple(x) for x in sums] == [("2026-10", 1, 1), (NOV, 2, 2)]


# --- the API ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("invoices"),
        redis_url=REDIS_URL,
        secret_key="invoice-test-secret-" * 4,
        records_stream=f"tessera:test:invoices:{uuid.uuid4().hex}",
        invoice_grace_days=3,
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    keys, ids = {}, {}
    with sessions() as session:
        for name in ("acme", "globex", "ops"):
            tenant = tenancy.create_tenant(session, name)
            key, raw = tenancy.create_key(session, name)
            keys[name], ids[name] = raw, (tenant.id, key.id)
        keys["admin"] = tenancy.create_key(session, "ops", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))[1]
        # acme: usage in five months (the last one this month); globex: one month.
        now = datetime.now(UTC)
        months = [(now.replace(day=1) - timedelta(days=31 * k)).replace(day=15, hour=12) for k in range(5)]
        made = [used(ids["acme"], 10 * k + n, month) for k, month in enumerate(months) for n in range(3)]
        made += [used(ids["globex"], 500 + n, months[1], request_id=f"g{n}") for n in range(4)]
        for o in made:  # each charged as it happened, while its month was open
            billing.record_events(session, [event(o)], now=o.finished_at)
    auth.key_cache.clear()
    with TestClient(create_app(settings)) as client:
        yield client, keys, ids, [billing.invoices.period_of(m.date()) for m in months], made
    redis.Redis.from_url(REDIS_URL).delete(settings.records_stream)


def get(client, path: str, key: str, **params):
    return client.get(path, params=params, headers={"Authorization": f"Bearer {key}"})


def test_a_tenant_sees_only_its_own_invoices_and_others_are_404(api):
    client, keys, ids, periods, made = api
    r = get(client, f"/v1/invoices/{periods[1]}", keys["acme"])
    assert r.status_code == 200, r.text
    body = r.json()
    acme = [
        o for o in made if o.tenant_id == ids["acme"][0] and o.finished_at.strftime("%Y-%m") == periods[1]
    ]
    assert body["tenant_id"] == ids["acme"][0] and body["total"] == sum(expected_cost(o) for o in acme)
    assert body["total_usd"] == billing.usd(body["total"]) and body["status"] in ("draft", "final")
    assert {(line["kind"], line["unit_price"]) for line in body["lines"]} == {
        ("cached_input", DEFAULT.cached_input),
        ("fresh_input", DEFAULT.fresh_input),
        ("output", DEFAULT.output),
    }
    globex = get(client, f"/v1/invoices/{periods[1]}", keys["globex"]).json()
    assert globex["tenant_id"] == ids["globex"][0] and globex["total"] != body["total"]
    # globex has no invoice of acme's other months: 404, the same as a month nobody used.
    for period in (periods[0], periods[2], "1999-01"):
        r = get(client, f"/v1/invoices/{period}", keys["globex"])
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    listed = get(client, "/v1/invoices", keys["globex"]).json()
    assert [i["period"] for i in listed["data"]] == [periods[1]]
    bad = get(client, "/v1/invoices/2026-13", keys["acme"])
    assert bad.status_code == 400 and "YYYY-MM" in bad.json()["error"]["message"]
    assert client.get("/v1/invoices").status_code == 401


def test_invoice_lists_paginate_newest_first_every_period_once(api):
    client, keys, _, periods, _ = api
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        body = get(client, "/v1/invoices", keys["acme"], **params).json()
        seen += [i["period"] for i in body["data"]]
        pages += 1
        if not (cursor := body["next_cursor"]):
            break
    assert seen == periods and pages == 3
    assert all(i["total_usd"] == billing.usd(i["total"]) for i in body["data"])
    assert get(client, "/v1/invoices", keys["acme"], cursor="!!").status_code == 400
    too_few = get(client, "/v1/invoices", keys["acme"], limit=0)
    assert too_few.status_code == 400 and "limit" in too_few.text
    # The month of today is a draft; three months ago is long final.
    body = get(client, "/v1/invoices", keys["acme"], limit=5).json()
    assert body["data"][0]["status"] == "draft" and body["data"][3]["status"] == "final"


def test_admin_routes_cross_tenants_for_admin_keys_only(api):
    client, keys, ids, periods, made = api
    for path in (
        "/admin/usage",
        "/admin/usage/requests",
        "/admin/tenants/acme/invoices",
        f"/admin/tenants/acme/invoices/{periods[1]}",
    ):
        refused = get(client, path, keys["acme"])
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied", path
    r = get(client, f"/admin/tenants/globex/invoices/{periods[1]}", keys["admin"])
    assert r.status_code == 200 and r.json()["tenant_id"] == ids["globex"][0]
    assert (
        get(client, "/admin/tenants/globex/invoices", keys["admin"]).json()["data"][0]["period"] == periods[1]
    )
    assert get(client, "/admin/tenants/nobody/invoices", keys["admin"]).status_code == 404
    assert get(client, f"/admin/tenants/globex/invoices/{periods[0]}", keys["admin"]).status_code == 404
    assert get(client, "/admin/tenants/acme/invoices/nov", keys["admin"]).status_code == 400

    start, end = min(o.finished_at for o in made).date(), max(o.finished_at for o in made).date()
    span = {"start": start.isoformat(), "end": end.isoformat(), "group_by": "model"}
    everyone = get(client, "/admin/usage", keys["admin"], **span).json()["data"]
    assert sum(row["requests"] for row in everyone) == len(made)
    assert sum(row["cost"] for row in everyone) == sum(expected_cost(o) for o in made)
    globex = get(client, "/admin/usage", keys["admin"], tenant="globex", **span).json()["data"]
    assert sum(row["requests"] for row in globex) == 4
    assert get(client, "/admin/usage", keys["admin"], tenant="nobody").status_code == 404

    seen, cursor = [], None
    while True:
        params = {"start": start.isoformat(), "end": end.isoformat(), "limit": 4}
        body = get(
            client, "/admin/usage/requests", keys["admin"], **params, **({"cursor": cursor} if cursor else {})
        ).json()
        assert len(body["data"]) <= 4
        seen += [(e["tenant_id"], e["request_id"]) for e in body["data"]]
        if not (cursor := body["next_cursor"]):
            break
    assert sorted(seen) == sorted((o.tenant_id, o.request_id) for o in made)
    only = get(
        client,
        "/admin/usage/requests",
        keys["admin"],
        tenant="globex",
        start=start.isoformat(),
        end=end.isoformat(),
    )
    assert {e["tenant_id"] for e in only.json()["data"]} == {ids["globex"][0]}
