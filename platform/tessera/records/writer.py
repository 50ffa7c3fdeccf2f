"""The database's side of the outcome stream: a consumer group whose writers store outcomes as request records.

Every API process runs one ``RecordWriter`` thread; together they drain the stream, each entry going to one
of them. Delivery is at least once, storage exactly once: an entry is acknowledged (XACK) only after the
transaction holding its row commits, and settling is idempotent on the request id, so an entry stored but
not acknowledged (its writer died between the two) is stored again harmlessly. Entries a dead or stalled
writer left unacknowledged are claimed (XAUTOCLAIM) by any writer once idle for ``claim_idle_s``. An entry
that can never be stored (malformed, or a row the database refuses) moves to ``<stream>:dead`` with the
reason, so one bad entry cannot hold back the rest.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import ResponseError
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from tessera import tenancy
from tessera.records.outcome import RequestOutcome
from tessera.records.recorder import OUTCOME_FIELD

log = logging.getLogger(__name__)

GROUP = "tessera-records"
STALE_CONSUMER_MS = (
    24 * 3600 * 1000
)  # consumers of exited writers, with nothing pending, are removed after this
MAX_BACKOFF_S = 30.0

Entry = tuple[bytes, dict[bytes, bytes] | None]  # (id, fields); no fields: trimmed before it was stored
Dead = tuple[bytes, dict[bytes, bytes], str]  # (id, fields, why it cannot be stored)


def dead_letters(stream: str) -> str:
    """The stream holding the entries of ``stream`` that could not be stored."""
    return f"{stream}:dead"


class RecordWriter:
    """Drains the outcome stream ``stream`` into ``request_records``; ``start`` runs it on a daemon thread."""

    def __init__(
        self,
        redis: Redis,
        sessions: sessionmaker[Session],
        stream: str,
        *,
        maxlen: int,
        claim_idle_s: float = 30.0,
        batch: int = 100,
        block_s: float = 1.0,
    ):
        self.redis = redis
        self.sessions = sessions
        self.stream = stream
        self.maxlen = maxlen
        self.claim_idle_s = claim_idle_s
        self.batch = batch
        self.block_s = block_s  # bounds how long ``stop`` waits
        # Unique per run: a restarted process is a new consumer, and claims what its old self left.
        self.consumer = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.written = 0  # records this writer changed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="tessera-records", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the batch in hand and stop; what is left stays in the stream for the other writers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        """Store outcomes until ``stop``; errors (Redis or the database away) are retried with backoff."""
        failures = 0
        group_ready = False
        own_pending = True  # this consumer's delivered, unacknowledged entries come first (after a failure)
        next_claim = 0.0
        while not self._stop.is_set():
            try:
                if not group_ready:
                    self._create_group()
                    group_ready = True
                if time.monotonic() >= next_claim:
                    self._claim_abandoned()
                    next_claim = time.monotonic() + self.claim_idle_s
                entries = self._read("0" if own_pending else ">")
                if entries:
                    self._store(entries)
                elif own_pending:
                    own_pending = False
                failures = 0
            except Exception as exc:  # the thread must outlive any one failure, or records pile up unseen
                failures += 1
                own_pending = True
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    group_ready = False  # the stream was deleted: make it and the group again
                delay = min(MAX_BACKOFF_S, 0.5 * 2 ** min(failures - 1, 6))
                log.warning(
                    "request records writer: %s: %s; retrying in %.1f s", type(exc).__name__, exc, delay
                )
                self._stop.wait(delay)

    def _create_group(self) -> None:
        try:
            # From id 0, so outcomes added before any writer started are stored too.
            self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        for consumer in self.redis.xinfo_consumers(self.stream, GROUP):
            if consumer["pending"] == 0 and consumer["idle"] > STALE_CONSUMER_MS:
                self.redis.xgroup_delconsumer(self.stream, GROUP, consumer["name"])

    def _claim_abandoned(self) -> None:
        """Take over the entries other writers were delivered but did not acknowledge in time."""
        start: bytes | str = "0-0"
        while not self._stop.is_set():
            reply = self.redis.xautoclaim(
                self.stream,
                GROUP,
                self.consumer,
                min_idle_time=int(self.claim_idle_s * 1000),
                start_id=start,
                count=self.batch,
            )
            start, entries = reply[0], reply[1]
            if len(reply) > 2 and reply[2]:  # Redis 7 drops trimmed entries from the pending list itself
                log.error(
                    "%d request outcomes were trimmed from %s before they were stored",
                    len(reply[2]),
                    self.stream,
                )
            if entries:
                log.info("request records writer: claimed %d abandoned outcomes", len(entries))
                self._store(entries)
            if start in (b"0-0", "0-0"):
                return

    def _read(self, last_id: str) -> list[Entry]:
        block = None if last_id == "0" else int(self.block_s * 1000)
        reply = self.redis.xreadgroup(
            GROUP, self.consumer, {self.stream: last_id}, count=self.batch, block=block
        )
        return [entry for _, entries in reply or [] for entry in entries]

    def _store(self, entries: list[Entry]) -> None:
        """Store a batch in one transaction, then acknowledge it."""
        valid, dead = self._parse(entries)
        try:
            self._settle([outcome for _, _, outcome in valid])
        except (IntegrityError, DataError):
            # One row the database refuses (e.g. for a tenant deleted meanwhile) must not hold back the rest.
            for entry_id, fields, outcome in valid:
                try:
                    self._settle([outcome])
                except (IntegrityError, DataError) as exc:
                    dead.append((entry_id, fields, f"the database refused it: {exc.orig}"))
        for entry_id, fields, reason in dead:
            log.error(
                "request outcome %s cannot be stored (%s); moved to %s",
                entry_id,
                reason,
                dead_letters(self.stream),
            )
            self.redis.xadd(
                dead_letters(self.stream),
                {**fields, b"entry_id": entry_id, b"reason": reason.encode()},
                maxlen=self.maxlen,
                approximate=True,
            )
        done = [entry_id for entry_id, _ in entries if entry_id is not None]
        if done:
            self.redis.xack(self.stream, GROUP, *done)

    def _parse(self, entries: list[Entry]) -> tuple[list[tuple[bytes, dict, RequestOutcome]], list[Dead]]:
        valid, dead = [], []
        for entry_id, fields in entries:
            if entry_id is None:
                continue
            if not fields:
                log.error(
                    "request outcome %s was trimmed from %s before it was stored", entry_id, self.stream
                )
                continue
            raw = fields.get(OUTCOME_FIELD.encode())
            if raw is None:
                dead.append((entry_id, fields, f"no {OUTCOME_FIELD!r} field"))
                continue
            try:
                valid.append((entry_id, fields, RequestOutcome.model_validate_json(raw)))
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'outcome'}: {e['msg']}" for e in exc.errors()
                )
                dead.append((entry_id, fields, f"malformed outcome: {problems}"))
        return valid, dead

    def _settle(self, outcomes: list[RequestOutcome]) -> None:
        if not outcomes:
            return
        with self.sessions() as session:
            self.written += len(tenancy.settle_records(session, [o.record() for o in outcomes]))
