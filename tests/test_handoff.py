"""KV hand-off transport between pools: a blob is taken exactly once, intact, over Redis or shared memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch

from gpu_workers.formats.fp8 import quantize_fp8
from gpu_workers.kv.transfer import KVBlock
from gpu_workers.pools.handoff import (
    HandoffCorrupt,
    HandoffMissing,
    HandoffStore,
    colocated_decode,
    deserialize,
    serialize,
)
from gpu_workers.protocol import HANDOFF_TTL_S, KVHandoff, WorkerInfo, pool_queue, worker_queue, workers_key

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def client():
    c = redis.Redis.from_url(REDIS_URL)
    c.ping()
    return c


@pytest.fixture
def store(client):
    """A store of its own (fake) host, so no other worker on this machine sweeps its segments."""
    s = HandoffStore(client, host=f"test-host-{uuid.uuid4().hex}")
    yield s
    client.delete(s.records)


def fp8_block(num_tokens=21, layers=2, heads=2, head_dim=8, page_size=4) -> KVBlock:
    k = torch.randn(layers, num_tokens, heads, head_dim)
    v = torch.randn(layers, num_tokens, heads, head_dim)
    pages = -(-num_tokens // page_size)
    scale = 2.0 ** torch.randint(-8, -4, (layers, pages)).float()  # a scale per page, as a cache holds them
    page_of = torch.arange(num_tokens) // page_size
    return KVBlock(
        "fp8_e4m3",
        num_tokens,
        quantize_fp8(k, scale[:, page_of, None, None]),
        quantize_fp8(v, scale[:, page_of, None, None]),
        scale,
        scale.flip(1).contiguous(),
        page_size,
    )


def header(block: KVBlock, request_id: str) -> KVHandoff:
    layers, _, heads, head_dim = block.k.shape
    return KVHandoff(
        request_id=request_id,
        kv_format=block.kv_format,
        num_tokens=block.num_tokens,
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        first_token=7,
        cached_tokens=16,
    )


def assert_same_block(got: KVBlock, block: KVBlock) -> None:
    assert (got.kv_format, got.num_tokens, got.page_size) == (
        block.kv_format,
        block.num_tokens,
        block.page_size,
    )
    for name, t in block.tensors().items():
        assert torch.equal(got.tensors()[name], t), name
        assert got.tensors()[name].dtype == t.dtype


def test_blob_round_trips_header_and_fp8_tensors_with_their_page_scales():
    block = fp8_block()
    h = header(block, "r1")
    stored, got = deserialize(serialize(h, block))
    assert stored == h
    assert_same_block(got, block)


@pytest.mark.parametrize("transport", ["redis", "shm"])
def test_blob_is_taken_exactly_once(store, transport):
    block = fp8_block()
    sent = store.put(header(block, f"test-{uuid.uuid4().hex}"), block, transport)
    assert sent.transport == transport and sent.location and sent.nbytes > block.nbytes
    assert_same_block(store.take(sent), block)
    with pytest.raises(HandoffMissing):
        store.take(sent)


def corrupt(client, sent: KVHandoff, offset: int) -> None:
    """Flip one byte of a stored blob, where it lies: the Redis value or the shared-memory segment."""
    if sent.transport == "redis":
        byte = client.getrange(sent.location, offset, offset)
        client.setrange(sent.location, offset, bytes([byte[0] ^ 0x01]))
    else:
        with open(Path("/dev/shm", sent.location), "r+b") as segment:
            segment.seek(offset)
            byte = segment.read(1)
            segment.seek(offset)
            segment.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("transport", ["redis", "shm"])
@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_damaged_blob_is_refused_by_its_checksum(client, store, transport, where):
    block = fp8_block()
    sent = store.put(header(block, f"test-{uuid.uuid4().hex}"), block, transport)
    # Byte 60 lies in the safetensors header (its JSON); the last byte in the last tensor's data.
    corrupt(client, sent, 60 if where == "header" else sent.nbytes - 1)
    with pytest.raises(HandoffCorrupt, match="checksum"):
        store.take(sent)


def test_redis_blob_expires_after_the_handoff_ttl(store, client):
    block = fp8_block()
    sent = store.put(header(block, f"test-{uuid.uuid4().hex}"), block)
    ttl = client.ttl(sent.location)
    assert 0 < ttl <= HANDOFF_TTL_S
    client.delete(sent.location)


def test_blob_of_another_request_is_refused(store):
    block = fp8_block()
    sent = store.put(header(block, f"test-{uuid.uuid4().hex}"), block)
    with pytest.raises(ValueError, match="belongs to request"):
        store.take(KVHandoff(**{**sent.__dict__, "request_id": "someone-else"}))


def test_untaken_shared_memory_is_swept_after_its_ttl(client, store):
    store.ttl_s = 0.05
    block = fp8_block()
    sent = store.put(header(block, f"test-{uuid.uuid4().hex}"), block, "shm")
    assert store.sweep() == 0
    time.sleep(0.1)
    assert store.sweep() == 1
    assert not Path("/dev/shm", sent.location).exists()
    with pytest.raises(HandoffMissing):
        store.take(sent)


PUT_AND_DIE = """
import os, sys, redis, torch
from gpu_workers.kv.transfer import KVBlock
from gpu_workers.pools.handoff import HandoffStore
from gpu_workers.protocol import KVHandoff
store = HandoffStore(redis.Redis.from_url(sys.argv[1]), ttl_s=float(sys.argv[2]), host=sys.argv[3])
block = KVBlock("fp32", 3, torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
header = dict(request_id="r", kv_format="fp32", num_tokens=3, num_layers=1, num_kv_heads=1, head_dim=4)
sent = store.put(KVHandoff(**header, first_token=0, cached_tokens=0), block, "shm")
print(sent.location, flush=True)
os.kill(os.getpid(), 9)  # the prefill worker dies before any decode worker took its blob
"""


def test_shared_memory_of_a_dead_prefill_process_is_reclaimed_by_another_worker_of_the_host(store):
    ttl_s = 0.5
    creator = subprocess.run(
        [sys.executable, "-c", PUT_AND_DIE, REDIS_URL, str(ttl_s), store.host],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert creator.returncode == -9, creator.stderr
    segment = Path("/dev/shm", creator.stdout.strip())
    assert segment.exists()  # nobody unlinked it when its creator died
    time.sleep(ttl_s)
    assert store.sweep() == 1  # this process never saw the segment: the host's record in Redis names it
    assert not segment.exists()


def test_discard_deletes_a_blob_nobody_will_take(store):
    block = fp8_block()
    for transport in ("redis", "shm"):
        sent = store.put(header(block, f"test-{uuid.uuid4().hex}"), block, transport)
        store.discard(sent)
        with pytest.raises(HandoffMissing):
            store.take(sent)
    assert store.sweep() == 0  # discarding dropped the segment's record too


def test_shared_memory_only_when_every_live_decode_worker_is_on_this_host(client):
    deployment = f"test-{uuid.uuid4().hex[:8]}"
    key = workers_key(deployment, "decode")
    now = time.time()

    def worker(worker_id, host, last_seen=now):
        info = WorkerInfo(
            worker_id=worker_id,
            deployment=deployment,
            pool="decode",
            queue=worker_queue(worker_id),
            host=host,
            pid=1,
            last_seen=last_seen,
        )
        client.hset(key, worker_id, info.to_json())

    try:
        pool = pool_queue(deployment, "decode")
        assert not colocated_decode(client, deployment, pool, "here")  # nobody alive: Redis, safe default
        worker("a", "here")
        worker("dead", "elsewhere", last_seen=now - 60)
        assert colocated_decode(client, deployment, pool, "here")
        worker("b", "elsewhere")
        assert not colocated_decode(client, deployment, pool, "here")
        assert colocated_decode(client, deployment, worker_queue("a"), "here")  # routed to one worker
    finally:
        client.delete(key)
