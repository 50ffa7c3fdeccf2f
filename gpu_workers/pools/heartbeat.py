"""Worker liveness in Redis: publish this worker's WorkerInfo, notice peers that stopped publishing theirs, and
tell whether this worker still serves its deployment's announced config.

Every ``HEARTBEAT_INTERVAL_S`` the worker HSETs its ``WorkerInfo`` into ``workers_key(deployment, pool)``;
the router treats entries older than ``HEARTBEAT_TTL_S`` as dead. The same tick runs the worker's periodic
upkeep and looks at its peers of the same pool: exactly one live peer (whoever removes the entry first)
is handed each dead worker, to recover its requests; every peer that is draining for a reload hands its
own queue over (the router may still pick it until its entry goes stale).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import redis
from celery.worker import state as celery_state

from gpu_workers.lifecycle import live
from gpu_workers.protocol import (
    EXIT_RELOAD,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TTL_S,
    SUCCESSOR_FIRST_ENV,
    DeploymentSpec,
    MessageError,
    WorkerInfo,
    config_key,
    worker_queue,
    workers_key,
)

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        client: redis.Redis,
        info: Callable[[], WorkerInfo],
        on_tick: Callable[[], None] = lambda: None,
        on_dead_peer: Callable[[str], None] = lambda worker_id: None,
        on_draining_peer: Callable[[str], None] = lambda worker_id: None,
        interval_s: float = HEARTBEAT_INTERVAL_S,
    ):
        self.client = client
        self.info = info
        self.on_tick = on_tick
        self.on_dead_peer = on_dead_peer
        self.on_draining_peer = on_draining_peer
        self.interval_s = interval_s
        first = info()
        self.worker_id = first.worker_id
        self.key = workers_key(first.deployment, first.pool)
        self._stop = threading.Event()
        self._left = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self, leave: bool = True) -> None:
        """Stop beating and remove this worker from the pool, so the router stops choosing it at once;
        ``leave=False`` (a reload) beats once more instead: the entry stays until it goes stale, so requests
        keep being routed to this worker's queue, which its peers (its successor) hand over."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if not leave:
                self.beat()
                return
            self.client.hdel(self.key, self.worker_id)
        except redis.RedisError:  # Redis is gone too: the entry goes stale and a peer reaps it
            log.warning("could not remove worker %s from %s", self.worker_id, self.key, exc_info=True)

    def leave(self) -> None:
        """Leave the pool now (the router stops choosing this worker) but keep running the upkeep, which
        renews the leases of the requests it still serves."""
        self._left.set()
        self.client.hdel(self.key, self.worker_id)

    @property
    def left(self) -> bool:
        """Whether this worker left its pool (``leave``) and only keeps its upkeep running."""
        return self._left.is_set()

    def beat(self) -> None:
        if not self._left.is_set():
            self.client.hset(self.key, self.worker_id, self.info().to_json())

    def live_peers(self) -> list[WorkerInfo]:
        now = time.time()
        peers = (WorkerInfo.from_json(raw) for raw in self.client.hvals(self.key))
        return [
            p for p in peers if p.worker_id != self.worker_id and live(now - p.last_seen, HEARTBEAT_TTL_S)
        ]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            steps = (self.on_tick,) if self._left.is_set() else (self.beat, self.on_tick, self._look_at_peers)
            for step in steps:
                try:
                    step()
                except Exception:  # a Redis hiccup must not end the heartbeat: the next tick retries
                    log.exception("heartbeat step %s failed", getattr(step, "__name__", step))

    def _look_at_peers(self) -> None:
        now = time.time()
        for worker_id, raw in self.client.hgetall(self.key).items():
            worker_id = worker_id.decode()
            if worker_id == self.worker_id:
                continue
            peer = WorkerInfo.from_json(raw)
            if live(now - peer.last_seen, HEARTBEAT_TTL_S):
                if peer.draining:
                    self.on_draining_peer(worker_id)
                continue
            if self.client.hdel(self.key, worker_id):  # only the peer that removed it recovers it
                if peer.draining:
                    log.info("worker %s left for a reload; taking over its queue", worker_id)
                else:
                    log.warning("worker %s stopped heartbeating; recovering its requests", worker_id)
                self.on_dead_peer(worker_id)


