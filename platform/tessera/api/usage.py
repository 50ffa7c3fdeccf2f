"""Usage for the caller's tenant: ``GET /v1/usage`` (from billing's rollups), ``GET /v1/usage/quality``
(latency percentiles, outcomes and 429s by limit, from billing's quality counts) and ``GET /v1/usage/requests``
(raw ledger events). Every list is cursor-paginated; no route shows another tenant's data (the tenant is the
caller key's, never a parameter). Money is integer micro-USD (``cost``) plus the same as an exact decimal
string of USD (``cost_usd``).

``admin_router``: the same across tenants for admin keys, ``GET /admin/usage``, ``/admin/usage/quality`` and
``/admin/usage/requests``
(every tenant's, or one's with ``?tenant=NAME``)."""

from __future__ import annotations

import csv
import io
from datetime import date, datetime, timedelta, timezone
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

import billing
from tessera import tenancy
from tessera.api.admin_schemas import ErrorResponse
from tessera.api.deps import CurrentCaller, current_caller, require_admin
from tessera.errors import APIError, NotFound

MAX_DAYS = 366

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "invalid request: a bad date range or cursor"),
        (401, "no valid API key"),
        (403, "the key lacks the inference scope"),
        (422, "a parameter has the wrong type"),
    )
}
router = APIRouter(tags=["usage"], dependencies=[Depends(current_caller)], responses=_ERRORS)
_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    403: {"model": ErrorResponse, "description": "the key lacks the admin scope"},
    404: {"model": ErrorResponse, "description": "no such tenant"},
}
admin_router = APIRouter(
    prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)], responses=_ADMIN_ERRORS
)


class UsageRow(BaseModel):
    day: date | None = Field(None, description="the UTC day (group_by=day)")
    model: str | None = Field(None, description="the model (group_by=model)")
    key_id: str | None = Field(None, description="the API key's id (group_by=key; null: usage without a key)")
    requests: int
    cached_input_tokens: int = Field(description="prompt tokens served from the prefix cache")
    fresh_input_tokens: int = Field(description="prompt tokens computed anew")
    input_tokens: int = Field(description="cached + fresh")
    output_tokens: int
    cost: int = Field(description="micro-USD")
    cost_usd: str = Field(description="the same cost in USD, as an exact decimal string")


class UsagePage(BaseModel):
    object: Literal["list"] = "list"
    group_by: Literal["day", "model", "key"]
    start: date
    end: date
    data: list[UsageRow]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null on the last")


class UsageEventOut(BaseModel):
    request_id: str
    key_id: str | None
    deployment: str
    model: str
    status: str
    error_code: str | None
    cached_input_tokens: int
    fresh_input_tokens: int
    output_tokens: int
    cached_input_cost: int = Field(description="micro-USD")
    fresh_input_cost: int = Field(description="micro-USD")
    output_cost: int = Field(description="micro-USD")
    cost: int = Field(description="micro-USD")
    cost_usd: str
    price_id: int | None = Field(description="the price-book version this event was priced with")
    ttft_s: float | None
    duration_s: float
    started_at: datetime
    finished_at: datetime


class UsageEventPage(BaseModel):
    object: Literal["list"] = "list"
    start: date
    end: date
    data: list[UsageEventOut]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null on the last")


class Latency(BaseModel):
    samples: int = Field(description="requests measured")
    p50_s: float | None = Field(description="median in seconds, interpolated in its bucket; null: no samples")
    p95_s: float | None = Field(description="95th percentile in seconds, interpolated in its bucket")


class QualityStats(BaseModel):
    requests: int = Field(description="requests that ended (completed, failed or cancelled)")
    by_status: dict[str, int] = Field(description="ended requests by status")
    errors: dict[str, int] = Field(description="ended requests with an error code, by code")
    rejected: int = Field(description="requests refused with 429")
    rejected_by_limit: dict[str, int] = Field(
        description="429s by the limit that refused them: rpm, tpm, concurrency, daily_tokens, "
        "monthly_tokens, monthly_spend, or capacity (a busy model asked to reject)"
    )
    ttft: Latency = Field(description="time to first token")
    tpot: Latency = Field(description="time per output token after the first (requests of 2+ tokens)")


class QualityDay(QualityStats):
    day: date


class QualityReport(BaseModel):
    object: Literal["usage.quality"] = "usage.quality"
    start: date
    end: date
    model: str | None
    key_id: str | None
    total: QualityStats
    data: list[QualityDay] = Field(description="per UTC day that has any request, in day order")
    buckets_s: list[float] = Field(
        description="the latency histogram's bucket bounds in seconds (log-spaced, 1 ms to 100 s): a "
        "percentile is interpolated linearly inside its bucket, so it is exact to within one bucket"
    )


