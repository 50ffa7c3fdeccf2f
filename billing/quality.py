"""Service quality per (tenant, UTC day, model, key): latency histograms, how requests ended, and 429s by limit.

Latency: each ledger row adds one count to a fixed, log-spaced histogram bucket of its time to first token
("ttft") and of its time per output token after the first ("tpot", requests with at least two output
tokens), the way a Prometheus histogram does, in the ledger insert's transaction (``add_ledger_rows``): a
duplicate event inserts no ledger row and so moves no bucket. p50 / p95 are interpolated linearly inside the
bucket the rank falls in (Prometheus' ``histogram_quantile``), so they are exact to within one bucket (a
factor of 10^(1/6) ~ 1.47); a rank in the overflow bucket reports its lower bound, 100 s.

Outcomes: the same rows counted by (status, error code).

429s: a refused request never reaches a worker or the ledger. The gateway adds one to a Redis hash field per
(tenant, day, model, key, limit) (``rejection_field``; one O(1) HINCRBY, memory bounded by the combinations,
not the requests), and the billing consumer moves the hash into ``billing_rejections`` exactly once
(``flush_rejections``): it renames the hash to an in-flight key stamped with a fresh token, adds the counts
and records the token in one transaction, then deletes the in-flight key. A consumer that dies after its
commit leaves the in-flight key behind; whoever takes it next finds its token recorded and only deletes it.
"""

from __future__ import annotations

import json
import secrets
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import Any

from redis import Redis
from sqlalchemy import Table, delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from billing.schema import (
    NO_ERROR,
    NO_KEY,
    LatencyBucket,
    OutcomeCount,
    RejectionCount,
    RejectionFlush,
    utcnow,
)
from billing.upserts import add_to_sums, insert_for

# Bucket upper bounds in seconds: 1 ms to 100 s, six per decade. Bucket i holds [BOUNDS[i-1], BOUNDS[i]);
# bucket 0 is [0, 1 ms), bucket len(BOUNDS) is [100 s, inf).
BOUNDS: tuple[float, ...] = tuple(1e-3 * 10 ** (i / 6) for i in range(31))
METRICS = ("ttft", "tpot")
# The limits a refusal names: limits.LIMITS in tessera, "capacity" for a busy model asked to reject or a
# tenant at its in-flight bound, "overload" for a request the API could not admit in time (503).
LIMITS = (
    "rpm", "tpm", "concurrency", "daily_tokens", "monthly_tokens", "monthly_spend", "capacity", "overload",
)  # fmt: skip
FLUSH_KEEP = timedelta(days=7)  # how long a flush token is remembered (an in-flight batch lives seconds)


def bucket_of(seconds: float) -> int:
    return bisect_right(BOUNDS, max(seconds, 0.0))


def quantile(counts: Mapping[int, int], q: float) -> float | None:
    """The ``q`` quantile of a histogram (bucket -> count), interpolated inside its bucket; None if empty."""
    total = sum(counts.values())
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for bucket in sorted(counts):
        count = counts[bucket]
        if count and seen + count >= rank:
            if bucket >= len(BOUNDS):
                return BOUNDS[-1]
            lower = 0.0 if bucket == 0 else BOUNDS[bucket - 1]
            return lower + (BOUNDS[bucket] - lower) * (rank - seen) / count
        seen += count
    return BOUNDS[-1]


def latencies(row: Mapping[str, Any]) -> dict[str, float]:
    """A ledger row's ttft and tpot in seconds (as billing.metrics observes them); absent when unknown."""
    ttft = row["ttft_s"]
    if ttft is None:
        return {}
    out = {"ttft": max(ttft, 0.0)}
    if row["output_tokens"] > 1:
        out["tpot"] = max(row["duration_s"] - ttft, 0.0) / (row["output_tokens"] - 1)
    return out


