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
import os
import secrets
import socket
import threading
import time
from datetime import timedelta

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import ResponseError
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from billing import metrics, quality
from billing.invoices import DEFAULT_GRACE
from billing.ledger import UsageEvent, record_events

log = logging.getLogger(__name__)

GROUP = "tessera-billing"
OUTCOME_FIELD = b"outcome"  # tessera.records.OUTCOME_FIELD: the entry's JSON
MAX_BACKOFF_S = 30.0

Entry = tuple[bytes, dict[bytes, bytes] | None]


def billing_dead_letters(stream: str) -> str:
    return f"{stream}:billing-dead"


class BillingConsumer:
    """Charges the outcomes on ``stream`` into the ledger; ``start`` runs it on a daemon thread."""

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
        grace: timedelta = DEFAULT_GRACE,
        flush_s: float = 1.0,
    ):
        self.redis = redis
        self.sessions = sessions
        self.stream = stream
        self.group = group
        self.maxlen = maxlen
        self.claim_idle_s = claim_idle_s
        self.batch = batch
        self.block_s = block_s
        self.grace = grace  # how long a month's invoice stays open after it (billing.invoices)
        self.flush_s = flush_s  # how often the gateway's 429 counters move into the database
        self.rejections = quality.rejections_key(stream)
        self.consumer = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.charged = 0  # ledger rows this consumer inserted
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="tessera-billing", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        """Charge outcomes until ``stop``; failures (Redis or the database away) are retried with backoff."""
        failures = 0
        group_ready = False
        own_pending = True
        next_claim = next_flush = 0.0
        while not self._stop.is_set():
            try:
                if not group_ready:
                    self._create_group()
                    group_ready = True
                if time.monotonic() >= next_claim:
                    self._claim_abandoned()
                    next_claim = time.monotonic() + self.claim_idle_s
                if time.monotonic() >= next_flush:
                    quality.flush_rejections(self.redis, self.sessions, self.rejections)
                    next_flush = time.monotonic() + self.flush_s
                entries = self._read("0" if own_pending else ">")
                if entries:
                    self._charge(entries)
                elif own_pending:
                    own_pending = False
                failures = 0
            except Exception as exc:
                failures += 1
                own_pending = True
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    group_ready = False
                delay = min(MAX_BACKOFF_S, 0.5 * 2 ** min(failures - 1, 6))
                log.warning("billing consumer: %s: %s; retrying in %.1f s", type(exc).__name__, exc, delay)
                self._stop.wait(delay)

    def drain(self) -> int:
        """Charge everything pending and new until the stream has nothing more for this consumer (tests, CLI)."""
        self._create_group()
        self._claim_abandoned()
        total = 0
        for last_id in ("0", ">"):
            while entries := self._read(last_id, block=False):
                total += len(entries)
                self._charge(entries)
        quality.flush_rejections(self.redis, self.sessions, self.rejections)
        return total

    def _create_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _claim_abandoned(self) -> None:
        start: bytes | str = "0-0"
        while not self._stop.is_set():
            reply = self.redis.xautoclaim(
                self.stream,
                self.group,
                self.consumer,
                min_idle_time=int(self.claim_idle_s * 1000),
                start_id=start,
                count=self.batch,
            )
            start, entries = reply[0], reply[1]
            if len(reply) > 2 and reply[2]:
                log.error(
                    "%d outcomes were trimmed from %s before billing read them", len(reply[2]), self.stream
                )
            if entries:
                log.info("billing consumer: claimed %d abandoned outcomes", len(entries))
                self._charge(entries)
            if start in (b"0-0", "0-0"):
                return

    def _read(self, last_id: str, block: bool = True) -> list[Entry]:
        wait = None if (last_id == "0" or not block) else int(self.block_s * 1000)
        reply = self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: last_id}, count=self.batch, block=wait
        )
        return [entry for _, entries in reply or [] for entry in entries]

    def _charge(self, entries: list[Entry]) -> None:
        """Charge a batch in one transaction, then acknowledge it."""
        valid: list[tuple[bytes, dict, UsageEvent]] = []
        dead: list[tuple[bytes, dict, str]] = []
        for entry_id, fields in entries:
            if entry_id is None:
                continue
            if not fields:
                log.error("outcome %s was trimmed from %s before billing read it", entry_id, self.stream)
                continue
            raw = fields.get(OUTCOME_FIELD)
            try:
                if raw is None:
                    raise ValueError("no 'outcome' field")
                valid.append((entry_id, fields, UsageEvent.model_validate_json(raw)))
            except (ValidationError, ValueError) as exc:
                dead.append((entry_id, fields, f"malformed outcome: {exc}"))
        try:
            self._record([event for _, _, event in valid])
        except (IntegrityError, DataError):
            for entry_id, fields, event in valid:  # one refused row must not hold back the rest
                try:
                    self._record([event])
                except (IntegrityError, DataError) as exc:
                    dead.append((entry_id, fields, f"the database refused it: {exc.orig}"))
        for entry_id, fields, reason in dead:
            log.error(
                "outcome %s cannot be charged (%s); moved to %s",
                entry_id,
                reason,
                billing_dead_letters(self.stream),
            )
            self.redis.xadd(
                billing_dead_letters(self.stream),
                {**fields, b"entry_id": entry_id, b"reason": reason.encode()[:1000]},
                maxlen=self.maxlen,
                approximate=True,
            )
        done = [entry_id for entry_id, _ in entries if entry_id is not None]
        if done:
            self.redis.xack(self.stream, self.group, *done)

    def _record(self, events: list[UsageEvent]) -> None:
        if not events:
            return
        with self.sessions() as session:
            inserted = record_events(session, events, grace=self.grace)
        self.charged += len(inserted)
        metrics.observe_ledger_rows(inserted)  # committed: the meters move once per ledger row