def _range(start: date | None, end: date | None) -> tuple[date, date]:
    today = datetime.now(timezone.utc).date()
    end = end or today
    start = start or end.replace(day=1)
    if start > end:
        raise APIError(400, f"start ({start}) is after end ({end})", "invalid_request", param="start")
    if end - start > timedelta(days=MAX_DAYS):
        raise APIError(400, f"a range spans at most {MAX_DAYS} days", "invalid_request", param="start")
    return start, end


Start = Annotated[date | None, Query(description="first UTC day, included (default: the 1st of end's month)")]
End = Annotated[date | None, Query(description="last UTC day, included (default: today)")]
Limit = Annotated[int, Query(ge=1, le=billing.rollups.MAX_LIMIT)]


@router.get(
    "/v1/usage",
    response_model=UsagePage,
    responses={200: {"content": {"text/csv": {}}, "description": "the page (JSON, or CSV with format=csv)"}},
)
def get_usage(
    request: Request,
    caller: CurrentCaller,
    start: Start = None,
    end: End = None,
    group_by: Literal["day", "model", "key"] = "day",
    model: str | None = None,
    key: Annotated[str | None, Query(description="only this API key's usage (its id)")] = None,
    cursor: str | None = None,
    limit: Limit = 100,
    format: Literal["json", "csv"] = "json",
) -> Any:
    """The caller's tenant's usage per day, model or key, summed from the rollups."""
    return _usage(request, caller.tenant_id, start, end, group_by, model, key, cursor, limit, format)


def _usage(
    request: Request,
    tenant_id: str | None,
    start: date | None,
    end: date | None,
    group_by: Literal["day", "model", "key"],
    model: str | None,
    key: str | None,
    cursor: str | None,
    limit: int,
    format: Literal["json", "csv"],
) -> Any:
    start, end = _range(start, end)
    with request.app.state.sessions() as session:
        try:
            lines, next_cursor = billing.usage_report(
                session,
                tenant_id,
                start=start,
                end=end,
                group_by=group_by,
                model=model,
                key_id=key,
                cursor=cursor,
                limit=limit,
            )
        except billing.InvalidCursor as exc:
            raise APIError(400, str(exc), "invalid_request", param="cursor") from None
    field = {"day": "day", "model": "model", "key": "key_id"}[group_by]
    rows = [
        UsageRow(
            **{field: line.group},
            requests=line.requests,
            cached_input_tokens=line.cached_input_tokens,
            fresh_input_tokens=line.fresh_input_tokens,
            input_tokens=line.cached_input_tokens + line.fresh_input_tokens,
            output_tokens=line.output_tokens,
            cost=line.cost,
            cost_usd=billing.usd(line.cost),
        )
        for line in lines
    ]
    if format == "csv":
        out = io.StringIO()
        columns = [field, *(n for n in UsageRow.model_fields if n not in ("day", "model", "key_id"))]
        writer = csv.writer(out)
        writer.writerow(columns)
        for row in rows:
            values = row.model_dump(mode="json")
            writer.writerow(["" if values[c] is None else values[c] for c in columns])
        headers = {"x-next-cursor": next_cursor} if next_cursor else {}
        return Response(out.getvalue(), media_type="text/csv", headers=headers)
    return UsagePage(group_by=group_by, start=start, end=end, data=rows, next_cursor=next_cursor)


@router.get("/v1/usage/quality", response_model=QualityReport)
def get_usage_quality(
    request: Request,
    caller: CurrentCaller,
    start: Start = None,
    end: End = None,
    model: str | None = None,
    key: Annotated[str | None, Query(description="only this API key's requests (its id)")] = None,
) -> QualityReport:
    """The caller's tenant's latency p50/p95 (time to first token, per output token), requests by status,
    errors by code and 429s by limit, per day and in total, from the quality counts (never the ledger)."""
    return _quality(request, caller.tenant_id, start, end, model, key)


def _quality(
    request: Request,
    tenant_id: str | None,
    start: date | None,
    end: date | None,
    model: str | None,
    key: str | None,
) -> QualityReport:
    start, end = _range(start, end)
    with request.app.state.sessions() as session:
        days, total = billing.quality_report(
            session, tenant_id, start=start, end=end, model=model, key_id=key
        )
    return QualityReport(
        start=start,
        end=end,
        model=model,
        key_id=key,
        total=_stats(QualityStats, total),
        data=[_stats(QualityDay, quality, day=day) for day, quality in days.items()],
        buckets_s=list(billing.quality.BOUNDS),
    )


def _stats(model: type[QualityStats], quality: billing.Quality, **extra: Any) -> Any:
    latency = {
        metric: Latency(
            samples=quality.samples(metric),
            p50_s=quality.percentile(metric, 0.5),
            p95_s=quality.percentile(metric, 0.95),
        )
        for metric in billing.quality.METRICS
    }
    return model(
        **extra,
        requests=sum(quality.by_status.values()),
        by_status=quality.by_status,
        errors=quality.errors,
        rejected=sum(quality.rejected.values()),
        rejected_by_limit=quality.rejected,
        **latency,
    )


