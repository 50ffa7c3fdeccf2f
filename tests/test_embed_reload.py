"""An embedding deployment's config changed under `tessera up`'s successor-first supervision, on real worker
processes (the real Supervisor, the launcher's own successor start, real Redis, a SQLite database): the stale
embedding worker keeps serving until its successor on the new config is live, so the pool always holds a
worker that takes requests, and it ends with one worker, on the new version."""

from __future__ import annotations

import io
import os
import sys
import time
import uuid
from types import SimpleNamespace

import redis
from embedding_models import minilm_dir
from tessera import deployments
from tessera.launcher import Launcher
from tessera.supervisor import Supervisor
from worker_deployments import worker_deployment

from gpu_workers.encoder_checkpoint import EncoderTokenizer
from gpu_workers.lifecycle import live
from gpu_workers.protocol import (
    HEARTBEAT_TTL_S,
    STREAM_FIELD,
    SUCCESSOR_FIRST_ENV,
    TASK_EMBED,
    EmbedTask,
    Event,
    WorkerInfo,
    config_key,
    make_celery,
    pool_queue,
    stream_key,
    workers_key,
)

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TIMEOUT_S = 180.0  # generous: each condition below is waited on, never timed


def test_a_stale_embedding_worker_serves_until_its_successor_is_live_then_leaves(tmp_path, tmp_path_factory):
    client = redis.Redis.from_url(REDIS_URL)
    checkpoint = minilm_dir(tmp_path_factory.mktemp("minilm-cache"))
    name = f"@test/embed-reload-{uuid.uuid4().hex[:8]}"
    config = {"name": name, "checkpoint": str(checkpoint), "mode": "colocated", "max_num_seqs": 8}
    # SUCCESSOR_FIRST_ENV: as `tessera up` runs its workers
    stack = worker_deployment(
        tmp_path, client, REDIS_URL, config, "embed-reload-test-secret-" * 3, **{SUCCESSOR_FIRST_ENV: "1"}
    )
    sessions, env = stack.sessions, stack.env
    supervisor = Supervisor(io.StringIO(), backoff_s=60)  # a worker that fails is not back within the test
    command = [sys.executable, "-m", "tessera.cli", "worker", "--deployment", name, "--pool", "serve"]
    supervisor.spawn("serve worker", [*command, "--threads", "2"], env, tmp_path / "worker.log")
    # The launcher's own round: a successor for each worker that reports config_stale (not draining).
    launcher = SimpleNamespace(
        redis=client, worker_pools={"serve worker": (name, "serve")}, supervisor=supervisor
    )

    def workers() -> list[WorkerInfo]:
        return [WorkerInfo.from_json(raw) for raw in client.hvals(workers_key(name, "serve"))]

    def serving() -> list[WorkerInfo]:
        """The workers a request routed now would be served by: live, and taking tasks."""
        now = time.time()
        return [w for w in workers() if live(now - w.last_seen, HEARTBEAT_TTL_S) and not w.draining]

    samples: list[list[WorkerInfo]] = []

    def tend_until(done, what: str):
        deadline = time.monotonic() + TIMEOUT_S
        while not (found := done()):
            assert time.monotonic() < deadline, (
                f"{what}: {workers()}\n{supervisor.out.getvalue()}\n{(tmp_path / 'worker.log').read_text()}"
            )
            supervisor.tend()
            Launcher.replace_stale_workers(launcher)
            samples.append(serving())
            time.sleep(0.05)
        return found

    def embed_one() -> EmbedTask:
        ids = [e.ids for e in EncoderTokenizer(checkpoint, 256).encode_batch(["A cat sat on the mat."])]
        task = EmbedTask(
            request_id=f"embed-reload-{uuid.uuid4().hex}",
            deployment=name,
            tenant="t",
            inputs=ids,
            deadline=time.time() + TIMEOUT_S,
        )
        make_celery(REDIS_URL).send_task(TASK_EMBED, args=[task.to_json()], queue=pool_queue(name, "serve"))
        return task

    try:
        old = tend_until(lambda: next((w for w in serving() if w.config_version == 1), None), "no worker")
        with sessions() as session:
            deployments.update_deployment(session, name, {"max_num_seqs": 16}, actor="test", redis=client)
        samples.clear()
        # The old worker goes stale, its successor starts beside it, and it leaves once that one is live.
        tend_until(lambda: any(w.config_stale for w in workers()), "the old worker never went stale")
        new = tend_until(
            lambda: next((w for w in serving() if w.config_version == 2), None), "no successor on version 2"
        )
        tend_until(
            lambda: (
                [w.worker_id for w in workers()] == [new.worker_id]
                and len(supervisor.children) == 1
                and supervisor.children[0].process.pid == new.pid
            ),
            "the old worker did not leave",
        )
        empty = sum(not taking for taking in samples)
        assert samples and not empty, (
            f"no embedding worker took requests in {empty} of {len(samples)} samples"
        )
        assert [(w.worker_id, w.config_version) for w in serving()] == [(new.worker_id, 2)]
        assert old.pid != new.pid
        assert "leaves once its successor is live" in supervisor.out.getvalue()
        # And the successor serves.
        task = embed_one()
        final = tend_until(
            lambda: [
                Event.from_json(f[STREAM_FIELD.encode()])
                for _, f in client.xrange(stream_key(task.request_id))
            ],
            "the successor served nothing",
        )
        assert final[0].kind == "final", final
    finally:
        supervisor.stop()
        client.delete(workers_key(name, "serve"), config_key(name))
