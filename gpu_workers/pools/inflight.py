"""The requests a worker is serving, mirrored to Redis so that a peer can finish them if the worker dies."""

from __future__ import annotations

import json
import threading

import redis

from gpu_workers.lifecycle import LEASE_TTL_MS, RENEW, inflight_key, lease_key
from gpu_workers.protocol import STREAM_TTL_S


class Inflight:
    def __init__(self, client: redis.Redis, worker_id: str):
        self.client = client
        self.worker_id = worker_id
        self.key = inflight_key(worker_id)
        self._renew = client.register_script(RENEW)
        self._requests: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._requests)

    def entry(self, request_id: str, task_name: str, payload: str) -> tuple[str, str, str]:
        """The hash key, field and value that record a request in flight (``RequestStream.begin`` writes
        them with the lease, ``RequestStream.end`` drops them); the hash expires ``STREAM_TTL_S`` after its
        last write: past that the streams are gone, and nothing is left to recover."""
        return self.key, request_id, json.dumps({"task": task_name, "payload": payload})

    def track(self, request_id: str) -> None:
        """Keep this request's lease alive (``renew``) while this worker serves it."""
        with self._lock:
            self._requests.add(request_id)

    def untrack(self, request_id: str) -> None:
        with self._lock:
            self._requests.discard(request_id)

    def renew(self) -> None:
        """Keep the leases this worker still holds (and the registry) alive; called every heartbeat."""
        with self._lock:
            requests = list(self._requests)
        if not requests:
            return
        keys = [lease_key(request_id) for request_id in requests] + [self.key]
        self._renew(keys=keys, args=[self.worker_id, LEASE_TTL_MS, STREAM_TTL_S])


def take_orphans(client: redis.Redis, worker_id: str) -> list[tuple[str, str]]:
    """A dead worker's in-flight (task name, payload) pairs; removes them so only one peer gets them."""
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(inflight_key(worker_id))
    pipe.delete(inflight_key(worker_id))
    entries, _ = pipe.execute()
    orphans = [json.loads(raw) for raw in entries.values()]
    return [(o["task"], o["payload"]) for o in orphans]
