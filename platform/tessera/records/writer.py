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

from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from billing.streams import GroupConsumer
from tessera.records.outcome import RequestOutcome
from tessera.records.recorder import OUTCOME_FIELD
from tessera.records.store import settle_records

log = logging.getLogger(__name__)

GROUP = "tessera-records"
# Consumers of exited writers, with nothing pending, are removed after this.
STALE_CONSUMER_MS = 24 * 3600 * 1000


def dead_letters(stream: str) -> str:
    """The stream holding the entries of ``stream`` that could not be stored."""
    return f"{stream}:dead"


class RecordWriter(GroupConsumer[RequestOutcome]):
    """Drains the outcome stream ``stream`` into ``request_records``; ``start`` runs it on a daemon thread."""

    label = "request records writer"
    thread_name = "tessera-records"
    field = OUTCOME_FIELD.encode()

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
        linger_s: float = 0.0,
    ):
        super().__init__(
            redis,
            sessions,
            stream,
            group=GROUP,
            dead_stream=dead_letters(stream),
            maxlen=maxlen,
            claim_idle_s=claim_idle_s,
            batch=batch,
            block_s=block_s,
            linger_s=linger_s,
        )
        self.written = 0  # records this writer changed

    def parse(self, raw: bytes) -> RequestOutcome:
        return RequestOutcome.model_validate_json(raw)

    def write(self, items: list[RequestOutcome]) -> None:
        if not items:
            return
        with self.sessions() as session:
            self.written += len(settle_records(session, [o.record() for o in items]))

    def after_group_created(self) -> None:
        for consumer in self.redis.xinfo_consumers(self.stream, GROUP):
            if consumer["pending"] == 0 and consumer["idle"] > STALE_CONSUMER_MS:
                self.redis.xgroup_delconsumer(self.stream, GROUP, consumer["name"])
