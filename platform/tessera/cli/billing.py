"""``tessera billing prices set|show``: the price book (``billing.prices``), in integer micro-USD per million
tokens. A new price is a new version, effective from ``--effective-from`` (default: now); requests already
in the ledger keep the version they were priced with.

``tessera billing invoice --tenant T --period YYYY-MM``: a tenant's invoice (``billing.invoices``; a closed
draft is finalised on the way, as the API does). ``tessera billing reconcile --period P [--tenant T]``:
ledger = rollups = invoices to the micro-USD, and no ended request without a ledger event; exit 1 if not."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from tessera.cli.common import CliError
from tessera.cli.database import open_session, settings_from
from tessera.cli.output import emit, json_default, rich_console


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database-url", metavar="URL", help="default: TESSERA_DATABASE_URL, else SQLite under the data dir"
    )
    common.add_argument(
        "--data-dir", type=Path, metavar="DIR", help="data folder (default: TESSERA_DATA_DIR, else .tessera)"
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")

    group = subparsers.add_parser(
        "billing", help="prices, invoices and reconciliation (usage is at GET /v1/usage)"
    )
    commands = group.add_subparsers(dest="billing_command", required=True, metavar="COMMAND")
    prices = commands.add_parser("prices", help="set or show model prices")
    actions = prices.add_subparsers(dest="prices_command", required=True, metavar="ACTION")
    setter = actions.add_parser("set", parents=[common], help="add a new version of a model's price")
    setter.add_argument("model", help="the model id ('*': the default for models without a price)")
    for flag, what in (("fresh", "fresh input"), ("cached", "cached input"), ("output", "output")):
        setter.add_argument(
            f"--{flag}",
            type=micro_usd,
            required=True,
            metavar="MICRO_USD",
            help=f"micro-USD per million {what} tokens (a whole number; 950000 = $0.95)",
        )
    setter.add_argument(
        "--effective-from",
        type=aware_datetime,
        metavar="ISO8601",
        help="when it takes effect (default: now; UTC unless the time names a zone)",
    )
    setter.set_defaults(func=cmd_prices_set)
    show = actions.add_parser("show", parents=[common], help="every version of every price (or one model's)")
    show.add_argument("model", nargs="?", help="only this model")
    show.set_defaults(func=cmd_prices_show)

    invoice = commands.add_parser(
        "invoice", parents=[common], help="a tenant's invoice of one month: lines per model and token kind"
    )
    invoice.add_argument("--tenant", required=True, help="the tenant's name")
    invoice.add_argument("--period", required=True, type=period, metavar="YYYY-MM", help="the month")
    invoice.set_defaults(func=cmd_invoice)
    check = commands.add_parser(
        "reconcile",
        parents=[common],
        help="prove ledger = rollups = invoices for a month; list ended requests without a ledger event",
        description="Exits 1 on any mismatch or missing event, 0 when everything agrees.",
    )
    check.add_argument("--period", required=True, type=period, metavar="YYYY-MM", help="the month")
    check.add_argument("--tenant", help="only this tenant (its name); default: every tenant")
    check.add_argument(
        "--limit", type=int, default=100, metavar="N", help="missing events listed at most (default 100)"
    )
    check.set_defaults(func=cmd_reconcile)


def micro_usd(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of micro-USD >= 0, got {value!r}")
    return number


def aware_datetime(value: str) -> datetime:
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an ISO 8601 date or time, got {value!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def period(value: str) -> str:
    import billing

    try:
        return billing.parse_period(value)
    except billing.BadPeriod as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tenant_id(session: Any, name: str) -> str:
    from tessera import tenancy
    from tessera.errors import NotFound

    try:
        return tenancy.get_tenant(session, name).id
    except NotFound as exc:
        raise CliError(str(exc)) from None


def cmd_invoice(args: argparse.Namespace) -> None:
    import billing
    from tessera.api.invoices import InvoiceOut

    grace = timedelta(days=settings_from(args).invoice_grace_days)
    with open_session(args) as session:
        view = billing.get_invoice(session, _tenant_id(session, args.tenant), args.period, grace=grace)
    if view is None:
        raise CliError(f"tenant {args.tenant!r} has no invoice for {args.period}: no usage is billed on it")
    out = InvoiceOut.of(view)
    if args.json:
        print(out.model_dump_json())
        return
    from rich.table import Table

    when = out.finalized_at if out.status == "final" else out.closes_at
    title = f"Invoice {out.period} of {args.tenant} ({out.status}, {'finalised' if out.status == 'final' else 'closes'} {when:%Y-%m-%d %H:%M UTC})"
    table = Table(title=title)
    for column in ("used in", "model", "kind", "price v.", "requests", "tokens", "USD / 1M", "amount USD"):
        table.add_column(
            column, justify="right" if column in ("requests", "tokens", "USD / 1M", "amount USD") else "left"
        )
    for line in out.lines:
        table.add_row(
            line.usage_period + (" (adjustment)" if line.adjustment else ""),
            line.model,
            line.kind,
            "-" if line.price_version is None else str(line.price_version),
            str(line.requests),
            str(line.quantity),
            line.unit_price_usd,
            line.amount_usd,
        )
    table.add_section()
    table.add_row("subtotal", "", "", "", "", "", "", out.subtotal_usd)
    table.add_row("adjustments", "", "", "", "", "", "", out.adjustments_usd)
    table.add_row("total", "", "", "", "", "", "", out.total_usd)
    rich_console().print(table)


def missing_events(session: Any, period: str, tenant_id: str | None, limit: int) -> tuple[int, list[dict]]:
    """Request records that ended in ``period`` with no ledger event: (how many, the first ``limit``)."""
    from sqlalchemy import exists, func, select

    import billing
    from tessera.models import FINAL_STATUSES, RequestRecord

    first, last = billing.invoices.period_days(period)
    start = datetime.combine(first, datetime.min.time(), tzinfo=timezone.utc)
    end = datetime.combine(last + timedelta(days=1), datetime.min.time(), tzinfo=timezone.utc)
    where = [
        RequestRecord.status.in_(FINAL_STATUSES),
        RequestRecord.finished_at >= start,
        RequestRecord.finished_at < end,
        ~exists().where(billing.LedgerEvent.request_id == RequestRecord.request_id),
    ]
    if tenant_id is not None:
        where.append(RequestRecord.tenant_id == tenant_id)
    count = session.scalar(select(func.count()).select_from(RequestRecord).where(*where))
    query = select(RequestRecord).where(*where).order_by(RequestRecord.finished_at).limit(limit)
    rows = [
        {
            "request_id": r.request_id,
            "tenant_id": r.tenant_id,
            "model": r.model,
            "status": r.status,
            "finished_at": r.finished_at,
        }
        for r in session.scalars(query)
    ]
    return count, rows


def cmd_reconcile(args: argparse.Namespace) -> int:
    import billing

    if args.limit < 0:
        raise CliError(f"--limit must be 0 or more, got {args.limit}", exit_code=2)
    grace = timedelta(days=settings_from(args).invoice_grace_days)
    with open_session(args) as session:
        tenant_id = _tenant_id(session, args.tenant) if args.tenant else None
        result = billing.reconcile(session, args.period, tenant_id=tenant_id, grace=grace)
        missing, listed = missing_events(session, args.period, tenant_id, args.limit)
    ok = result.ok and missing == 0
    summary = {
        "period": result.period,
        "ok": ok,
        "tenants": result.tenants,
        "used_events": result.used_events,
        "billed_events": result.billed_events,
        "ledger_cost": result.ledger_cost,
        "invoice_total": result.invoice_total,
        "mismatches": [vars(m) for m in result.mismatches],
        "missing_events": missing,
        "missing": listed,
    }
    if args.json:
        print(json.dumps(summary, default=json_default))
        return 0 if ok else 1
    print(
        f"{result.period}: {result.tenants} tenants, {result.used_events} events used in the month, "
        f"{result.billed_events} billed on its invoices, ledger {billing.usd(result.ledger_cost)} USD, "
        f"invoices {billing.usd(result.invoice_total)} USD"
    )
    if result.mismatches:
        emit(args, [vars(m) for m in result.mismatches], title="Mismatches (ledger vs the other)")
    if missing:
        emit(args, listed, title=f"Ended requests without a ledger event ({missing})")
    print("OK: ledger = rollups = invoices" if ok else "MISMATCH", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def cmd_prices_set(args: argparse.Namespace) -> None:
    import billing

    try:
        spec = billing.PriceSpec(fresh_input=args.fresh, cached_input=args.cached, output=args.output)
    except ValueError as exc:
        raise CliError(str(exc), exit_code=2) from None
    with open_session(args) as session:
        price = billing.set_price(session, args.model, spec, effective_from=args.effective_from)
        rows = [price_row(price)]
    emit(args, rows, title=f"New price of {args.model}")


def cmd_prices_show(args: argparse.Namespace) -> None:
    import billing

    with open_session(args) as session:
        rows = [price_row(p) for p in billing.list_prices(session, args.model)]
    emit(args, rows, title="Prices (micro-USD per million tokens)")


def price_row(price: Any) -> dict[str, Any]:
    return {
        "model": price.model,
        "version": price.version,
        "effective_from": price.effective_from,
        "fresh_input": price.fresh_input_per_mtok,
        "cached_input": price.cached_input_per_mtok,
        "output": price.output_per_mtok,
    }
