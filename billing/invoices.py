"""Monthly invoices: line items per model × token kind × price version, drafts and final invoices, and the
reconciliation of ledger, rollups and invoices.

Which invoice an event is billed on is decided once, when the ledger inserts it (``assign_invoice_periods``,
in the insert's transaction): the invoice of the month it finished in, unless that invoice is closed (its
period and grace window are over, or it is already final), then the next open one's, where it is an
adjustment line naming the month it belongs to. A period's invoice stays ``draft`` (its lines read from the
invoice sums the ledger insert keeps in its transaction, like the rollups) until it closes; the first read after that finalises it: its lines are stored and never
change. The ledger insert holds a share lock on the invoice row it bills to, and finalising takes the row's
write lock before reading the ledger, so an event is always on exactly one invoice, whatever the clocks say.

Amounts follow the one rounding rule (``billing.prices``): a line's amount is the sum of its requests'
rounded amounts, so it can differ from quantity × unit price by at most half a micro-USD per request.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta, timezone
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from billing.pagination import InvalidCursor, decode_cursor, encode_cursor
from billing.schema import Invoice, InvoiceLine, InvoiceSum, LedgerEvent, Price, Rollup, utcnow
from billing.upserts import insert_for

DEFAULT_GRACE = timedelta(days=3)
KINDS = ("cached_input", "fresh_input", "output")
DRAFT, FINAL = "draft", "final"
MAX_LIMIT = 100
_PERIOD = re.compile(r"\d{4}-(0[1-9]|1[0-2])")


class BadPeriod(ValueError):
    pass


def parse_period(value: str) -> str:
    """``value`` if it is a month written ``YYYY-MM`` (e.g. ``2026-11``), else BadPeriod saying so."""
    if not _PERIOD.fullmatch(value or ""):
        raise BadPeriod(f"invalid period {value!r}: write the month as YYYY-MM, e.g. 2026-11")
    return value


def period_of(day: date) -> str:
    return f"{day.year:04d}-{day.month:02d}"


def period_start(period: str) -> date:
    year, month = map(int, parse_period(period).split("-"))
    return date(year, month, 1)


def next_period(period: str) -> str:
    start = period_start(period)
    return period_of(date(start.year + start.month // 12, start.month % 12 + 1, 1))


def period_days(period: str) -> tuple[date, date]:
    """The first and last UTC day of ``period``."""
    return period_start(period), period_start(next_period(period)) - timedelta(days=1)


def _midnight(day: date) -> datetime:
    return datetime.combine(day, time(0), tzinfo=timezone.utc)


def closes_at(period: str, grace: timedelta = DEFAULT_GRACE) -> datetime:
    """When ``period``'s invoice closes: its last day's end plus the grace window."""
    return _midnight(period_start(next_period(period))) + grace


# --- at ledger insert ------------------------------------------------------------------------------------


def assign_invoice_periods(
    session: Session, rows: Iterable[dict[str, Any]], *, now: datetime, grace: timedelta = DEFAULT_GRACE
) -> None:
    """Set each ledger row's ``invoice_period``, holding a share lock on each invoice row billed to until the
    caller's transaction ends (its first write, so SQLite serialises it with finalising too)."""
    rows = list(rows)
    billed: dict[tuple[str, str], str] = {}  # (tenant, the month used) -> the period it is billed on
    for tenant_id, period in {(row["tenant_id"], period_of(row["day"])) for row in rows}:
        open_period = period
        while closes_at(open_period, grace) <= now:
            open_period = next_period(open_period)
        billed[(tenant_id, period)] = open_period
    while True:
        final = _lock_invoices(session, sorted({(t, p) for (t, _), p in billed.items()}))
        if not final:
            break
        for key, period in billed.items():  # finalised early (another clock): the next one then
            if (key[0], period) in final:
                billed[key] = next_period(period)
    for row in rows:
        row["invoice_period"] = billed[(row["tenant_id"], period_of(row["day"]))]


