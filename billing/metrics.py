"""The control plane's Prometheus meters (prometheus-client) and their exposition for ``GET /metrics``.

The usage counters (tokens, cost, requests by how they ended) are read from the database at every scrape
(``LedgerCollector``): from the rollups and outcome counts the ledger insert keeps in its own transaction. So
they equal the ledger whenever it is read, in every API process, whichever consumer charged a row, and even
when a consumer died between its commit and anything after it (a counter moved in memory after the commit
lost those rows for good). The ledger is append-only, so they only grow, as counters must.

The latency histograms and the 429 counter are observations in process memory: a histogram moves in the
billing consumer once per ledger row it really inserted (after the commit; a redelivered event inserts
nothing and moves nothing), the 429 counter in the gateway that refused. Several API processes: set
``PROMETHEUS_MULTIPROC_DIR`` (an empty folder, the same for all of them, before they start) and each one's
``/metrics`` reports the sum over all of them (``MultiProcessCollector``).

Labels are bounded: tenant and model ids, token kind, status, limit name; never a request id.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from billing.schema import OutcomeCount, Rollup

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
MICRO = 1_000_000

TTFT = Histogram(
    "tessera_time_to_first_token_seconds",
    "From admission to the first output token",
    ["model"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TPOT = Histogram(
    "tessera_time_per_output_token_seconds",
    "Mean time per output token after the first, per request",
    ["model"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
DURATION = Histogram(
    "tessera_request_duration_seconds",
    "From admission to the end of the request",
    ["model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
RATE_LIMITED = Counter(
    "tessera_rate_limited", "Requests refused with 429 by a quota or budget, by the limit", ["limit"]
)
KINDS = (("cached", "cached_input_tokens"), ("fresh", "fresh_input_tokens"), ("output", "output_tokens"))


class LedgerCollector(Collector):
    """``tessera_tokens_total``, ``tessera_cost_usd_total`` and ``tessera_requests_total``, summed from the
    database's rollups (per tenant and model) and outcome counts (per model and status) when scraped."""

    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def collect(self) -> Iterable[CounterMetricFamily]:
        tokens = CounterMetricFamily(
            "tessera_tokens",
            "Tokens billed, by tenant, model and kind (cached input, fresh input, output)",
            labels=["tenant", "model", "kind"],
        )
        cost = CounterMetricFamily(
            "tessera_cost_usd",
            "Cost billed in USD (the ledger's micro-USD / 1e6)",
            labels=["tenant", "model"],
        )
        requests = CounterMetricFamily(
            "tessera_requests", "Requests billed, by how they ended", labels=["model", "status"]
        )
        sums = [func.sum(getattr(Rollup, column)) for _, column in KINDS]
        with self.sessions() as session:
            usage = session.execute(
                select(Rollup.tenant_id, Rollup.model, *sums, func.sum(Rollup.cost))
                .group_by(Rollup.tenant_id, Rollup.model)
                .order_by(Rollup.tenant_id, Rollup.model)
            ).all()
            outcomes = session.execute(
                select(OutcomeCount.model, OutcomeCount.status, func.sum(OutcomeCount.requests))
                .group_by(OutcomeCount.model, OutcomeCount.status)
                .order_by(OutcomeCount.model, OutcomeCount.status)
            ).all()
        for tenant, model, *counts, micro_usd in usage:
            for (kind, _), n in zip(KINDS, counts, strict=True):
                if n:
                    tokens.add_metric([tenant, model, kind], int(n))
            if micro_usd:
                cost.add_metric([tenant, model], int(micro_usd) / MICRO)
        for model, status, n in outcomes:
            requests.add_metric([model, status], int(n))
        return [tokens, cost, requests]


def observe_ledger_rows(rows: Iterable[dict[str, Any]]) -> None:
    """Observe the timings of ledger rows just committed (``billing.record_events``' return value)."""
    for row in rows:
        model = row["model"]
        duration, ttft = row["duration_s"], row["ttft_s"]
        DURATION.labels(model=model).observe(max(duration, 0.0))
        if ttft is not None:
            TTFT.labels(model=model).observe(max(ttft, 0.0))
            if row["output_tokens"] > 1:
                TPOT.labels(model=model).observe(max(duration - ttft, 0.0) / (row["output_tokens"] - 1))


def exposition(sessions: sessionmaker[Session] | None = None) -> tuple[bytes, str]:
    """The meters in Prometheus' text format, and its content type: the usage counters from the database of
    ``sessions`` (none without it), then this process's observations (every API process's under
    ``PROMETHEUS_MULTIPROC_DIR``)."""
    observed = REGISTRY
    if os.environ.get(MULTIPROC_ENV):
        observed = CollectorRegistry()
        MultiProcessCollector(observed)
    body = generate_latest(observed)
    if sessions is not None:
        body = generate_latest(LedgerCollector(sessions)) + body  # anything with collect() will do
    return body, CONTENT_TYPE_LATEST
