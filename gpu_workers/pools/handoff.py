"""Moving a request's KV blob from a prefill worker to a decode worker, to be taken exactly once.

A blob is a blake2b checksum followed by safetensors bytes: the ``KVBlock``'s tensors, with the
``KVHandoff`` header and the block's layout in the metadata. The checksum covers all of it, and the taker
verifies it before anything is read (``HandoffCorrupt``), so a blob damaged in Redis or shared memory is
never imported. Two transports:
- ``redis``: a key (``handoff_key``) with a TTL of ``HANDOFF_TTL_S``; works across hosts. GETDEL makes the
  take atomic, so two decode attempts can never both import it.
- ``shm``: a POSIX shared-memory segment, when every decode worker that may get the task runs on this host
  and /dev/shm has room. It skips a copy through Redis; the taker unlinks it. Each segment is recorded in
  Redis with its expiry (``shm_records_key`` of the host) before it is created, and every worker of the host
  sweeps expired records, so a segment nobody took is reclaimed even when the process that made it died.
  The segments' lifetime is this protocol's, not multiprocessing's resource tracker's: left to the tracker,
  a segment would be unlinked when its creator exits, under the decode worker's feet.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
import uuid
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import redis
from safetensors.torch import load, save

from gpu_workers import lifecycle
from gpu_workers.kv.transfer import KVBlock
from gpu_workers.pools.messages import updated
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
BLOCK_KEY = "tessera_kv_block"
DIGEST_BYTES = 32
SHM_DIR = "/dev/shm"
SHM_HEADROOM = 2.0  # use shared memory only if /dev/shm has this many times the blob free
TRACK_ARGUMENT = sys.version_info >= (3, 13)  # SharedMemory(track=False) exists from Python 3.13


class HandoffMissing(LookupError):
    """The blob is gone: it expired, another decode attempt took it, or its segment is on another host."""


class HandoffCorrupt(ValueError):
    """The blob's bytes do not match its checksum: it was damaged on the way, or is not a hand-off blob."""


def shm_records_key(host: str) -> str:
    """Redis sorted set: shared-memory segment name -> unix time it expires, for the segments of ``host``."""
    return f"tessera:kv-shm:{host}"


def serialize(header: KVHandoff, block: KVBlock) -> bytes:
    tensors = {name: t.contiguous() for name, t in block.tensors().items()}
    body = save(tensors, metadata={HEADER_KEY: header.to_json(), BLOCK_KEY: block.metadata()})
    return _digest(body) + body


def deserialize(data: bytes) -> tuple[KVHandoff, KVBlock]:
    """The header and block of a blob; HandoffCorrupt if its checksum does not match."""
    digest, body = data[:DIGEST_BYTES], data[DIGEST_BYTES:]
    if len(data) <= DIGEST_BYTES or _digest(body) != digest:
        raise HandoffCorrupt(
            f"the KV hand-off blob ({len(data)} bytes) does not match its checksum: it was damaged in "
            "transit or storage"
        )
    meta = _metadata(body)
    if HEADER_KEY not in meta or BLOCK_KEY not in meta:
        raise HandoffCorrupt("not a KV hand-off blob: its safetensors metadata has no hand-off header")
    return KVHandoff.from_json(meta[HEADER_KEY]), KVBlock.from_tensors(load(body), meta[BLOCK_KEY])


def _digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


def _metadata(body: bytes) -> dict[str, str]:
    size = int.from_bytes(body[:8], "little")
    return json.loads(body[8 : 8 + size]).get("__metadata__") or {}


