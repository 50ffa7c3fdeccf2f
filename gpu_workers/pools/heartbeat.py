"""Worker liveness in Redis: publish this worker's WorkerInfo, and notice peers that stopped publishing theirs.

Every ``HEARTBEAT_INTERVAL_S`` the worker HSETs its ``WorkerInfo`` into ``workers_key(deployment, pool)``;
the router treats entries older than ``HEARTBEAT_TTL_S`` as dead. The same tick runs the worker's periodic
upkeep and looks for dead peers of the same pool: exactly one live peer (whoever removes the entry first)
is handed each dead worker, to recover its requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from gpu_workers.protocol import HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, WorkerInfo, workers_key

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        client: redis.Redis,
        info: Callable[[], WorkerInfo],
        on_tick: Callable[[], None] = lambda: None,
        on_dead_peer: Callable[[str], None] = lambda worker_id: None,
        interval_s: float = HEARTBEAT_INTERVAL_S,
    ):
        self.client = client
        self.info = info
        self.on_tick = on_tick
        self.on_dead_peer = on_dead_peer
        self.interval_s = interval_s
        first = info()
        self.worker_id = first.worker_id
        self.key = workers_key(first.deployment, first.pool)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and remove this worker from the pool, so the router stops choosing it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.client.hdel(self.key, self.worker_id)
        except redis.RedisError:  # Redis is gone too: the entry goes stale and a peer reaps it
            log.warning("could not remove worker %s from %s", self.worker_id, self.key, exc_info=True)

    def beat(self) -> None:
        self.client.hset(self.key, self.worker_id, self.info().to_json())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for step in (self.beat, self.on_tick, self._find_dead_peers):
                try:
                    step()
                except Exception:  # a Redis hiccup must not end the heartbeat: the next tick retries
                    log.exception("heartbeat step %s failed", getattr(step, "__name__", step))

    def _find_dead_peers(self) -> None:
        now = time.time()
        for worker_id, raw in self.client.hgetall(self.key).items():
            worker_id = worker_id.decode()
            if worker_id == self.worker_id or now - WorkerInfo.from_json(raw).last_seen < HEARTBEAT_TTL_S:
                continue
            if self.client.hdel(self.key, worker_id):  # only the peer that removed it recovers it
                log.warning("worker %s stopped heartbeating; recovering its requests", worker_id)
                self.on_dead_peer(worker_id)
