"""KV hand-off transport between pools: a blob is taken exactly once, intact, over Redis or shared memory."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import redis
import torch

from gpu_workers.formats.fp8 import quantize_fp8
from gpu_workers.kv.transfer import KVBlock
from gpu_workers.pools.handoff import HandoffMissing, HandoffStore, colocated_decode, deserialize, serialize
from gpu_workers.protocol import HANDOFF_TTL_S, KVHandoff, WorkerInfo, pool_queue, worker_queue, workers_key

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def client():
    c = redis.Redis.from_url(REDIS_URL)
    c.ping()
    return c


def fp8_block(num_tokens=21, layers=2, heads=2, head_dim=8) -> KVBlock:
    k = torch.randn(layers, num_tokens, heads, head_dim)
    v = torch.randn(layers, num_tokens, heads, head_dim)
    scale = torch.full((layers,), 2.0**-6)
    return KVBlock(
        "fp8_e4m3",
        num_tokens,
        quantize_fp8(k, scale[:, None, None, None]),
        quantize_fp8(v, scale[:, None, None, None]),
        scale,
        scale.clone(),
    )


def header(block: KVBlock, request_id: str) -> KVHandoff:
    layers, _, heads, head_dim = block.k.shape
    return KVHandoff(request_id, block.kv_format, block.num_tokens, layers, heads, head_dim, 7, 16)


def assert_same_block(tensors: dict[str, torch.Tensor], block: KVBlock) -> None:
    got = KVBlock.from_tensors(block.kv_format, tensors)
    assert got.num_tokens == block.num_tokens
    for name, t in block.tensors().items():
        assert torch.equal(tensors[name], t), name
        assert tensors[name].dtype == t.dtype


def test_blob_round_trips_header_and_fp8_tensors():
    block = fp8_block()
    h = header(block, "r1")
    stored, tensors = deserialize(serialize(h, block.tensors()))
    assert stored == h
    assert_same_block(tensors, block)


@pytest.mark.parametrize("transport", ["redis", "shm"])
def test_blob_is_taken_exactly_once(client, transport):
    store = HandoffStore(client)
    block = fp8_block()
    sent = store.put(header(block, f"test-{uuid.uuid4().hex}"), block.tensors(), transport)
    assert sent.transport == transport and sent.location and sent.nbytes > block.nbytes
    assert_same_block(store.take(sent), block)
    with pytest.raises(HandoffMissing):
        store.take(sent)


def test_redis_blob_expires_after_the_handoff_ttl(client):
    block = fp8_block()
    sent = HandoffStore(client).put(header(block, f"test-{uuid.uuid4().hex}"), block.tensors())
    ttl = client.ttl(sent.location)
    assert 0 < ttl <= HANDOFF_TTL_S
    client.delete(sent.location)


def test_blob_of_another_request_is_refused(client):
    store = HandoffStore(client)
    block = fp8_block()
    sent = store.put(header(block, f"test-{uuid.uuid4().hex}"), block.tensors())
    with pytest.raises(ValueError, match="belongs to request"):
        store.take(KVHandoff(**{**sent.__dict__, "request_id": "someone-else"}))


def test_untaken_shared_memory_is_swept_after_its_ttl(client):
    store = HandoffStore(client, ttl_s=0.05)
    block = fp8_block()
    sent = store.put(header(block, f"test-{uuid.uuid4().hex}"), block.tensors(), "shm")
    assert store.sweep() == 0
    time.sleep(0.1)
    assert store.sweep() == 1
    with pytest.raises(HandoffMissing):
        store.take(sent)


def test_discard_deletes_a_blob_nobody_will_take(client):
    store = HandoffStore(client)
    block = fp8_block()
    for transport in ("redis", "shm"):
        sent = store.put(header(block, f"test-{uuid.uuid4().hex}"), block.tensors(), transport)
        store.discard(sent)
        with pytest.raises(HandoffMissing):
            store.take(sent)


def test_shared_memory_only_when_every_live_decode_worker_is_on_this_host(client):
    deployment = f"test-{uuid.uuid4().hex[:8]}"
    key = workers_key(deployment, "decode")
    now = time.time()

    def worker(worker_id, host, last_seen=now):
        info = WorkerInfo(worker_id, deployment, "decode", worker_queue(worker_id), host, 1, last_seen)
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