def _lock_invoices(session: Session, pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Create the missing draft invoices of ``pairs`` (tenant id, period), share-lock all of them, and return
    those that are final."""
    table = Invoice.__table__
    stmt = insert_for(session, table).on_conflict_do_nothing(index_elements=["tenant_id", "period"])
    session.execute(stmt, [{"tenant_id": t, "period": p, "status": DRAFT} for t, p in pairs])
    match = or_(*(and_(Invoice.tenant_id == t, Invoice.period == p) for t, p in pairs))
    query = (
        select(Invoice.tenant_id, Invoice.period, Invoice.status)
        .where(match)
        .order_by(Invoice.tenant_id, Invoice.period)
        .with_for_update(read=True)
    )
    return {(t, p) for t, p, status in session.execute(query) if status == FINAL}


# --- invoices --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """A model's tokens of one kind, priced at one price version, used in ``usage_period``."""

    usage_period: str
    model: str
    price_id: int | None  # None: no price applied (amount 0)
    price_version: int | None
    kind: str  # one of KINDS
    requests: int
    quantity: int  # tokens
    unit_price_per_mtok: int  # micro-USD per million tokens
    amount: int  # micro-USD


@dataclass(frozen=True)
class InvoiceView:
    tenant_id: str
    period: str
    status: str  # DRAFT or FINAL
    closes_at: datetime
    finalized_at: datetime | None
    lines: list[Line] = field(default_factory=list)

    @property
    def adjustments(self) -> list[Line]:
        """Lines of usage from earlier periods, billed here because their own invoice had closed."""
        return [line for line in self.lines if line.usage_period != self.period]

    @property
    def subtotal(self) -> int:
        return sum(line.amount for line in self.lines if line.usage_period == self.period)

    @property
    def total(self) -> int:
        return sum(line.amount for line in self.lines)


@dataclass(frozen=True)
class InvoiceSummary:
    tenant_id: str
    period: str
    status: str
    closes_at: datetime
    finalized_at: datetime | None
    total: int  # micro-USD


def _draft_lines(session: Session, tenant_id: str, period: str) -> list[Line]:
    """The lines of everything billed on ``tenant_id``'s invoice of ``period``, from the invoice sums the
    ledger insert keeps."""
    query = (
        select(InvoiceSum, Price)
        .outerjoin(Price, Price.id == InvoiceSum.price_id)
        .where(InvoiceSum.tenant_id == tenant_id, InvoiceSum.period == period)
    )
    lines = []
    for sums, price in session.execute(query):
        units = (
            (price.cached_input_per_mtok, price.fresh_input_per_mtok, price.output_per_mtok)
            if price
            else (0, 0, 0)
        )
        for i, kind in enumerate(KINDS):
            lines.append(
                Line(
                    usage_period=sums.usage_period,
                    model=sums.model,
                    price_id=price.id if price else None,
                    price_version=price.version if price else None,
                    kind=kind,
                    requests=sums.requests,
                    quantity=getattr(sums, f"{kind}_tokens"),
                    unit_price_per_mtok=units[i],
                    amount=getattr(sums, f"{kind}_cost"),
                )
            )
    return _ordered(lines, period)


def _ordered(lines: list[Line], period: str) -> list[Line]:
    """This period's usage first, then adjustments oldest first; by model, price version and kind."""
    return sorted(
        lines,
        key=lambda x: (
            x.usage_period != period,
            x.usage_period,
            x.model,
            x.price_version or 0,
            KINDS.index(x.kind),
        ),
    )


def _stored_lines(session: Session, tenant_id: str, period: str) -> list[Line]:
    query = (
        select(InvoiceLine, Price.version)
        .outerjoin(Price, Price.id == InvoiceLine.price_id)
        .where(InvoiceLine.tenant_id == tenant_id, InvoiceLine.period == period)
    )
    lines = [
        Line(
            usage_period=line.usage_period,
            model=line.model,
            price_id=line.price_id,
            price_version=version,
            kind=line.kind,
            requests=line.requests,
            quantity=line.quantity,
            unit_price_per_mtok=line.unit_price_per_mtok,
            amount=line.amount,
        )
        for line, version in session.execute(query)
    ]
    return _ordered(lines, period)


def finalize(session: Session, tenant_id: str, period: str, *, now: datetime | None = None) -> bool:
    """Finalise ``tenant_id``'s draft invoice of ``period``: store its lines and total, in one transaction
    (committed). True if this call finalised it; False if it was already final (or does not exist)."""
    now = now or utcnow()
    table = Invoice.__table__
    try:
        # The row's write lock first: ledger inserts billing to it finish before the ledger is read below,
        # and later ones find it final and bill to the next period.
        claimed = session.execute(
            update(table)
            .where(table.c.tenant_id == tenant_id, table.c.period == period, table.c.status == DRAFT)
            .values(status=FINAL, finalized_at=now)
        ).rowcount
        if claimed:
            lines = _draft_lines(session, tenant_id, period)
            session.add_all(
                InvoiceLine(
                    tenant_id=tenant_id,
                    period=period,
                    usage_period=line.usage_period,
                    model=line.model,
                    price_id=line.price_id,
                    kind=line.kind,
                    requests=line.requests,
                    quantity=line.quantity,
                    unit_price_per_mtok=line.unit_price_per_mtok,
                    amount=line.amount,
                )
                for line in lines
            )
            session.execute(
                update(table)
                .where(table.c.tenant_id == tenant_id, table.c.period == period)
                .values(total=sum(line.amount for line in lines))
            )
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return bool(claimed)


def get_invoice(
    session: Session,
    tenant_id: str,
    period: str,
    *,
    now: datetime | None = None,
    grace: timedelta = DEFAULT_GRACE,
) -> InvoiceView | None:
    """``tenant_id``'s invoice of ``period`` (finalised first if it has closed), or None if it has none."""
    now = now or utcnow()
    period = parse_period(period)
    invoice = session.get(Invoice, (tenant_id, period))
    if invoice is None:
        return None
    if invoice.status == DRAFT and closes_at(period, grace) <= now:
        finalize(session, tenant_id, period, now=now)
        invoice = session.get(Invoice, (tenant_id, period), populate_existing=True)
    lines = (_stored_lines if invoice.status == FINAL else _draft_lines)(session, tenant_id, period)
    return InvoiceView(
        tenant_id=tenant_id,
        period=period,
        status=invoice.status,
        closes_at=closes_at(period, grace),
        finalized_at=invoice.finalized_at,
        lines=lines,
    )


def list_invoices(
    session: Session,
    tenant_id: str,
    *,
    cursor: str | None = None,
    limit: int = 12,
    now: datetime | None = None,
    grace: timedelta = DEFAULT_GRACE,
) -> tuple[list[InvoiceSummary], str | None]:
    """``tenant_id``'s invoices, newest period first (closed drafts finalised on the way); returns (the page,
    the cursor of the next page or None)."""
    now = now or utcnow()
    limit = min(limit, MAX_LIMIT)
    query = (
        select(Invoice.period)
        .where(Invoice.tenant_id == tenant_id)
        .order_by(Invoice.period.desc())
        .limit(limit + 1)
    )
    if cursor is not None:
        (after,) = decode_cursor(cursor, [str])
        try:
            parse_period(after)
        except BadPeriod:
            raise InvalidCursor(
                f"invalid cursor {cursor[:40]!r}: pass the next_cursor of the previous page unchanged, "
                "or omit it for the first page"
            ) from None
        query = query.where(Invoice.period < after)
    periods = list(session.scalars(query))
    more = len(periods) > limit
    periods = periods[:limit]
    page = []
    for period in periods:
        invoice = session.get(Invoice, (tenant_id, period))
        if invoice.status == DRAFT and closes_at(period, grace) <= now:
            finalize(session, tenant_id, period, now=now)
            invoice = session.get(Invoice, (tenant_id, period), populate_existing=True)
        if invoice.status == FINAL:
            total = invoice.total or 0
        else:
            total = session.scalar(
                select(func.coalesce(func.sum(LedgerEvent.cost), 0)).where(
                    LedgerEvent.tenant_id == tenant_id, LedgerEvent.invoice_period == period
                )
            )
        page.append(
            InvoiceSummary(
                tenant_id=tenant_id,
                period=period,
                status=invoice.status,
                closes_at=closes_at(period, grace),
                finalized_at=invoice.finalized_at,
                total=int(total),
            )
        )
    return page, (encode_cursor([periods[-1]]) if more else None)


# --- reconciliation --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    tenant_id: str
    model: str
    what: str  # e.g. "rollups.cost", "invoice.output.amount", "invoice.missing"
    ledger: int
    other: int


@dataclass(frozen=True)
class Reconciliation:
    """Ledger = rollups for the events used in ``period``; ledger = invoice for the events billed on it."""

    period: str
    tenants: int
    used_events: int  # events that finished in the period (what the rollups count)
    billed_events: int  # events on the period's invoices (adjustments included)
    ledger_cost: int  # micro-USD billed on the period's invoices
    invoice_total: int
    mismatches: list[Mismatch]

    @property
    def ok(self) -> bool:
        return not self.mismatches


USAGE_SUMS = ("requests", "cached_input_tokens", "fresh_input_tokens", "output_tokens", "cost")


def reconcile(
    session: Session,
    period: str,
    *,
    tenant_id: str | None = None,
    now: datetime | None = None,
    grace: timedelta = DEFAULT_GRACE,
) -> Reconciliation:
    """Compare, to the micro-USD and the token, per tenant and model: the ledger's events that finished in
    ``period`` with the rollups of its days, and the ledger's events billed on ``period`` with its invoices'
    lines (closed drafts are finalised first, as any read of them does)."""
    first, last = period_days(parse_period(period))
    e, r = LedgerEvent, Rollup
    used = select(
        e.tenant_id,
        e.model,
        func.count(),
        *(func.sum(e.__table__.c[name]) for name in USAGE_SUMS[1:]),
    ).where(e.finished_at >= _midnight(first), e.finished_at < _midnight(last + timedelta(days=1)))
    rolled = select(r.tenant_id, r.model, *(func.sum(r.__table__.c[name]) for name in USAGE_SUMS)).where(
        r.day >= first, r.day <= last
    )
    kinds = [f"{kind}_tokens" for kind in KINDS] + [f"{kind}_cost" for kind in KINDS]
    billed = select(
        e.tenant_id, e.model, func.count(), func.sum(e.cost), *(func.sum(e.__table__.c[k]) for k in kinds)
    ).where(e.invoice_period == period)
    invoices = select(Invoice.tenant_id).where(Invoice.period == period)
    if tenant_id is not None:
        used, rolled = used.where(e.tenant_id == tenant_id), rolled.where(r.tenant_id == tenant_id)
        billed, invoices = (
            billed.where(e.tenant_id == tenant_id),
            invoices.where(Invoice.tenant_id == tenant_id),
        )

    def sums(query) -> dict[tuple[str, str], list[int]]:
        return {
            (t, m): [int(v or 0) for v in values]
            for t, m, *values in session.execute(
                query.group_by(query.selected_columns[0], query.selected_columns[1])
            )
        }

    mismatches: list[Mismatch] = []
    ledger_used, rollup_used = sums(used), sums(rolled)
    for key in sorted(ledger_used.keys() | rollup_used.keys()):
        mine, theirs = ledger_used.get(key, [0] * 5), rollup_used.get(key, [0] * 5)
        mismatches += [
            Mismatch(*key, f"rollups.{name}", a, b)
            for name, a, b in zip(USAGE_SUMS, mine, theirs, strict=True)
            if a != b
        ]

    ledger_billed = sums(billed)
    tenants = sorted({t for t, _ in ledger_billed} | set(session.scalars(invoices)))
    on_invoices: dict[tuple[str, str], list[int]] = {}
    invoice_total = 0
    for tenant in tenants:
        view = get_invoice(session, tenant, period, now=now, grace=grace)
        if view is None:
            mismatches += [
                Mismatch(t, m, "invoice.missing", v[1], 0)
                for (t, m), v in ledger_billed.items()
                if t == tenant
            ]
            continue
        invoice_total += view.total
        per_model: dict[str, list[int]] = defaultdict(lambda: [0] * 6)
        for line in view.lines:
            i = KINDS.index(line.kind)
            per_model[line.model][i] += line.quantity
            per_model[line.model][3 + i] += line.amount
        for model, values in per_model.items():
            on_invoices[(tenant, model)] = values
    names = [f"invoice.{kind}.quantity" for kind in KINDS] + [f"invoice.{kind}.amount" for kind in KINDS]
    for key in sorted(ledger_billed.keys() | on_invoices.keys()):
        _, cost, *mine = ledger_billed.get(key, [0] * 8)
        theirs = on_invoices.get(key, [0] * 6)
        mismatches += [
            Mismatch(*key, name, a, b) for name, a, b in zip(names, mine, theirs, strict=True) if a != b
        ]
        if cost != sum(mine[3:]):
            mismatches.append(Mismatch(*key, "ledger.cost_vs_kinds", cost, sum(mine[3:])))
    return Reconciliation(
        period=period,
        tenants=len({t for t, _ in ledger_used} | set(tenants)),
        used_events=sum(v[0] for v in ledger_used.values()),
        billed_events=sum(v[0] for v in ledger_billed.values()),
        ledger_cost=sum(v[1] for v in ledger_billed.values()),
        invoice_total=invoice_total,
        mismatches=mismatches,
    )
