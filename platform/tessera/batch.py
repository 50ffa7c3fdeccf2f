"""Workers-AI async batches: the store (``batches`` and ``batch_items`` in the database) and ``BatchRunner``,
the asyncio task in every API process that runs queued items at low priority.

Items are claimed atomically (``UPDATE ... WHERE status = 'queued'``), so any number of API processes can run
the same queue and each item runs once per attempt. A runner marks itself alive in Redis; the items of a
runner that stopped heartbeating (its process died) go back to the queue, and a runner that stops cleanly
puts its own back, so a gateway restart resumes every unfinished item. How an item runs (through the same
path as an interactive request) is the ``dispatch`` the app gives the runner (``tessera.api.workers_ai``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from tessera.errors import NotFound
from tessera.models import ApiKey, Batch, BatchItem, Tenant, utcnow

log = logging.getLogger(__name__)

RUNNER_KEY = "tessera:batch:runner:{}"  # exists while that runner is alive


@dataclass(frozen=True)
class Claimed:
    """One item a runner claimed: what it needs to run it as a request of its tenant and key."""

    batch_id: str
    index: int
    tenant_id: str
    key_id: str | None
    model: str
    body: dict[str, Any]
    request_id: str  # this attempt's request id: its record, quota reservation and ledger entry
    attempts: int  # including this one
    key_valid: bool = True  # False: the key that queued it was revoked or expired since


@dataclass(frozen=True)
class Done:
    """Completed: ``result`` is Workers AI's ``{"response", "usage"}``."""

    result: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """Failed for good (the item itself cannot be served): ``error`` is ``{"code", "message"}``."""

    error: dict[str, Any]


@dataclass(frozen=True)
class Deferred:
    """Never reached a worker: back to the queue, the attempt not counted. ``quota``: the tenant's quota
    refused it (its items wait, others' run); else the deployment had no room (its items wait)."""

    retry_after_s: float
    quota: bool = False


@dataclass(frozen=True)
class Lost:
    """Reached a worker that died (or another fault on our side): back to the queue, the attempt counted."""

    error: dict[str, Any]


Outcome = Done | Failed | Deferred | Lost
Dispatch = Callable[[Claimed], Awaitable[Outcome]]
Ready = Callable[[str], Awaitable[bool]]


# --- the store ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchView:
    batch: Batch
    items: list[BatchItem]

    @property
    def status(self) -> str:
        """``queued`` until an item starts, ``running`` until every item ended, then ``done``."""
        states = {item.status for item in self.items}
        if states <= {"completed", "failed"}:
            return "done"
        if states == {"queued"}:
            return "queued"
        return "running"


def submit(
    session: Session,
    *,
    tenant_id: str,
    key_id: str | None,
    model: str,
    items: Sequence[tuple[Mapping[str, Any], str | None]],
) -> Batch:
    """Store a batch of validated run bodies (each with its optional ``external_reference``), all queued."""
    batch = Batch(id=uuid.uuid4().hex, tenant_id=tenant_id, key_id=key_id, model=model, items=len(items))
    session.add(batch)
    session.add_all(
        BatchItem(batch_id=batch.id, index=i, body=dict(body), external_reference=ref, status="queued")
        for i, (body, ref) in enumerate(items)
    )
    session.commit()
    return batch


def get_batch(session: Session, tenant_id: str, batch_id: str) -> BatchView:
    """The caller's batch; another tenant's is as unknown as one that never existed."""
    batch = session.get(Batch, batch_id) if len(batch_id) <= 32 else None
    if batch is None or batch.tenant_id != tenant_id:
        raise NotFound(
            f"no batch with request_id {batch_id!r}; pass the request_id the queued batch returned"
        )
    items = list(
        session.scalars(select(BatchItem).where(BatchItem.batch_id == batch_id).order_by(BatchItem.index))
    )
    return BatchView(batch, items)


def queued_models(session: Session) -> list[str]:
    """Models with items waiting to run (of tenants that are not suspended)."""
    query = (
        select(Batch.model)
        .distinct()
        .join(BatchItem, BatchItem.batch_id == Batch.id)
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(BatchItem.status == "queued", Tenant.disabled.is_(False))
    )
    return list(session.scalars(query))


