"""An embedding deployment's worker: ``tessera.embed`` tasks on an Embedder, vectors back on the request's stream.

An embedding deployment runs one pool, ``serve`` (its queue and heartbeats are a colocated deployment's, so
the gateway routes to it the same way). A task's thread submits its request's inputs to the Embedder, which
batches them with every other request's, and waits; the stream then gets one ``final`` event holding the
vectors (``protocol.Embeddings``) and the usage (``prompt_tokens``: every input's tokens; nothing is
cached or generated). An attempt begins and ends as a generation attempt does (``RequestStream.begin``: the
lease, the in-flight record, the cancel key), so a redelivered task of a finished request adds nothing and a
live peer re-queues the requests of a worker that died. A config change is handled as a generation worker's
(``heartbeat.ConfigDrain``, shared with ``pools.worker``): under a successor-first supervisor (``tessera up``) the
worker keeps serving, reporting ``config_stale``, until a peer on the latest announced config is live, then
leaves the pool, hands its queue over, finishes its running tasks and exits with ``EXIT_RELOAD``; under any
other supervisor it drains at once and exits with ``EXIT_RELOAD`` for its supervisor to restart it.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import time

import redis
from celery import Celery

from gpu_workers.engine.embedder import DeadlineExceeded, Embedder, EmbedderConfig
from gpu_workers.engine.params import InvalidRequest
from gpu_workers.pools.consumer import consume
from gpu_workers.pools.heartbeat import ConfigDrain, ConfigWatch, Heartbeat
from gpu_workers.pools.inflight import Inflight, take_orphans
from gpu_workers.pools.stream import LeaseLost, RequestStream
from gpu_workers.protocol import (
    EXIT_RELOAD,
    TASK_EMBED,
    DeploymentSpec,
    Embeddings,
    EmbedTask,
    Event,
    Usage,
    WorkerInfo,
    connect_redis,
    make_celery,
    pool_queue,
    send_task,
    worker_queue,
)

log = logging.getLogger(__name__)

EMBED_POOL = "serve"
MAX_BATCH_TOKENS = 8192  # tokens in one forward pass: 32 inputs of 256 tokens


def embedder_config(spec: DeploymentSpec, device: str = "cpu") -> EmbedderConfig:
    """A deployment's ``max_num_seqs`` is its embedding batch: the inputs one forward pass takes."""
    return EmbedderConfig(
        dtype=spec.dtype, device=device, max_batch_inputs=spec.max_num_seqs, max_batch_tokens=MAX_BATCH_TOKENS
    )


def _event(code: str, message: str, usage: Usage | None = None) -> Event:
    return Event(
        kind="error",
        error={"code": code, "message": message},
        usage=_usage(usage),
    )


def _usage(usage: Usage | None) -> dict[str, int] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "cached_tokens": 0, "completion_tokens": 0}


def encode_vectors(vectors) -> Embeddings:
    """[n, d] fp32 tensor -> the wire form (base64 of little-endian float32 rows)."""
    raw = vectors.contiguous().numpy().astype("<f4", copy=False).tobytes()
    return Embeddings(shape=list(vectors.shape), data=base64.b64encode(raw).decode("ascii"))


