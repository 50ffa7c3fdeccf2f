"""A Redis consumer group that turns stream entries into database rows, at least once, exactly once stored.

The request-records writer (``tessera.records``) and the billing consumer both read the outcome stream this
way, each with its own group, so each sees every entry. A batch is acknowledged (XACK) only after the
transaction holding its rows commits, and the subclass's ``write`` is idempotent on the request id, so an
entry written but not acknowledged (the consumer died between the two) is written again harmlessly.
Entries a dead or stalled consumer left unacknowledged are claimed (XAUTOCLAIM) by any consumer once idle
for ``claim_idle_s``. An entry that can never be written (malformed, or a row the database refuses) moves
to a dead-letter stream with the reason, so one bad entry cannot hold back the rest.

A transaction costs far more than a row (``billing.record_events`` on SQLite, measured: 5.2–6.5 ms of CPU
per row one at a time, 0.2–0.6 at 64 a transaction), so after a batch smaller than ``batch`` the consumer
waits ``linger_s`` before its next read: under steady traffic entries are written a few times a second in
batches, not one transaction each; an entry after a quiet spell is still written at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import Generic, TypeVar

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import ResponseError
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
REASON_BYTES = 1000  # a dead letter's reason is cut to this (at a character boundary)
# SQLSTATE classes of a database that is away or busy: connection exception, transaction rollback
# (serialization, deadlock), insufficient resources, operator intervention (shutdown).
TRANSIENT_SQLSTATE = frozenset({"08", "40", "53", "57"})
MAX_DELIVERIES = 20  # an entry no write stores this many times (~8 min of backoff) is moved aside


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` says the database (or the link to it) is away, not that the rows are wrong: such a
    batch waits and is retried, never dead-lettered."""
    if isinstance(exc, PoolTimeout):
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
        if code:
            return str(code)[:2] in TRANSIENT_SQLSTATE
        return isinstance(exc, (OperationalError, InterfaceError))  # SQLite: locked, disk I/O, no table yet
    return isinstance(exc, (ConnectionError, TimeoutError))


Entry = tuple[bytes, dict[bytes, bytes] | None]  # (id, fields); no fields: trimmed before it was read
Dead = tuple[bytes, dict[bytes, bytes], str]  # (id, fields, why it cannot be written)
T = TypeVar("T")


def _refusal(exc: Exception) -> str:
    if isinstance(exc, (IntegrityError, DataError)):
        return f"the database refused it: {exc.orig}"
    return f"it could not be written: {type(exc).__name__}: {exc}"


def _cut(text: str, limit: int) -> bytes:
    """``text`` as UTF-8 of at most ``limit`` bytes, never ending in part of a character."""
    return text.encode()[:limit].decode("utf-8", "ignore").encode()