def claim(
    session: Session, model: str, runner_id: str, limit: int, skip_tenants: Sequence[str] = ()
) -> list[Claimed]:
    """Claim up to ``limit`` queued items of ``model`` (not of ``skip_tenants``), oldest batch first. Each
    claim is one conditional UPDATE: of two runners racing for an item, exactly one changes its row, and
    only that one runs it."""
    query = (
        select(BatchItem.batch_id, BatchItem.index)
        .join(Batch, Batch.id == BatchItem.batch_id)
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(BatchItem.status == "queued", Batch.model == model, Tenant.disabled.is_(False))
    )
    if skip_tenants:
        query = query.where(Batch.tenant_id.not_in(skip_tenants))
    candidates = session.execute(
        query.order_by(Batch.created_at, Batch.id, BatchItem.index).limit(limit)
    ).all()
    claimed = []
    for batch_id, index in candidates:
        request_id = f"req_{uuid.uuid4().hex}"
        won = session.execute(
            update(BatchItem)
            .where(BatchItem.batch_id == batch_id, BatchItem.index == index, BatchItem.status == "queued")
            .values(
                status="running",
                claimed_by=runner_id,
                request_id=request_id,
                attempts=BatchItem.attempts + 1,
                updated_at=utcnow(),
            )
        ).rowcount
        session.commit()
        if won:
            item = session.get(BatchItem, (batch_id, index), populate_existing=True)
            batch = session.get(Batch, batch_id)
            assert item is not None and batch is not None
            key = session.get(ApiKey, batch.key_id) if batch.key_id is not None else None
            key_valid = key is None or (
                key.revoked_at is None and (key.expires_at is None or key.expires_at > utcnow())
            )
            claimed.append(
                Claimed(
                    batch_id=batch_id,
                    index=index,
                    tenant_id=batch.tenant_id,
                    key_id=batch.key_id,
                    model=batch.model,
                    body=dict(item.body),
                    request_id=request_id,
                    attempts=item.attempts,
                    key_valid=key_valid,
                )
            )
    return claimed


def finish(session: Session, item: Claimed, runner_id: str, outcome: Outcome, max_attempts: int) -> bool:
    """Store an attempt's outcome; False when this runner no longer holds the item (it was given back to
    the queue meanwhile, and another attempt decides it)."""
    values: dict[str, Any] = {"claimed_by": None, "updated_at": utcnow()}
    if isinstance(outcome, Done):
        values.update(status="completed", result=outcome.result, error=None)
    elif isinstance(outcome, Failed):
        values.update(status="failed", error=outcome.error)
    elif isinstance(outcome, Deferred):
        values.update(status="queued", attempts=BatchItem.attempts - 1)
    elif item.attempts >= max_attempts:
        message = (
            f"{outcome.error.get('message', 'the request failed')} (gave up after {item.attempts} attempts)"
        )
        values.update(status="failed", error={**outcome.error, "message": message})
    else:
        values.update(status="queued", error=outcome.error)
    changed = session.execute(
        update(BatchItem)
        .where(
            BatchItem.batch_id == item.batch_id,
            BatchItem.index == item.index,
            BatchItem.status == "running",
            BatchItem.claimed_by == runner_id,
            BatchItem.request_id == item.request_id,
        )
        .values(**values)
    ).rowcount
    session.commit()
    return bool(changed)


def running_claimants(session: Session) -> list[str]:
    return list(session.scalars(select(BatchItem.claimed_by).distinct().where(BatchItem.status == "running")))


def release(session: Session, runner_id: str, *, interrupted_by_us: bool, max_attempts: int) -> int:
    """Give a runner's running items back to the queue; returns how many. A runner stopping cleanly
    (``interrupted_by_us``) does not count the attempts it cut short; a dead runner's count, and an item
    whose attempts are spent fails instead."""
    now = utcnow()
    base = update(BatchItem).where(BatchItem.status == "running", BatchItem.claimed_by == runner_id)
    if interrupted_by_us:
        requeued = session.execute(
            base.values(status="queued", claimed_by=None, attempts=BatchItem.attempts - 1, updated_at=now)
        ).rowcount
    else:
        error = {
            "code": "gateway_restarted",
            "message": f"the gateway running this item stopped during each of {max_attempts} attempts",
        }
        session.execute(
            base.where(BatchItem.attempts >= max_attempts).values(
                status="failed", claimed_by=None, error=error, updated_at=now
            )
        )
        requeued = session.execute(base.values(status="queued", claimed_by=None, updated_at=now)).rowcount
    session.commit()
    return requeued


_REVOKED = Failed(
    {
        "code": "invalid_api_key",
        "message": "the API key that queued this batch was revoked or has expired; queue it again with a valid key",
        "status": 401,
    }
)


# --- the runner -----------------------------------------------------------------------------------------


