"""The control plane's Prometheus meters (prometheus-client) and their exposition for ``GET /metrics``.

Usage meters move in the billing consumer, once per ledger row it really inserted (after the commit; a
redelivered or duplicate event inserts nothing and moves nothing), so after the consumer catches up they equal
the ledger. Labels are bounded: tenant and model ids, token kind, status, limit name; never a request id.

Several API processes: set ``PROMETHEUS_MULTIPROC_DIR`` (an empty folder, the same for all of them, before they
start) and each one's ``/metrics`` reports the sum over all of them (``MultiProcessCollector``).
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
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
MICRO = 1_000_000

TOKENS = Counter(
    "tessera_tokens",
    "Tokens billed, by tenant, model and kind (cached input, fresh input, output)",
    ["tenant", "model", "kind"],
)
COST = Counter("tessera_cost_usd", "Cost billed in USD (the ledger's micro-USD / 1e6)", ["tenant", "model"])
REQUESTS = Counter("tessera_requests", "Requests billed, by how they ended", ["model", "status"])
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


def observe_ledger_rows(rows: Iterable[dict[str, Any]]) -> None:
    """Count ledger rows just committed (``billing.record_events``' return value): tokens, cost, requests and
    the request's timings."""
    for row in rows:
        tenant, model = row["tenant_id"], row["model"]
        for kind, column in KINDS:
            if row[column]:
                TOKENS.labels(tenant=tenant, model=model, kind=kind).inc(row[column])
        if row["cost"]:
            COST.labels(tenant=tenant, model=model).inc(row["cost"] / MICRO)
        REQUESTS.labels(model=model, status=row["status"]).inc()
        duration, ttft = row["duration_s"], row["ttft_s"]
        DURATION.labels(model=model).observe(max(duration, 0.0))
        if ttft is not None:
            TTFT.labels(model=model).observe(max(ttft, 0.0))
            if row["output_tokens"] > 1:
                TPOT.labels(model=model).observe(max(duration - ttft, 0.0) / (row["output_tokens"] - 1))


def exposition() -> tuple[bytes, str]:
    """This process's meters in Prometheus' text format (every API process's under ``PROMETHEUS_MULTIPROC_DIR``),
    and its content type."""
    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