def validation_problems(exc: ValidationError) -> str:
    """A pydantic error as one line: ``field.path: message; ...``."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'outcome'}: {e['msg']}" for e in exc.errors())


class GroupConsumer(Generic[T]):
    """Drains ``stream`` through consumer group ``group``; ``start`` runs it on a daemon thread.

    Subclasses name what they do (``label``, ``thread_name``), say where an entry's payload is
    (``field``), and implement ``parse`` (payload → item; raises ValidationError or ValueError) and
    ``write`` (one transaction for a batch of items; IntegrityError or DataError if the database refuses one).
    """

    label = "stream consumer"  # how log lines name it
    thread_name = "tessera-stream-consumer"
    field: bytes = b"outcome"

    def __init__(
        self,
        redis: Redis,
        sessions: sessionmaker[Session],
        stream: str,
        *,
        group: str,
        dead_stream: str,
        maxlen: int,
        claim_idle_s: float = 30.0,
        batch: int = 100,
        block_s: float = 1.0,
        linger_s: float = 0.0,
        max_deliveries: int = MAX_DELIVERIES,
    ):
        self.redis = redis
        self.sessions = sessions
        self.stream = stream
        self.group = group
        self.dead_stream = dead_stream
        self.maxlen = maxlen
        self.claim_idle_s = claim_idle_s
        self.batch = batch  # entries per read and per transaction
        self.block_s = block_s  # bounds how long ``stop`` waits
        self.linger_s = linger_s  # the wait after a short batch, for the next one to fill
        self.max_deliveries = max_deliveries
        # Unique per run: a restarted process is a new consumer, and claims what its old self left.
        self.consumer = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what a subclass provides ----------------------------------------------------------------------

    def parse(self, raw: bytes) -> T:
        raise NotImplementedError

    def write(self, items: list[T]) -> None:
        raise NotImplementedError

    def periodic(self) -> None:
        """Called from the loop between reads (and once per ``drain``); nothing by default."""

    def after_group_created(self) -> None:
        """Called each time the group is (re)made or found; nothing by default."""

    # -- the loop ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the batch in hand and stop; what is left stays in the stream for the other consumers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        """Write entries until ``stop``; errors (Redis or the database away) are retried with backoff."""
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
                self.periodic()
                entries = self._read("0" if own_pending else ">")
                if entries:
                    self._handle(entries)
                elif own_pending:
                    own_pending = False
                failures = 0
                if entries and len(entries) < self.batch and self.linger_s > 0:
                    self._stop.wait(self.linger_s)
            except Exception as exc:  # the thread must outlive any one failure, or entries pile up unseen
                failures += 1
                own_pending = True
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    group_ready = False  # the stream was deleted: make it and the group again
                delay = min(MAX_BACKOFF_S, 0.5 * 2 ** min(failures - 1, 6))
                log.warning("%s: %s: %s; retrying in %.1f s", self.label, type(exc).__name__, exc, delay)
                self._stop.wait(delay)

    def drain(self) -> int:
        """Write everything pending and new until the stream has nothing more for this consumer (tests, CLI)."""
        self._create_group()
        self._claim_abandoned()
        total = 0
        for last_id in ("0", ">"):
            while entries := self._read(last_id, block=False):
                total += len(entries)
                self._handle(entries)
        self.periodic()
        return total

    def _create_group(self) -> None:
        try:
            # From id 0, so entries added before any consumer started are written too.
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.after_group_created()

    def _claim_abandoned(self) -> None:
        """Take over the entries other consumers were delivered but did not acknowledge in time."""
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
            if len(reply) > 2 and reply[2]:  # Redis 7 drops trimmed entries from the pending list itself
                log.error(
                    "%s: %d entries were trimmed from %s unread", self.label, len(reply[2]), self.stream
                )
            if entries:
                log.info("%s: claimed %d abandoned entries", self.label, len(entries))
                self._handle(entries)
            if start in (b"0-0", "0-0"):
                return

    def _read(self, last_id: str, block: bool = True) -> list[Entry]:
        wait = None if (last_id == "0" or not block) else int(self.block_s * 1000)
        reply = self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: last_id}, count=self.batch, block=wait
        )
        return [entry for _, entries in reply or [] for entry in entries]

    def _handle(self, entries: list[Entry]) -> None:
        """Write a batch in one transaction, move what cannot be written aside, then acknowledge it all."""
        valid, dead = self._parse(entries)
        try:
            self.write([item for _, _, item in valid])
        except Exception as batch_error:
            if transient(batch_error):
                raise
            # Row by row, so that one entry the database (or ``write``) refuses does not hold back the
            # rest. When every row fails too, and not as a row the database refuses, the cause may not be
            # in the entries (a schema not migrated, a bug): the batch stays pending and is retried, until
            # its entries have been delivered ``max_deliveries`` times.
            refused = []
            for entry_id, fields, item in valid:
                try:
                    self.write([item])
                except Exception as exc:
                    if transient(exc):
                        raise
                    refused.append((entry_id, fields, _refusal(exc)))
            systemic = not isinstance(batch_error, (IntegrityError, DataError))
            if systemic and len(refused) == len(valid):
                deliveries = self._deliveries([entry_id for entry_id, _, _ in refused])
                if min(deliveries.values(), default=0) < self.max_deliveries:
                    raise
                refused = [(i, f, f"{why} (on each of {deliveries[i]} deliveries)") for i, f, why in refused]
            dead += refused
        for entry_id, fields, reason in dead:
            log.error(
                "%s: entry %s cannot be written (%s); moved to %s",
                self.label,
                entry_id,
                reason,
                self.dead_stream,
            )
            self.redis.xadd(
                self.dead_stream,
                {**fields, b"entry_id": entry_id, b"reason": _cut(reason, REASON_BYTES)},
                maxlen=self.maxlen,
                approximate=True,
            )
        done = [entry_id for entry_id, _ in entries if entry_id is not None]
        if done:
            self.redis.xack(self.stream, self.group, *done)

    def _deliveries(self, entry_ids: list[bytes]) -> dict[bytes, int]:
        """How many times each of ``entry_ids`` (pending in the group) has been delivered."""
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        replies = pipe.execute()
        return {
            entry_id: (reply[0]["times_delivered"] if reply else 0)
            for entry_id, reply in zip(entry_ids, replies, strict=True)
        }

    def _parse(self, entries: list[Entry]) -> tuple[list[tuple[bytes, dict, T]], list[Dead]]:
        valid: list[tuple[bytes, dict, T]] = []
        dead: list[Dead] = []
        for entry_id, fields in entries:
            if entry_id is None:
                continue
            if not fields:
                log.error(
                    "%s: entry %s was trimmed from %s before it was read", self.label, entry_id, self.stream
                )
                continue
            raw = fields.get(self.field)
            if raw is None:
                dead.append((entry_id, fields, f"no {self.field.decode()!r} field"))
                continue
            try:
                valid.append((entry_id, fields, self.parse(raw)))
            except ValidationError as exc:
                dead.append((entry_id, fields, f"malformed outcome: {validation_problems(exc)}"))
            except ValueError as exc:
                dead.append((entry_id, fields, f"malformed outcome: {exc}"))
        return valid, dead
