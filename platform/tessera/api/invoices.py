"""Invoices: ``GET /v1/invoices`` and ``/v1/invoices/{period}`` for the caller's tenant, and
``/admin/tenants/{tenant}/invoices[/{period}]`` for admin keys (``admin_router``).

An invoice is one calendar month (``YYYY-MM``) of a tenant's usage, a line per model × token kind × price
version, plus adjustment lines for earlier months' usage that arrived after their invoice was final. It is
a ``draft`` until ``closes_at`` (the month's end plus ``TESSERA_INVOICE_GRACE_DAYS``), then ``final`` and
never changes (``billing.invoices``). Another tenant's invoice is a 404, like one that does not exist.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

import billing
from tessera import tenancy
from tessera.api.admin_schemas import ErrorResponse
from tessera.api.deps import CurrentCaller, current_caller, require_admin
from tessera.errors import APIError, NotFound


def _errors(forbidden: str, missing: str) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"model": ErrorResponse, "description": description}
        for status, description in (
            (400, "invalid request: a bad period or cursor"),
            (401, "no valid API key"),
            (403, forbidden),
            (404, missing),
            (422, "a parameter has the wrong type"),
        )
    }


router = APIRouter(
    tags=["invoices"],
    dependencies=[Depends(current_caller)],
    responses=_errors("the key lacks the inference scope", "no invoice of that period"),
)
admin_router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    dependencies=[Depends(require_admin)],
    responses=_errors("the key lacks the admin scope", "no such tenant, or no invoice of that period"),
)

Kind = Literal["cached_input", "fresh_input", "output"]
Status = Literal["draft", "final"]
Cursor = Annotated[str | None, Query(description="next_cursor of the previous page; omit for the first")]
Limit = Annotated[int, Query(ge=1, le=billing.invoices.MAX_LIMIT, description="invoices per page")]


class InvoiceLineOut(BaseModel):
    usage_period: str = Field(description="the month (YYYY-MM) the usage belongs to")
    adjustment: bool = Field(description="usage of an earlier month, billed here: its own invoice was final")
    model: str
    kind: Kind = Field(description="cached input (served from the prefix cache), fresh input, or output")
    price_version: int | None = Field(description="the price-book version applied (null: no price)")
    requests: int
    quantity: int = Field(description="tokens")
    unit_price: int = Field(description="micro-USD per million tokens")
    unit_price_usd: str = Field(description="USD per million tokens, as an exact decimal string")
    amount: int = Field(
        description="micro-USD: the sum of each request's amount, rounded half up per request"
    )
    amount_usd: str


class InvoiceOut(BaseModel):
    object: Literal["invoice"] = "invoice"
    tenant_id: str
    period: str = Field(description="the month invoiced, YYYY-MM")
    status: Status
    closes_at: datetime = Field(description="when a draft becomes final (the month's end plus the grace)")
    finalized_at: datetime | None
    currency: Literal["USD"] = "USD"
    lines: list[InvoiceLineOut]
    subtotal: int = Field(description="micro-USD of this period's usage")
    subtotal_usd: str
    adjustments: int = Field(description="micro-USD of earlier periods' late usage")
    adjustments_usd: str
    total: int = Field(description="micro-USD")
    total_usd: str

    @classmethod
    def of(cls, view: billing.InvoiceView) -> InvoiceOut:
        adjustments = sum(line.amount for line in view.adjustments)
        return cls(
            tenant_id=view.tenant_id,
            period=view.period,
            status=view.status,
            closes_at=view.closes_at,
            finalized_at=view.finalized_at,
            lines=[
                InvoiceLineOut(
                    usage_period=line.usage_period,
                    adjustment=line.usage_period != view.period,
                    model=line.model,
                    kind=line.kind,
                    price_version=line.price_version,
                    requests=line.requests,
                    quantity=line.quantity,
                    unit_price=line.unit_price_per_mtok,
                    unit_price_usd=billing.usd(line.unit_price_per_mtok),
                    amount=line.amount,
                    amount_usd=billing.usd(line.amount),
                )
                for line in view.lines
            ],
            subtotal=view.subtotal,
            subtotal_usd=billing.usd(view.subtotal),
            adjustments=adjustments,
            adjustments_usd=billing.usd(adjustments),
            total=view.total,
            total_usd=billing.usd(view.total),
        )


class InvoiceSummaryOut(BaseModel):
    period: str
    status: Status
    closes_at: datetime
    finalized_at: datetime | None
    total: int = Field(description="micro-USD")
    total_usd: str


class InvoicePage(BaseModel):
    object: Literal["list"] = "list"
    tenant_id: str
    data: list[InvoiceSummaryOut] = Field(description="newest period first")
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null on the last")


def _grace(request: Request) -> timedelta:
    return timedelta(days=request.app.state.settings.invoice_grace_days)


def _list(request: Request, tenant_id: str, cursor: str | None, limit: int) -> InvoicePage:
    with request.app.state.sessions() as session:
        try:
            page, next_cursor = billing.list_invoices(
                session, tenant_id, cursor=cursor, limit=limit, grace=_grace(request)
            )
        except billing.InvalidCursor as exc:
            raise APIError(400, str(exc), "invalid_request", param="cursor") from None
    data = [
        InvoiceSummaryOut(
            period=s.period,
            status=s.status,
            closes_at=s.closes_at,
            finalized_at=s.finalized_at,
            total=s.total,
            total_usd=billing.usd(s.total),
        )
        for s in page
    ]
    return InvoicePage(tenant_id=tenant_id, data=data, next_cursor=next_cursor)


def _get(request: Request, tenant_id: str, period: str) -> InvoiceOut:
    try:
        period = billing.parse_period(period)
    except billing.BadPeriod as exc:
        raise APIError(400, str(exc), "invalid_request", param="period") from None
    with request.app.state.sessions() as session:
        view = billing.get_invoice(session, tenant_id, period, grace=_grace(request))
    if view is None:
        raise APIError(404, f"no invoice for {period}: no usage is billed on that month", "not_found")
    return InvoiceOut.of(view)


@router.get("/v1/invoices", response_model=InvoicePage)
def list_invoices(
    request: Request, caller: CurrentCaller, cursor: Cursor = None, limit: Limit = 12
) -> InvoicePage:
    """The caller's tenant's invoices, newest month first."""
    return _list(request, caller.tenant_id, cursor, limit)


@router.get("/v1/invoices/{period}", response_model=InvoiceOut)
def get_invoice(request: Request, caller: CurrentCaller, period: str) -> InvoiceOut:
    """The caller's tenant's invoice of ``period`` (YYYY-MM), with its lines and totals."""
    return _get(request, caller.tenant_id, period)


def _tenant_id(request: Request, name: str) -> str:
    with request.app.state.sessions() as session:
        try:
            return tenancy.get_tenant(session, name).id
        except NotFound as exc:
            raise APIError(404, str(exc), "not_found") from None


@admin_router.get("/tenants/{tenant}/invoices", response_model=InvoicePage)
def admin_list_invoices(
    request: Request, tenant: str, cursor: Cursor = None, limit: Limit = 12
) -> InvoicePage:
    """A tenant's invoices (by tenant name), newest month first."""
    return _list(request, _tenant_id(request, tenant), cursor, limit)


@admin_router.get("/tenants/{tenant}/invoices/{period}", response_model=InvoiceOut)
def admin_get_invoice(request: Request, tenant: str, period: str) -> InvoiceOut:
    """A tenant's invoice of ``period`` (YYYY-MM)."""
    return _get(request, _tenant_id(request, tenant), period)
