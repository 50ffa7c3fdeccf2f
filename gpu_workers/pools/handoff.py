"""Moving a request's KV blob from a prefill worker to a decode worker, to be taken exactly once.

A blob is its ``KVHandoff`` header plus named tensors, serialized as safetensors bytes (the header rides in
the metadata). Two transports:
- ``redis``: a key (``handoff_key``) with a TTL of ``HANDOFF_TTL_S``; works across hosts. GETDEL makes the
  take atomic, so two decode attempts can never both import it.
- ``shm``: a POSIX shared-memory segment, when every decode worker that may get the task runs on this host
  and /dev/shm has room. It skips a copy through Redis; the taker unlinks it, and the store that created
  it unlinks it after the TTL if nobody did (``sweep``).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import replace
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import redis
import torch
from safetensors.torch import load, save

from gpu_workers.protocol import (
    HANDOFF_TTL_S,
    HEARTBEAT_TTL_S,
    KVHandoff,
    WorkerInfo,
    handoff_key,
    pool_queue,
    worker_queue,
    workers_key,
)

HEADER_KEY = "tessera_kv_handoff"
SHM_DIR = "/dev/shm"
SHM_HEADROOM = 2.0  # use shared memory only if /dev/shm has this many times the blob free


class HandoffMissing(LookupError):
    """The blob is gone: it expired, another decode attempt took it, or its segment is on another host."""


def serialize(header: KVHandoff, tensors: dict[str, torch.Tensor]) -> bytes:
    return save(
        {name: t.contiguous() for name, t in tensors.items()}, metadata={HEADER_KEY: header.to_json()}
    )


def deserialize(data: bytes) -> tuple[KVHandoff, dict[str, torch.Tensor]]:
    return _read_header(data), load(data)


def _read_header(data: bytes) -> KVHandoff:
    size = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    if HEADER_KEY not in meta:
        raise ValueError("not a KV hand-off blob: its safetensors metadata has no hand-off header")
    return KVHandoff.from_json(meta[HEADER_KEY])


class HandoffStore:
    """Puts KV blobs where a decode worker can take them, and takes them; one per worker process."""

    def __init__(self, client: redis.Redis, ttl_s: float = HANDOFF_TTL_S):
        self.client = client
        self.ttl_s = ttl_s
        self._segments: dict[str, float] = {}  # shared-memory segments this process created -> expiry
        self._lock = threading.Lock()

    def put(self, header: KVHandoff, tensors: dict[str, torch.Tensor], transport: str = "redis") -> KVHandoff:
        """Store the blob; returns the header to send to decode (transport, location and size filled in).

        Asking for ``shm`` falls back to ``redis`` when /dev/shm lacks room: writing past a full tmpfs
        kills the process with SIGBUS instead of raising.
        """
        if transport not in ("redis", "shm"):
            raise ValueError(f"transport must be redis or shm, got {transport!r}")
        header = replace(header, transport=transport, location="", nbytes=0)
        data = serialize(header, tensors)
        if transport == "shm" and _shm_free_bytes() >= SHM_HEADROOM * len(data):
            name = f"tessera-kv-{uuid.uuid4().hex}"
            segment = SharedMemory(name=name, create=True, size=len(data))
            try:
                segment.buf[: len(data)] = data
            finally:
                segment.close()
            # Its lifetime is ours (the taker unlinks, sweep() collects the rest); left registered, the
            # resource tracker would unlink it when this process exits, under a decode worker's feet.
            resource_tracker.unregister(segment._name, "shared_memory")
            with self._lock:
                self._segments[name] = time.monotonic() + self.ttl_s
            return replace(header, location=name, nbytes=len(data))
        key = handoff_key(header.request_id)
        self.client.set(key, data, ex=max(1, round(self.ttl_s)))
        return replace(header, transport="redis", location=key, nbytes=len(data))

    def take(self, header: KVHandoff) -> dict[str, torch.Tensor]:
        """Load the blob and delete it, atomically: a second take raises HandoffMissing."""
        if header.transport == "redis":
            data = self.client.getdel(header.location)
            if data is None:
                raise HandoffMissing(f"KV hand-off {header.location!r} expired or was already taken")
        elif header.transport == "shm":
            data = _take_segment(header.location, header.nbytes)
        else:
            raise ValueError(f"unknown KV hand-off transport {header.transport!r}")
        stored, tensors = deserialize(data)
        if stored.request_id != header.request_id:
            raise ValueError(
                f"KV hand-off at {header.location!r} belongs to request {stored.request_id!r}, "
                f"not {header.request_id!r}"
            )
        return tensors

    def discard(self, header: KVHandoff) -> None:
        """Delete a blob nobody will take (the request was cancelled or failed after the hand-off)."""
        if header.transport == "redis":
            self.client.delete(header.location)
        elif header.transport == "shm":
            _unlink(header.location)

    def sweep(self) -> int:
        """Unlink this process's segments whose TTL passed (taken ones are already gone); returns how many."""
        now = time.monotonic()
        with self._lock:
            expired = [name for name, expiry in self._segments.items() if expiry <= now]
            for name in expired:
                del self._segments[name]
        for name in expired:
            _unlink(name)
        return len(expired)


def colocated_decode(client: redis.Redis, deployment: str, decode_queue: str, host: str) -> bool:
    """Whether every live decode worker that may take a task from ``decode_queue`` runs on ``host``."""
    now = time.time()
    workers = [WorkerInfo.from_json(raw) for raw in client.hvals(workers_key(deployment, "decode"))]
    live = [w for w in workers if now - w.last_seen < HEARTBEAT_TTL_S]
    if decode_queue != pool_queue(deployment, "decode"):
        live = [w for w in live if worker_queue(w.worker_id) == decode_queue]
    return bool(live) and all(w.host == host for w in live)


def _take_segment(name: str, nbytes: int) -> bytes:
    try:
        segment = SharedMemory(name=name)
    except FileNotFoundError:
        raise HandoffMissing(
            f"shared-memory KV hand-off {name!r} is not on this host, expired, or was already taken"
        ) from None
    try:
        data = bytes(segment.buf[:nbytes])
    finally:
        segment.close()
    try:
        segment.unlink()  # also drops the registration attaching made with this process's resource tracker
    except FileNotFoundError:
        resource_tracker.unregister(segment._name, "shared_memory")
        raise HandoffMissing(f"shared-memory KV hand-off {name!r} was taken by another worker") from None
    return data


def _unlink(name: str) -> None:
    try:
        segment = SharedMemory(name=name)
    except FileNotFoundError:
        return
    segment.close()
    try:
        segment.unlink()
    except FileNotFoundError:
        resource_tracker.unregister(segment._name, "shared_memory")


def _shm_free_bytes() -> int:
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize
