"""A worker process's Celery consumer: its queues on a thread pool feeding one in-process engine or embedder.

Celery's own worker heartbeat, mingle and gossip are off: liveness and peers are ``pools.heartbeat``'s.
"""

from __future__ import annotations

from celery import Celery


def consume(app: Celery, worker_id: str, host: str, queues: list[str], threads: int, loglevel: str) -> None:
    """Run tasks from ``queues`` until a warm shutdown (``celery_state.should_stop``) or a signal."""
    app.Worker(
        hostname=f"{worker_id}@{host}",
        queues=queues,
        pool="threads",
        concurrency=threads,
        loglevel=loglevel,
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
        quiet=True,
    ).start()