class EmbedRunner:
    """Runs this worker's embedding tasks on its Embedder."""

    def __init__(self, embedder: Embedder, client: redis.Redis, app: Celery, *, worker_id: str):
        self.embedder = embedder
        self.client = client
        self.app = app
        self.worker_id = worker_id
        self.inflight = Inflight(client, worker_id)

    def register(self) -> None:
        self.app.task(name=TASK_EMBED, ignore_result=True)(self._task)

    def _task(self, payload: str) -> None:
        self.run(payload)

    def run(self, payload: str) -> None:
        task = EmbedTask.from_json(payload)
        stream = RequestStream(self.client, task.request_id, self.worker_id)
        begun = stream.begin(
            handed_over=False, inflight=self.inflight.entry(task.request_id, TASK_EMBED, payload)
        )
        if begun.status in ("finished", "busy"):
            log.info("request %s is %s; dropping a redelivered embed task", task.request_id, begun.status)
            return
        try:
            if begun.status == "cut":  # an embedding request writes one event: cut cannot happen, but be safe
                stream.publish(_event("worker_lost", "the worker serving this request stopped; retry it"))
                return
            self.inflight.track(task.request_id)
            try:
                stream.publish(self._embed(task, begun.cancelled))
            finally:
                self.inflight.untrack(task.request_id)
        except LeaseLost:
            log.warning("request %s was taken over by another attempt; stopped this one", task.request_id)
        except Exception as exc:
            log.exception("embedding request %s failed", task.request_id)
            try:
                stream.publish(_event("internal_error", f"the worker failed embedding this request: {exc}"))
            except Exception:
                log.exception("could not report the failure of request %s", task.request_id)
        finally:
            stream.end(self.inflight.key)

    def _embed(self, task: EmbedTask, cancelled: bool) -> Event:
        usage = Usage(prompt_tokens=sum(len(ids) for ids in task.inputs))
        if cancelled:
            return Event(kind="final", finish_reason="abort", usage=_usage(usage))
        if time.time() >= task.deadline:
            return _deadline()
        try:
            vectors = self.embedder.submit(task.inputs, task.deadline).result()
        except InvalidRequest as e:
            return _event(e.code, e.message)
        except DeadlineExceeded:
            return _deadline()
        return Event(
            kind="final", finish_reason="stop", usage=_usage(usage), embeddings=encode_vectors(vectors)
        )

    def recover(self, dead_worker_id: str) -> None:
        """Re-queue a dead peer's unfinished requests (an embedding is all or nothing, so each is a clean retry
        while its deadline lasts) and the tasks waiting in its own queue."""
        for name, payload in take_orphans(self.client, dead_worker_id):
            task = EmbedTask.from_json(payload)
            stream = RequestStream(self.client, task.request_id, self.worker_id)
            if not stream.claim(previous_owner=dead_worker_id):
                continue
            try:
                if stream.state().finished:
                    continue
                if time.time() < task.deadline:
                    log.warning("re-queueing request %s of dead worker %s", task.request_id, dead_worker_id)
                    stream.release()
                    send_task(self.app, name, payload, pool_queue(task.deployment, EMBED_POOL))
                else:
                    stream.publish(_deadline())
            finally:
                stream.release()
        self.requeue_worker_queue(dead_worker_id)

    def requeue_worker_queue(self, worker_id: str) -> None:
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            while (message := channel.basic_get(worker_queue(worker_id), no_ack=True)) is not None:
                try:
                    (payload,), _, _ = message.decode()
                    deployment = EmbedTask.from_json(payload).deployment
                except Exception:
                    log.exception("dropping an unreadable message from the queue of worker %s", worker_id)
                    continue
                send_task(self.app, TASK_EMBED, payload, pool_queue(deployment, EMBED_POOL))


def _deadline() -> Event:
    return _event("deadline_exceeded", "the request passed its deadline before it was embedded; retry it")


def run_embed_worker(
    spec: DeploymentSpec,
    pool: str,
    redis_url: str,
    worker_id: str,
    threads: int = 8,
    device: str | None = None,
    loglevel: str = "INFO",
) -> None:
    """Serve an embedding deployment until told to stop; SystemExit(EXIT_RELOAD) once drained after its
    deployment's config changed (``pools.worker.run_worker`` sends encoder checkpoints here)."""
    if pool != EMBED_POOL:
        raise ValueError(
            f"{spec.name} is an embedding model: it runs one pool, {EMBED_POOL!r} (mode colocated), not {pool!r}"
        )
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    host = socket.gethostname()
    client = connect_redis(redis_url)
    watch = ConfigWatch(client, spec)
    if not watch.current():
        log.info("worker %s: the config of %s changed before it started; reloading", worker_id, spec.name)
        raise SystemExit(EXIT_RELOAD)
    embedder = Embedder.from_pretrained(spec.checkpoint, embedder_config(spec, device))
    log.info(
        "worker %s: embedder warmed up in %.2f s (%s)", worker_id, embedder.warm_up(), embedder.dtype_reason
    )
    app = make_celery(redis_url)
    runner = EmbedRunner(embedder, client, app, worker_id=worker_id)
    runner.register()
    reload = ConfigDrain(client, watch, worker_id, runner.requeue_worker_queue)

    def info() -> WorkerInfo:
        stats = embedder.stats()
        return WorkerInfo(
            worker_id=worker_id,
            deployment=spec.name,
            pool=pool,
            queue=worker_queue(worker_id),
            host=host,
            pid=os.getpid(),
            last_seen=time.time(),
            waiting=int(stats["waiting"]),
            inflight=len(runner.inflight),
            steps=int(stats["batches"]),
            config_version=watch.version,
            integrity_check=spec.integrity_check,
            config_stale=reload.stale.is_set(),
            draining=reload.draining.is_set(),
        )

    def upkeep() -> None:
        runner.inflight.renew()
        reload.tick(heartbeat)

    heartbeat = Heartbeat(
        client,
        info,
        on_tick=upkeep,
        on_dead_peer=runner.recover,
        on_draining_peer=runner.requeue_worker_queue,
    )
    embedder.start()
    heartbeat.start()
    log.info("worker %s serving embeddings of %s on %s", worker_id, spec.name, device)
    try:
        consume(app, worker_id, host, [spec.queue(pool), worker_queue(worker_id)], threads, loglevel)
    finally:
        reloading = reload.draining.is_set()
        heartbeat.stop(leave=reload.leave_on_stop(reloading))
        embedder.stop()
    # Stopped while stale too: its supervisor let it drain before a successor.
    if reloading or reload.stale.is_set():
        runner.requeue_worker_queue(worker_id)  # what was queued for it while it drained: its successor's
    if reloading:
        log.info("worker %s drained; exits with %d to restart on the new config", worker_id, EXIT_RELOAD)
        raise SystemExit(EXIT_RELOAD)
