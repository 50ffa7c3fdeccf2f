"""Pick the worker queue for a request: live workers from heartbeats, rendezvous-hashed by affinity key.

The same affinity key lands on the same worker while it lives, so a session's (or a shared prompt
prefix's) KV pages stay in one worker's prefix cache; when a worker dies only its keys move.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from gpu_workers import lifecycle
from gpu_workers.protocol import (
    TASK_PREFILL,
    TASK_SERVE,
    DeploymentSpec,
    WorkerInfo,
    worker_queue,
    workers_key,
)


class NoLiveWorker(Exception):
    """No worker of a pool the request needs has heartbeated within the TTL."""


@dataclass(frozen=True)
class Route:
    task_name: str  # TASK_SERVE or TASK_PREFILL
    queue: str
    workers: tuple[tuple[str, str], ...]  # (pool, worker id) of every worker the request will run on
    decode_queue: str | None = None  # disaggregated: where prefill hands the request on to


def affinity_salt(server_key: bytes, tenant_id: str) -> bytes:
    """A per-tenant secret for the session-affinity hash, derived from a server key, so no client can
    choose or predict another tenant's routing keys."""
    return hmac.new(server_key, b"tenant:" + tenant_id.encode(), hashlib.sha256).digest()


def affinity_key(salt: bytes, session: str | None, prompt_ids: list[int], page_size: int) -> bytes:
    """The routing key: the ``x-session-affinity`` value if given, else the prompt's first KV page."""
    if session:
        material = b"session:" + session.encode()
    else:
        first_page = prompt_ids[:page_size]
        material = b"prefix:" + struct.pack(f"<{len(first_page)}q", *first_page)
    return hmac.new(salt, material, hashlib.sha256).digest()


def rendezvous(key: bytes, workers: list[WorkerInfo]) -> WorkerInfo:
    """Highest-random-weight choice: the worker whose hash with ``key`` is largest (ties by id)."""

    def weight(worker: WorkerInfo) -> tuple[int, str]:
        digest = hashlib.blake2b(key + b"\0" + worker.worker_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big"), worker.worker_id

    return max(workers, key=weight)


async def live_workers(
    redis: aioredis.Redis, deployment: str, pool: str, ttl_s: float, now: float | None = None
) -> list[WorkerInfo]:
    """Workers of ``pool`` whose last heartbeat is within ``ttl_s``; stale entries are ignored, not deleted."""
    entries = await redis.hgetall(workers_key(deployment, pool))
    return lifecycle.live_workers(entries.values(), ttl_s, time.time() if now is None else now)


async def pick(redis: aioredis.Redis, deployment: str, pool: str, key: bytes, ttl_s: float) -> WorkerInfo:
    return _pick(await live_workers(redis, deployment, pool, ttl_s), deployment, pool, key)


def _pick(workers: list[WorkerInfo], deployment: str, pool: str, key: bytes) -> WorkerInfo:
    if not workers:
        raise NoLiveWorker(
            f"no live {pool} worker for model {deployment!r}; start one with "
            f"`tessera worker --deployment {deployment} --pool {pool}` and retry"
        )
    return rendezvous(key, workers)


def queue_of(worker: WorkerInfo) -> str:
    return worker.queue or worker_queue(worker.worker_id)


async def route(
    redis: aioredis.Redis, spec: DeploymentSpec, key: bytes, ttl_s: float, *, prefill_locally: bool = False
) -> Route:
    """Where to send a request for ``spec``: its serve worker, or its prefill worker plus decode worker.

    ``prefill_locally`` (disaggregated only; a prompt short enough that handing its KV over costs more
    than computing it): the whole request goes to the decode worker as a serve task, no prefill worker.
    """
    if spec.mode == "colocated":
        worker = await pick(redis, spec.name, "serve", key, ttl_s)
        return Route(TASK_SERVE, queue_of(worker), (("serve", worker.worker_id),))
    if prefill_locally:
        decode = await pick(redis, spec.name, "decode", key, ttl_s)
        return Route(TASK_SERVE, queue_of(decode), (("decode", decode.worker_id),))
    # Both pools' heartbeats in one round trip. Decode follows the same key, so one session's decodes share a
    # worker too.
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(workers_key(spec.name, "prefill"))
        pipe.hgetall(workers_key(spec.name, "decode"))
        prefill_entries, decode_entries = await pipe.execute()
    now = time.time()
    prefill = _pick(lifecycle.live_workers(prefill_entries.values(), ttl_s, now), spec.name, "prefill", key)
    decode = _pick(lifecycle.live_workers(decode_entries.values(), ttl_s, now), spec.name, "decode", key)
    workers = (("prefill", prefill.worker_id), ("decode", decode.worker_id))
    return Route(TASK_PREFILL, queue_of(prefill), workers, queue_of(decode))