class HandoffStore:
    """Puts KV blobs where a decode worker can take them, and takes them; one per worker process."""

    def __init__(self, client: redis.Redis, ttl_s: float = HANDOFF_TTL_S, host: str | None = None):
        self.client = client
        self.ttl_s = ttl_s
        self.host = host or socket.gethostname()
        self.records = shm_records_key(self.host)

    def put(self, header: KVHandoff, block: KVBlock, transport: str = "redis") -> KVHandoff:
        """Store the blob; returns the header to send to decode (transport, location and size filled in).

        Asking for ``shm`` falls back to ``redis`` when /dev/shm lacks room: writing past a full tmpfs
        kills the process with SIGBUS instead of raising.
        """
        if transport not in ("redis", "shm"):
            raise ValueError(f"transport must be redis or shm, got {transport!r}")
        header = updated(header, transport=transport, location="", nbytes=0)
        data = serialize(header, block)
        if transport == "shm" and _shm_free_bytes() >= SHM_HEADROOM * len(data):
            name = f"tessera-kv-{uuid.uuid4().hex}"
            # Recorded before it exists: whenever this process dies, a sweep on this host finds the segment.
            self.client.zadd(self.records, {name: time.time() + self.ttl_s})
            segment = _attach(name, create=True, size=len(data))
            try:
                segment.buf[: len(data)] = data
            finally:
                segment.close()
            return updated(header, location=name, nbytes=len(data))
        key = handoff_key(header.request_id)
        self.client.set(key, data, ex=max(1, round(self.ttl_s)))
        return updated(header, transport="redis", location=key, nbytes=len(data))

    def take(self, header: KVHandoff) -> KVBlock:
        """Load the blob and delete it, atomically: a second take raises HandoffMissing; a damaged blob
        raises HandoffCorrupt."""
        if header.transport == "redis":
            data = self.client.getdel(header.location)
            if data is None:
                raise HandoffMissing(f"KV hand-off {header.location!r} expired or was already taken")
        elif header.transport == "shm":
            data = _take_segment(header.location, header.nbytes)
            self.client.zrem(self.records, header.location)
        else:
            raise ValueError(f"unknown KV hand-off transport {header.transport!r}")
        stored, block = deserialize(data)
        if stored.request_id != header.request_id:
            raise ValueError(
                f"KV hand-off at {header.location!r} belongs to request {stored.request_id!r}, "
                f"not {header.request_id!r}"
            )
        return block

    def discard(self, header: KVHandoff) -> None:
        """Delete a blob nobody will take (the request was cancelled or failed after the hand-off)."""
        if header.transport == "redis":
            self.client.delete(header.location)
        elif header.transport == "shm":
            _unlink(header.location)
            self.client.zrem(self.records, header.location)

    def sweep(self) -> int:
        """Unlink this host's segments whose TTL passed, whoever made them; returns how many records went."""
        swept = 0
        for raw in self.client.zrangebyscore(self.records, "-inf", time.time()):
            name = raw.decode()
            if self.client.zrem(self.records, name):  # the worker that removed the record unlinks
                _unlink(name)
                swept += 1
        return swept


def colocated_decode(client: redis.Redis, deployment: str, decode_queue: str, host: str) -> bool:
    """Whether every live decode worker that may take a task from ``decode_queue`` runs on ``host``."""
    now = time.time()
    workers = [WorkerInfo.from_json(raw) for raw in client.hvals(workers_key(deployment, "decode"))]
    live = [w for w in workers if lifecycle.live(now - w.last_seen, HEARTBEAT_TTL_S)]
    if decode_queue != pool_queue(deployment, "decode"):
        live = [w for w in live if worker_queue(w.worker_id) == decode_queue]
    return bool(live) and all(w.host == host for w in live)


def _attach(name: str, create: bool = False, size: int = 0) -> SharedMemory:
    """Open (or create) a segment the resource tracker does not own (see the module docstring)."""
    if TRACK_ARGUMENT:
        return SharedMemory(name=name, create=create, size=size, track=False)
    segment = SharedMemory(name=name, create=create, size=size)
    if create:
        # Before 3.13 creating registers the segment with the tracker; attaching registers it too, but
        # there unlink() drops that registration again.
        _untrack(segment)
    return segment


def _untrack(segment: SharedMemory) -> None:
    if not TRACK_ARGUMENT:
        resource_tracker.unregister("/" + segment.name, "shared_memory")


def _take_segment(name: str, nbytes: int) -> bytes:
    try:
        segment = _attach(name)
    except FileNotFoundError:
        raise HandoffMissing(
            f"shared-memory KV hand-off {name!r} is not on this host, expired, or was already taken"
        ) from None
    try:
        data = bytes(segment.buf[:nbytes])
    finally:
        segment.close()
    try:
        segment.unlink()
    except FileNotFoundError:
        _untrack(segment)
        raise HandoffMissing(f"shared-memory KV hand-off {name!r} was taken by another worker") from None
    return data


def _unlink(name: str) -> None:
    try:
        segment = _attach(name)
    except FileNotFoundError:
        return
    segment.close()
    try:
        segment.unlink()
    except FileNotFoundError:
        _untrack(segment)


def _shm_free_bytes() -> int:
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize
