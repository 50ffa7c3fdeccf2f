"""An embedding deployment's worker: embed tasks on the Embedder, vectors and usage on the request's stream."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from embedding_models import minilm_dir, tiny_bert

from gpu_workers.engine.embedder import Embedder, EmbedderConfig
from gpu_workers.lifecycle import inflight_key, lease_key
from gpu_workers.pools.embed import EmbedRunner, embedder_config
from gpu_workers.pools.inflight import Inflight
from gpu_workers.pools.worker import SECRET_ENV
from gpu_workers.protocol import (
    STREAM_FIELD,
    TASK_EMBED,
    DeploymentSpec,
    EmbedTask,
    Event,
    make_celery,
    stream_key,
    workers_key,
)

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def client():
    c = redis.Redis.from_url(REDIS_URL)
    c.ping()
    return c


@pytest.fixture(scope="module")
def namespace(client):
    ns = f"test-embed-worker-{uuid.uuid4().hex[:8]}"
    yield ns
    for key in client.scan_iter(match=f"*{ns}*", count=1000):
        client.delete(key)
    for tag, raw in client.hgetall("unacked").items():
        if ns.encode() in raw:
            client.hdel("unacked", tag)
            client.zrem("unacked_index", tag)


def vectors_of(event: Event) -> np.ndarray:
    raw = base64.b64decode(event.embeddings.data)
    return np.frombuffer(raw, dtype="<f4").reshape(event.embeddings.shape)


def read_final(client, request_id: str, timeout_s: float = 60.0) -> list[Event]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        entries = client.xrange(stream_key(request_id))
        if entries:
            return [Event.from_json(fields[STREAM_FIELD.encode()]) for _, fields in entries]
        time.sleep(0.05)
    raise AssertionError(f"request {request_id}: nothing on its stream within {timeout_s}s")


def task(spec: DeploymentSpec, inputs, deadline_s: float = 60.0) -> EmbedTask:
    return EmbedTask(
        request_id=f"{spec.name}-{uuid.uuid4().hex}",
        deployment=spec.name,
        tenant="tenant-a",
        inputs=inputs,
        deadline=time.time() + deadline_s,
    )


@pytest.fixture(scope="module")
def local(client, namespace, tmp_path_factory):
    path = tiny_bert(tmp_path_factory.mktemp("tiny-bert"))
    spec = DeploymentSpec(name=f"{namespace}-local", checkpoint=str(path), mode="colocated", dtype="float32")
    embedder = Embedder.from_pretrained(path, embedder_config(spec))
    embedder.start()
    runner = EmbedRunner(embedder, client, make_celery(REDIS_URL), worker_id=f"{namespace}-local")
    yield spec, runner, Embedder.from_pretrained(path, EmbedderConfig(dtype="float32"))
    embedder.stop()


def test_an_embed_task_streams_one_final_event_with_the_offline_vectors_and_the_usage(client, local):
    spec, runner, offline = local
    inputs = [[2, 5, 9, 3], [2, 7, 3], [2, 11, 12, 13, 3]]
    t = task(spec, inputs)
    runner.run(t.to_json())
    (event,) = read_final(client, t.request_id)
    assert event.kind == "final" and event.finish_reason == "stop"
    assert event.usage == {"prompt_tokens": 12, "cached_tokens": 0, "completion_tokens": 0}
    assert event.embeddings.shape == [3, 32]
    assert np.allclose(vectors_of(event), offline.embed(inputs).numpy(), atol=1e-5)
    assert not client.exists(lease_key(t.request_id)) and not client.hlen(inflight_key(runner.worker_id))


def test_a_redelivered_embed_task_of_a_finished_request_adds_nothing(client, local):
    spec, runner, _ = local
    t = task(spec, [[2, 5, 3]])
    runner.run(t.to_json())
    runner.run(t.to_json())
    assert client.xlen(stream_key(t.request_id)) == 1


def test_an_input_over_the_limit_and_a_passed_deadline_end_with_an_error_event(client, local):
    spec, runner, _ = local
    too_long = task(spec, [[2] * 33])
    late = task(spec, [[2, 3]], deadline_s=-1)
    runner.run(too_long.to_json())
    runner.run(late.to_json())
    (error,) = read_final(client, too_long.request_id)
    assert error.kind == "error" and error.error["code"] == "context_length_exceeded"
    assert "at most 32" in error.error["message"]
    (expired,) = read_final(client, late.request_id)
    assert expired.error["code"] == "deadline_exceeded"


def test_a_dead_peers_unfinished_embed_request_is_requeued_to_the_pool(client, local, namespace):
    spec, runner, _ = local
    dead = f"{namespace}-dead"
    orphan = task(spec, [[2, 5, 3]])
    client.hset(*Inflight(client, dead).entry(orphan.request_id, TASK_EMBED, orphan.to_json()))
    runner.recover(dead)
    assert client.llen(spec.queue("serve")) == 1 and not client.exists(inflight_key(dead))
    client.delete(spec.queue("serve"))


def test_a_worker_process_serves_minilm_from_the_pool_queue_and_refuses_another_pool(
    client, namespace, tmp_path_factory
):
    path = minilm_dir(tmp_path_factory.mktemp("minilm-cache"))
    spec = DeploymentSpec(name=f"{namespace}-minilm", checkpoint=str(path), mode="colocated", max_num_seqs=16)
    worker_id = f"{namespace}-w"
    cmd = [
        sys.executable,
        "-m",
        "gpu_workers.pools.worker",
        "--spec-json",
        spec.to_json(),
        "--redis-url",
        REDIS_URL,
    ]
    env = dict(os.environ, **{SECRET_ENV: "s"})
    refused = subprocess.run([*cmd, "--pool", "prefill"], env=env, cwd=REPO, capture_output=True, text=True)
    assert refused.returncode != 0 and "runs one pool, 'serve'" in refused.stderr
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, "--pool", "serve", "--worker-id", worker_id, "--threads", "4"],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        end = time.monotonic() + 120
        while not client.hexists(workers_key(spec.name, "serve"), worker_id):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < end, log.read_text()
            time.sleep(0.1)
        from gpu_workers.encoder_checkpoint import EncoderTokenizer

        ids = [e.ids for e in EncoderTokenizer(path, 256).encode_batch(["A cat sat on the mat.", "Zürich"])]
        t = task(spec, ids)
        make_celery(REDIS_URL).send_task(TASK_EMBED, args=[t.to_json()], queue=spec.queue("serve"))
        (event,) = read_final(client, t.request_id)
        assert event.kind == "final", event
        offline = Embedder.from_pretrained(path, EmbedderConfig(dtype="float32")).embed(ids)
        got = torch.from_numpy(vectors_of(event).copy())
        assert torch.nn.functional.cosine_similarity(got, offline).min() > 0.9999
    finally:
        proc.terminate()
        proc.wait(timeout=30)