def _add_counts(session: Session, table: Table, keys: tuple[str, ...], counts: Mapping[tuple, int]) -> None:
    """Add ``counts`` (key tuple -> requests) to ``table``'s ``requests``, in one key order for every writer."""
    values = [{**dict(zip(keys, key, strict=True)), "requests": n} for key, n in sorted(counts.items())]
    add_to_sums(session, table, keys, ("requests",), values)


LATENCY_KEYS = ("tenant_id", "day", "model", "key_id", "metric", "bucket")
OUTCOME_KEYS = ("tenant_id", "day", "model", "key_id", "status", "error_code")
REJECTION_KEYS = ("tenant_id", "day", "model", "key_id", "limit_name")


# The same counts in PostgreSQL, as SELECTs over ``new`` (the ledger rows the statement really inserted) for
# billing.ledger's one-statement insert: width_bucket(x, BOUNDS) is bisect_right, and float8 arithmetic is
# Python's, so both paths put a request in the same bucket (tests run both).
_PG_BOUNDS = "ARRAY[" + ", ".join(repr(b) for b in BOUNDS) + "]::float8[]"
PG_LATENCY_SELECT = (
    f"SELECT tenant_id, day, model, coalesce(key_id, '{NO_KEY}'), m.metric, width_bucket(m.seconds, "
    f"{_PG_BOUNDS}), count(*) FROM new CROSS JOIN LATERAL (VALUES ('ttft', greatest(ttft_s, 0)), ('tpot', "
    "CASE WHEN output_tokens > 1 THEN greatest(duration_s - ttft_s, 0) / (output_tokens - 1) END)) "
    "AS m(metric, seconds) WHERE ttft_s IS NOT NULL AND m.seconds IS NOT NULL"  # greatest() skips NULLs
)
PG_OUTCOME_SELECT = (
    f"SELECT tenant_id, day, model, coalesce(key_id, '{NO_KEY}'), status, coalesce(error_code, '{NO_ERROR}'), "
    "count(*) FROM new"
)


def add_ledger_rows(session: Session, rows: Iterable[Mapping[str, Any]]) -> None:
    """Count ledger rows just inserted (in their transaction) into the latency buckets and outcome counts
    (SQLite; PostgreSQL counts them in the insert statement itself, with the SELECTs above)."""
    buckets: dict[tuple, int] = defaultdict(int)
    outcomes: dict[tuple, int] = defaultdict(int)
    for row in rows:
        scope = (row["tenant_id"], row["day"], row["model"], row["key_id"] or NO_KEY)
        for metric, seconds in latencies(row).items():
            buckets[(*scope, metric, bucket_of(seconds))] += 1
        outcomes[(*scope, row["status"], row["error_code"] or NO_ERROR)] += 1
    if buckets:
        _add_counts(session, LatencyBucket.__table__, LATENCY_KEYS, buckets)
    if outcomes:
        _add_counts(session, OutcomeCount.__table__, OUTCOME_KEYS, outcomes)


# --- 429s: Redis counters, flushed exactly once --------------------------------------------------------------


def rejections_key(stream: str) -> str:
    """The Redis hash of 429 counters that goes with the outcome stream ``stream``."""
    return f"{stream}:rejections"


def rejection_field(tenant_id: str, day: date, model: str, key_id: str | None, limit: str) -> str:
    """The hash field a refused request adds one to (JSON: model names may hold any character)."""
    return json.dumps([tenant_id, day.isoformat(), model, key_id or NO_KEY, limit])