class ConfigWatch:
    """Whether ``spec`` is still its deployment's announced config (``config_key``, set by the control plane
    after each committed change): ``version`` is the announced version ``spec`` is, ``announced`` the
    latest one."""

    def __init__(self, client: redis.Redis, spec: DeploymentSpec):
        self.client = client
        self.spec = spec
        self.version: int | None = None
        self.announced: int | None = None

    def current(self) -> bool:
        announced = self._read()
        if announced is None:
            return True  # nothing announced (say, a Redis that restarted empty): the database's config stands
        if announced != self.spec:
            return False
        self.version = self.announced
        return True

    def successor(self, peers: list[WorkerInfo]) -> WorkerInfo | None:
        """A peer serving the latest announced config, ready to take this worker's place. Reads the
        announcement again (``announced``) but leaves ``version`` as it is: a stale worker whose config is
        announced again still waits for its successor, reporting the version it served."""
        self._read()
        for peer in peers:
            if peer.config_version == self.announced and not (peer.config_stale or peer.draining):
                return peer
        return None

    def _read(self) -> DeploymentSpec | None:
        """The announced spec (``announced`` set to its version); None if none, or none readable."""
        version, raw = self.client.hmget(config_key(self.spec.name), "version", "spec")
        if raw is None:
            return None
        try:
            announced = DeploymentSpec.from_json(raw)
        except MessageError:
            log.exception("ignoring an unreadable config announcement for %s", self.spec.name)
            return None
        self.announced = int(version)
        return announced


class ConfigDrain:
    """What a worker does when its deployment's announced config is no longer the one it serves, on each
    heartbeat tick (``tick``); the generation worker (``pools.worker``, whose docstring says why) and the
    embedding worker share it. ``stale``: it reported ``config_stale`` and stays so; ``draining``: it takes
    no new tasks (Celery's warm shutdown, exit ``EXIT_RELOAD``). Under a successor-first supervisor
    (``SUCCESSOR_FIRST_ENV``) it keeps serving while stale until a peer on the latest announced config is
    live, then leaves the pool and drains; otherwise it drains at once, its entry kept (marked draining) for
    its successor to hand its queue over. ``requeue`` hands a worker's own queue over to the pool."""

    def __init__(
        self,
        client: redis.Redis,
        watch: ConfigWatch,
        worker_id: str,
        requeue: Callable[[str], None],
        logger: logging.Logger = log,
    ):
        self.client = client
        self.watch = watch
        self.worker_id = worker_id
        self.requeue = requeue
        self.log = logger
        self.successor_first = os.environ.get(SUCCESSOR_FIRST_ENV) == "1"
        self.stale, self.draining = threading.Event(), threading.Event()

    def tick(self, heartbeat: Heartbeat) -> None:
        if self.draining.is_set():
            if heartbeat.left and self.client.llen(worker_queue(self.worker_id)):
                self.requeue(self.worker_id)  # out of the pool: what a router queued as it left
            return
        if not self.stale.is_set():
            if self.watch.current():
                return
            # Stale for good, even if the config is changed back before it drains: its supervisor may have
            # started a successor for it already, and both would then serve the one slot.
            self.stale.set()
            then = "serving until a successor is live" if self.successor_first else "draining, then reloading"
            self.log.info(
                "worker %s: %s is now config version %s; %s",
                self.worker_id,
                self.watch.spec.name,
                self.watch.announced,
                then,
            )
            heartbeat.beat()  # a supervisor sees it stale now
        if self.successor_first:
            successor = self.watch.successor(heartbeat.live_peers())
            if successor is None:
                return
            self.log.info(
                "worker %s: %s serves the new config; leaving the pool to drain",
                self.worker_id,
                successor.worker_id,
            )
            heartbeat.leave()
            self.requeue(self.worker_id)  # the router may have picked it just before it left
        self.draining.set()
        heartbeat.beat()  # peers see it draining now (if it is still in the pool)
        # Celery's warm shutdown: no new tasks, the running ones finish, then exit.
        celery_state.should_stop = EXIT_RELOAD

    def leave_on_stop(self, reloading: bool) -> bool:
        """Whether the heartbeat's entry goes when the worker stops (``Heartbeat.stop``): it stays only for a
        reload without a successor first, whose successor hands over what is routed to it meanwhile."""
        return self.successor_first or not reloading