class BatchRunner:
    """Runs queued batch items while their deployment has room: at most ``concurrency`` at a time in this
    process, and only while ``ready(model)`` (its queues are short: interactive requests go first)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        redis: aioredis.Redis,
        dispatch: Dispatch,
        ready: Ready,
        *,
        concurrency: int = 4,
        poll_s: float = 0.5,
        runner_ttl_s: float = 10.0,
        max_attempts: int = 3,
        retry_cap_s: float = 5.0,
        runner_id: str | None = None,
    ):
        self.sessions = sessions
        self.redis = redis
        self.dispatch = dispatch
        self.ready = ready
        self.concurrency = concurrency
        self.poll_s = poll_s
        self.runner_ttl_s = runner_ttl_s
        self.max_attempts = max_attempts
        self.retry_cap_s = retry_cap_s
        self.runner_id = runner_id or f"runner-{uuid.uuid4().hex[:12]}"
        self.passes = 0  # loop iterations so far (tests wait on it instead of on time)
        self._running: set[asyncio.Task[None]] = set()
        # Deferred work is not retried before a monotonic time: per model (no room) and per tenant (quota).
        self._model_not_before: dict[str, float] = {}
        self._tenant_not_before: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None
        self._last_orphan_check = 0.0

    def wake(self) -> None:
        """Look for work now (a batch was just queued)."""
        self._wake.set()

    async def start(self) -> None:
        await self._beat()
        self._loop_task = asyncio.create_task(self._loop(), name=f"batch-runner-{self.runner_id}")

    async def stop(self) -> None:
        """Stop claiming, cut short the items in flight and give them back to the queue."""
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        requeued = await run_in_threadpool(self._release, self.runner_id, True)
        if requeued:
            log.info("batch runner %s stopping: %d items back in the queue", self.runner_id, requeued)
        with contextlib.suppress(RedisError):
            await self.redis.delete(RUNNER_KEY.format(self.runner_id))

    async def _loop(self) -> None:
        while True:
            try:
                await self._pass()
            except asyncio.CancelledError:
                raise
            except Exception:  # the database or Redis is away: keep going, the next pass retries
                log.exception("batch runner %s: a pass failed", self.runner_id)
            self.passes += 1
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def _pass(self) -> None:
        await self._beat()
        now = time.monotonic()
        if now - self._last_orphan_check >= self.runner_ttl_s / 2:
            self._last_orphan_check = now
            await self._requeue_orphans()
        free = self.concurrency - len(self._running)
        if free <= 0:
            return
        for model in await run_in_threadpool(self._queued_models):
            if free <= 0:
                break
            now = time.monotonic()
            if self._model_not_before.get(model, 0.0) > now or not await self.ready(model):
                continue
            waiting = [t for t, until in self._tenant_not_before.items() if until > now]
            for item in await run_in_threadpool(self._claim, model, free, waiting):
                free -= 1
                task = asyncio.create_task(self._run(item))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _run(self, item: Claimed) -> None:
        try:
            outcome = await self.dispatch(item) if item.key_valid else _REVOKED
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a fault of ours: retried, within the attempts
            log.exception("batch item %s/%d (request %s) failed", item.batch_id, item.index, item.request_id)
            outcome = Lost({"code": "internal_error", "message": f"the gateway failed the item: {e}"})
        if self._stopping and not isinstance(outcome, (Done, Failed)):
            return  # cut short by our own stop (as it surfaced, e.g. a lost stream): ``stop`` requeues it
        if isinstance(outcome, Deferred):
            until = time.monotonic() + min(max(outcome.retry_after_s, self.poll_s), self.retry_cap_s)
            if outcome.quota:
                self._tenant_not_before[item.tenant_id] = until
            else:
                self._model_not_before[item.model] = until
        await run_in_threadpool(self._finish, item, outcome)
        self._wake.set()

    async def _beat(self) -> None:
        with contextlib.suppress(RedisError):
            await self.redis.set(RUNNER_KEY.format(self.runner_id), b"1", px=int(self.runner_ttl_s * 1000))

    async def _requeue_orphans(self) -> None:
        """Items claimed by a runner that is no longer alive (its process died) go back to the queue."""
        for claimant in await run_in_threadpool(self._claimants):
            if claimant is None or claimant == self.runner_id:
                continue
            try:
                alive = await self.redis.exists(RUNNER_KEY.format(claimant))
            except RedisError:
                return  # unknown: never take items from a runner that may be alive
            if not alive:
                requeued = await run_in_threadpool(self._release, claimant, False)
                log.warning("batch runner %s is gone: %d of its items back in the queue", claimant, requeued)

    # Sync database work, run in threads.

    def _queued_models(self) -> list[str]:
        with self.sessions() as session:
            return queued_models(session)

    def _claim(self, model: str, limit: int, skip_tenants: list[str]) -> list[Claimed]:
        with self.sessions() as session:
            return claim(session, model, self.runner_id, limit, skip_tenants)

    def _finish(self, item: Claimed, outcome: Outcome) -> None:
        with self.sessions() as session:
            if not finish(session, item, self.runner_id, outcome, self.max_attempts):
                log.warning(
                    "batch item %s/%d was taken from this runner; dropped its outcome",
                    item.batch_id,
                    item.index,
                )

    def _claimants(self) -> list[str]:
        with self.sessions() as session:
            return running_claimants(session)

    def _release(self, runner_id: str, interrupted_by_us: bool) -> int:
        with self.sessions() as session:
            return release(
                session, runner_id, interrupted_by_us=interrupted_by_us, max_attempts=self.max_attempts
            )