@router.get("/v1/usage/requests", response_model=UsageEventPage)
def get_usage_requests(
    request: Request,
    caller: CurrentCaller,
    start: Start = None,
    end: End = None,
    model: str | None = None,
    key: Annotated[str | None, Query(description="only this API key's requests (its id)")] = None,
    cursor: str | None = None,
    limit: Limit = 100,
) -> UsageEventPage:
    """The caller's tenant's ledger events (one per request), oldest first."""
    events, next_cursor, start, end = _events(
        request, caller.tenant_id, start, end, model, key, cursor, limit
    )
    data = [_event_out(UsageEventOut, e) for e in events]
    return UsageEventPage(start=start, end=end, data=data, next_cursor=next_cursor)


def _events(
    request: Request,
    tenant_id: str | None,
    start: date | None,
    end: date | None,
    model: str | None,
    key: str | None,
    cursor: str | None,
    limit: int,
) -> tuple[list[Any], str | None, date, date]:
    start, end = _range(start, end)
    with request.app.state.sessions() as session:
        try:
            events, next_cursor = billing.list_events(
                session,
                tenant_id,
                start=start,
                end=end,
                model=model,
                key_id=key,
                cursor=cursor,
                limit=limit,
            )
        except billing.InvalidCursor as exc:
            raise APIError(400, str(exc), "invalid_request", param="cursor") from None
    return events, next_cursor, start, end


def _event_out(model: type[UsageEventOut], e: Any) -> UsageEventOut:
    return model(
        **{name: getattr(e, name) for name in model.model_fields if name != "cost_usd"},
        cost_usd=billing.usd(e.cost),
    )


# --- admin: across tenants -------------------------------------------------------------------------------


class AdminUsageEventOut(UsageEventOut):
    tenant_id: str


class AdminUsageEventPage(BaseModel):
    object: Literal["list"] = "list"
    start: date
    end: date
    data: list[AdminUsageEventOut]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null on the last")


TenantFilter = Annotated[
    str | None, Query(description="only this tenant's (its name); default: every tenant")
]


def _tenant_id(request: Request, name: str | None) -> str | None:
    if name is None:
        return None
    with request.app.state.sessions() as session:
        try:
            return tenancy.get_tenant(session, name).id
        except NotFound as exc:
            raise APIError(404, str(exc), "not_found", param="tenant") from None


@admin_router.get(
    "/usage",
    response_model=UsagePage,
    responses={200: {"content": {"text/csv": {}}, "description": "the page (JSON, or CSV with format=csv)"}},
)
def admin_get_usage(
    request: Request,
    tenant: TenantFilter = None,
    start: Start = None,
    end: End = None,
    group_by: Literal["day", "model", "key"] = "day",
    model: str | None = None,
    key: Annotated[str | None, Query(description="only this API key's usage (its id)")] = None,
    cursor: str | None = None,
    limit: Limit = 100,
    format: Literal["json", "csv"] = "json",
) -> Any:
    """Usage per day, model or key of every tenant together (or of ``tenant``), summed from the rollups."""
    tenant_id = _tenant_id(request, tenant)
    return _usage(request, tenant_id, start, end, group_by, model, key, cursor, limit, format)


@admin_router.get("/usage/quality", response_model=QualityReport)
def admin_get_usage_quality(
    request: Request,
    tenant: TenantFilter = None,
    start: Start = None,
    end: End = None,
    model: str | None = None,
    key: Annotated[str | None, Query(description="only this API key's requests (its id)")] = None,
) -> QualityReport:
    """Latency percentiles, outcomes and 429s by limit of every tenant together (or of ``tenant``)."""
    return _quality(request, _tenant_id(request, tenant), start, end, model, key)


@admin_router.get("/usage/requests", response_model=AdminUsageEventPage)
def admin_get_usage_requests(
    request: Request,
    tenant: TenantFilter = None,
    start: Start = None,
    end: End = None,
    model: str | None = None,
    key: Annotated[str | None, Query(description="only this API key's requests (its id)")] = None,
    cursor: str | None = None,
    limit: Limit = 100,
) -> AdminUsageEventPage:
    """Ledger events of every tenant (or of ``tenant``), oldest first, each naming its tenant."""
    tenant_id = _tenant_id(request, tenant)
    events, next_cursor, start, end = _events(request, tenant_id, start, end, model, key, cursor, limit)
    data = [_event_out(AdminUsageEventOut, e) for e in events]
    return AdminUsageEventPage(start=start, end=end, data=data, next_cursor=next_cursor)
