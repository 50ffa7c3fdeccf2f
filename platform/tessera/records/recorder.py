"""The gateway's side of the outcome stream: one XADD per finished request, off the request's path; and one
HINCRBY per request refused with 429, on the counters billing moves into the database (``billing.quality``)."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

import billing
from tessera.models import utcnow
from tessera.records.outcome import RequestOutcome

log = logging.getLogger(__name__)

OUTCOME_FIELD = "outcome"  # each stream entry holds one RequestOutcome as JSON under this field
RETRY_DELAYS_S = (0.1, 0.5, 2.0)  # a Redis blip must not cost a record; an outage is logged with the record


class Recorder:
    """Appends request outcomes to the Redis Stream ``stream``, trimmed to about ``maxlen`` entries.

    Once XADD returns, the outcome survives this process (Redis persists it as configured); a writer
    stores it in the database later. ``submit`` never blocks the request: it starts a task, which
    ``close`` waits for at shutdown.
    """

    def __init__(self, redis: aioredis.Redis, stream: str, maxlen: int):
        self.redis = redis
        self.stream = stream
        self.maxlen = maxlen
        self._pending: set[asyncio.Task[None]] = set()

    def submit(self, outcome: RequestOutcome) -> None:
        """Queue ``outcome`` from the event loop (the SSE generator's ``finally`` cannot await)."""
        task = asyncio.get_running_loop().create_task(self.add(outcome))
        self._pending.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._pending.discard)

    async def add(self, outcome: RequestOutcome) -> None:
        entry = {OUTCOME_FIELD: outcome.model_dump_json()}
        for delay in (*RETRY_DELAYS_S, None):
            try:
                await self.redis.xadd(self.stream, entry, maxlen=self.maxlen, approximate=True)
                return
            except RedisError as exc:
                if delay is None:
                    # The whole outcome goes to the log, so an operator can replay it.
                    log.error(
                        "could not add the outcome of request %s to the Redis Stream %s (%s): %s",
                        outcome.request_id,
                        self.stream,
                        exc,
                        entry[OUTCOME_FIELD],
                    )
                    return
                await asyncio.sleep(delay)

    async def reject(self, tenant_id: str, key_id: str | None, model: str, limit: str) -> None:
        """Count a request refused with 429 by ``limit``: one counter per (tenant, day, model, key, limit),
        never a row per request. A Redis error loses the count, not the 429 (the refusal already happened)."""
        field = billing.rejection_field(tenant_id, utcnow().date(), model, key_id, limit)
        try:
            await self.redis.hincrby(billing.rejections_key(self.stream), field, 1)
        except RedisError as exc:
            log.warning("could not count a 429 (%s) of tenant %s: %s", limit, tenant_id, exc)

    async def close(self) -> None:
        """Wait for the outcomes still being added."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