TOKEN_FIELD = ""  # the in-flight hash's token; counter fields are JSON arrays, never empty
# KEYS: live hash, in-flight hash. ARGV: a fresh token. Returns the in-flight hash (taken now or left over).
_TAKE = """
if redis.call('exists', KEYS[2]) == 0 then
  if redis.call('exists', KEYS[1]) == 0 then return {} end
  redis.call('rename', KEYS[1], KEYS[2])
  redis.call('hset', KEYS[2], '', ARGV[1])
end
return redis.call('hgetall', KEYS[2])
"""
_DONE = """
if redis.call('hget', KEYS[1], '') == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def flush_rejections(redis: Redis, sessions: sessionmaker[Session], key: str) -> int:
    """Move the 429 counters of hash ``key`` into ``billing_rejections``; returns the requests added."""
    inflight = f"{key}:inflight"
    reply = redis.eval(_TAKE, 2, key, inflight, secrets.token_hex(16))
    if not reply:
        return 0
    fields = {_text(name): _text(value) for name, value in zip(reply[::2], reply[1::2], strict=True)}
    token = fields.pop(TOKEN_FIELD)
    counts: dict[tuple, int] = defaultdict(int)
    for name, n in fields.items():
        tenant_id, day, model, key_id, limit = json.loads(name)
        counts[(tenant_id, date.fromisoformat(day), model, key_id, limit)] += int(n)
    added = 0
    with sessions() as session:
        try:
            now = utcnow()
            stmt = insert_for(session, RejectionFlush.__table__).on_conflict_do_nothing(
                index_elements=["token"]
            )
            first = session.execute(stmt.values(token=token, flushed_at=now).returning(RejectionFlush.token))
            if first.first() is not None:  # else a consumer that died after its commit added them already
                _add_counts(session, RejectionCount.__table__, REJECTION_KEYS, counts)
                added = sum(counts.values())
            session.execute(delete(RejectionFlush).where(RejectionFlush.flushed_at < now - FLUSH_KEEP))
            session.commit()
        except BaseException:
            session.rollback()
            raise
    redis.eval(_DONE, 1, inflight, token)
    return added


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- the report ---------------------------------------------------------------------------------------------


@dataclass
class Quality:
    """One day's (or the range's) service quality."""

    latency: dict[str, dict[int, int]] = field(default_factory=lambda: {m: {} for m in METRICS})
    by_status: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # failed and cancelled requests by error code
    rejected: dict[str, int] = field(default_factory=dict)  # 429s by limit

    def percentile(self, metric: str, q: float) -> float | None:
        return quantile(self.latency[metric], q)

    def samples(self, metric: str) -> int:
        return sum(self.latency[metric].values())

    def add(self, other: Quality) -> None:
        for metric in METRICS:
            _merge(self.latency[metric], other.latency[metric])
        _merge(self.by_status, other.by_status)
        _merge(self.errors, other.errors)
        _merge(self.rejected, other.rejected)


def _merge(into: dict, more: Mapping) -> None:
    for name, n in more.items():
        into[name] = into.get(name, 0) + n


def quality_report(
    session: Session,
    tenant_id: str | None,
    *,
    start: date,
    end: date,
    model: str | None = None,
    key_id: str | None = None,
) -> tuple[dict[date, Quality], Quality]:
    """``tenant_id``'s quality (None: every tenant's) on the UTC days ``start`` to ``end`` (both included): per
    day that has any, and in total. Three aggregate queries over the counts, never the ledger."""
    days: dict[date, Quality] = defaultdict(Quality)

    def scoped(table, *columns):
        query = (
            select(table.day, *columns, func.sum(table.requests))
            .where(table.day >= start, table.day <= end)
            .group_by(table.day, *columns)
        )
        if tenant_id is not None:
            query = query.where(table.tenant_id == tenant_id)
        if model is not None:
            query = query.where(table.model == model)
        if key_id is not None:
            query = query.where(table.key_id == key_id)
        return session.execute(query).all()

    for day, metric, bucket, n in scoped(LatencyBucket, LatencyBucket.metric, LatencyBucket.bucket):
        days[day].latency.setdefault(metric, {})[bucket] = int(n)
    for day, status, code, n in scoped(OutcomeCount, OutcomeCount.status, OutcomeCount.error_code):
        quality = days[day]
        _merge(quality.by_status, {status: int(n)})
        if code != NO_ERROR:
            _merge(quality.errors, {code: int(n)})
    for day, limit, n in scoped(RejectionCount, RejectionCount.limit_name):
        _merge(days[day].rejected, {limit: int(n)})
    total = Quality()
    for quality in days.values():
        total.add(quality)
    return dict(sorted(days.items())), total
