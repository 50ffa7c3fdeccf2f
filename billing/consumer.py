"""The billing consumer: reads the request-outcome stream with billing's own consumer group and writes the
ledger.

It is a separate consumer group from the request-records writer, so each of them sees every entry. Delivery
is at least once, charging exactly once: a batch is acknowledged (XACK) only after the transaction holding
its ledger rows and rollups commits, and the ledger is idempotent on the request id, so an entry charged but
not acknowledged (the consumer died between the two) is seen again harmlessly. A consumer killed before its
commit leaves nothing in the database; its delivered entries are claimed (XAUTOCLAIM) by any consumer once
idle for ``claim_idle_s``. An entry that can never be charged (malformed) moves to ``<stream>:billing-dead``.
Every ``flush_s`` it also moves the gateway's 429 counters into the database (``billing.quality``).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from billing import metrics, quality
from billing.invoices import DEFAULT_GRACE
from billing.ledger import UsageEvent, record_events
from billing.streams import GroupConsumer

log = logging.getLogger(__name__)

GROUP = "tessera-billing"
OUTCOME_FIELD = b"outcome"  # tessera.records.OUTCOME_FIELD: the entry's JSON


def billing_dead_letters(stream: str) -> str:
    return f"{stream}:billing-dead"


class BillingConsumer(GroupConsumer[UsageEvent]):
    """Charges the outcomes on ``stream`` into the ledger; ``start`` runs it on a daemon thread."""

    label = "billing consumer"
    thread_name = "tessera-billing"
    field = OUTCOME_FIELD

    def __init__(
        self,
        redis: Redis,
        sessions: sessionmaker[Session],
        stream: str,
        *,
        group: str = GROUP,
        maxlen: int = 1_000_000,
        claim_idle_s: float = 30.0,
        batch: int = 1000,  # entries per read and per ledger transaction (tessera bench usage: 200 vs 1000)
        block_s: float = 1.0,
        linger_s: float = 0.0,
        grace: timedelta = DEFAULT_GRACE,
        flush_s: float = 1.0,
    ):
        super().__init__(
            redis,
            sessions,
            stream,
            group=group,
            dead_stream=billing_dead_letters(stream),
            maxlen=maxlen,
            claim_idle_s=claim_idle_s,
            batch=batch,
            block_s=block_s,
            linger_s=linger_s,
        )
        self.grace = grace  # how long a month's invoice stays open after it (billing.invoices)
        self.flush_s = flush_s  # how often the gateway's 429 counters move into the database
        self.rejections = quality.rejections_key(stream)
        self.charged = 0  # ledger rows this consumer inserted
        self._next_flush = 0.0

    def parse(self, raw: bytes) -> UsageEvent:
        return UsageEvent.model_validate_json(raw)

    def write(self, items: list[UsageEvent]) -> None:
        if not items:
            return
        with self.sessions() as session:
            inserted = record_events(session, items, grace=self.grace)
        self.charged += len(inserted)
        metrics.observe_ledger_rows(inserted)  # committed: the meters move once per ledger row

    def periodic(self) -> None:
        """Every ``flush_s``, the gateway's 429 counters move into the database."""
        if time.monotonic() >= self._next_flush:
            quality.flush_rejections(self.redis, self.sessions, self.rejections)
            self._next_flush = time.monotonic() + self.flush_s

    def drain(self) -> int:
        self._next_flush = 0.0  # a drain always flushes
        return super().drain()
