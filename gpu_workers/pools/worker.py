"""A worker process: one engine for one (deployment, pool), fed by a Celery thread pool, heartbeating into Redis.

``run_worker`` is what ``tessera worker`` calls; ``python -m gpu_workers.pools.worker`` runs it standalone
(the prefix-cache secret comes from the environment, never the command line).

If the engine stops for good (``Engine.failed``: a device error, or steps that keep failing), the worker
leaves its pool at once (no more heartbeats, its entry removed), its running requests end with
``worker_lost``, the tasks it had not started go back to the pool queue, and the process exits with
``EXIT_ENGINE_FAILED`` so that its supervisor starts a fresh one.

A config change reaches the worker through its heartbeat (``ConfigWatch``): when the deployment's announced
config is no longer the one it serves, it reports ``config_stale`` and drains: it stops taking tasks, finishes
the requests it is serving on the engine it has, and exits with ``EXIT_RELOAD``, which its supervisor answers
by starting it at once on the config re-read from the database. When to drain:
- under a supervisor that starts a successor for a stale worker (``tessera up`` sets ``SUCCESSOR_FIRST_ENV``),
  it keeps serving until a peer on the latest announced config is live, then leaves the pool and drains: the
  pool never goes without a live worker. Once it has reported ``config_stale`` it stays stale, still
  reporting the version it served, even if the config is changed back to its own before it leaves: a
  successor may be starting for it already (or be live, or be restarting to read a newer config), and only
  the worker leaving keeps one worker per slot whatever the order; the change back costs one reload;
- otherwise at once. Its heartbeat entry stays (marked ``draining``) until it goes stale, so the router keeps
  queueing requests for it while it restarts; its successor hands that queue over to the pool each tick.
Either way queued requests wait and none fails, unless a restart outlasts the heartbeat TTL in the second case.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import uuid
from dataclasses import fields

from celery.worker import state as celery_state

from gpu_workers.encoder_checkpoint import is_encoder_checkpoint
from gpu_workers.engine import Engine, EngineConfig
from gpu_workers.kv.transfer import kv_format_name
from gpu_workers.pools.consumer import consume
from gpu_workers.pools.embed import run_embed_worker
from gpu_workers.pools.handoff import HandoffStore
from gpu_workers.pools.heartbeat import ConfigDrain, ConfigWatch, Heartbeat
from gpu_workers.pools.metrics import EngineCollector, Exporter
from gpu_workers.pools.tasks import TaskRunner
from gpu_workers.protocol import (
    EXIT_RELOAD,
    POOLS,
    DeploymentSpec,
    WorkerInfo,
    connect_redis,
    make_celery,
    worker_queue,
)

log = logging.getLogger(__name__)

SECRET_ENV = "TESSERA_PREFIX_CACHE_SECRET"
EXIT_ENGINE_FAILED = os.EX_SOFTWARE if hasattr(os, "EX_SOFTWARE") else 70


# The knobs a deployment hands its engine as they are: the fields DeploymentSpec and EngineConfig share.
ENGINE_FIELDS = tuple(
    f.name for f in fields(DeploymentSpec) if f.name in {f.name for f in fields(EngineConfig)}
)


def engine_config(spec: DeploymentSpec, pool: str, secret: bytes, device: str = "cpu") -> EngineConfig:
    """The engine a pool runs: every ``DeploymentSpec`` field ``EngineConfig`` also has, by name (so a
    worker-side knob is a field of both), and the pool's formats: decode stores the decode KV format and
    loads the decode weights, serve and prefill the prefill ones."""
    decode = pool == "decode"
    return EngineConfig(
        **{name: getattr(spec, name) for name in ENGINE_FIELDS},
        device=device,
        kv_cache_dtype=spec.decode_kv if decode else spec.prefill_kv,
        weights=spec.decode_weights if decode else spec.prefill_weights,
        prefix_cache_secret=secret,
    )


def default_worker_id(pool: str) -> str:
    return f"{pool}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def run_worker(
    spec: DeploymentSpec,
    pool: str,
    redis_url: str,
    secret: bytes,
    worker_id: str | None = None,
    threads: int = 8,
    handoff: str = "auto",
    device: str | None = None,
    loglevel: str = "INFO",
    metrics_port: int = 0,
) -> None:
    """Serve ``spec``'s ``pool`` until the process is told to stop (SIGTERM/SIGINT: finish running tasks);
    if the engine fails for good, raise SystemExit(EXIT_ENGINE_FAILED) once running tasks have ended; if the
    deployment's announced config is no longer ``spec``, SystemExit(EXIT_RELOAD) once they have ended.

    ``threads`` bounds the requests this worker serves at once (each task holds a thread until its request
    ends), so it should be close to ``spec.max_num_seqs``. ``handoff`` (prefill): ``auto`` uses shared
    memory when every decode worker is on this host, else Redis; ``redis`` or ``shm`` force one.
    ``metrics_port``: serve the worker's Prometheus meters there (0: off).
    """
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    if handoff not in ("auto", "redis", "shm"):
        raise ValueError(f"handoff must be auto, redis or shm, got {handoff!r}")
    worker_id = worker_id or default_worker_id(pool)
    if is_encoder_checkpoint(spec.checkpoint):  # an embedding model: no engine, no KV (pools/embed.py)
        run_embed_worker(spec, pool, redis_url, worker_id, threads=threads, device=device, loglevel=loglevel)
        return
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    host = socket.gethostname()
    client = connect_redis(redis_url)
    watch = ConfigWatch(client, spec)
    if not watch.current():  # changed since the caller read the database: read it again before loading
        log.info("worker %s: the config of %s changed before it started; reloading", worker_id, spec.name)
        raise SystemExit(EXIT_RELOAD)
    config = engine_config(spec, pool, secret, device)
    engine = Engine.from_pretrained(spec.checkpoint, config)
    # A prefill worker's requests end at their first token; decode and serve workers also run decode steps.
    warm_s = engine.warm_up(max_tokens=1 if pool == "prefill" else 3)
    log.info(
        "worker %s: engine warmed up in %.2f s (kernels compiled or loaded, before the first request)",
        worker_id,
        warm_s,
    )
    app = make_celery(redis_url)
    store = HandoffStore(client)
    decode_format = engine_config(spec, "decode", secret).kv_dtype if pool == "prefill" else None
    runner = TaskRunner(
        engine,
        client,
        app,
        worker_id=worker_id,
        pool=pool,
        host=host,
        handoff=store,
        handoff_transport=handoff,
        export_kv=kv_format_name(decode_format) if decode_format is not None else None,
    )
    runner.register()
    reload = ConfigDrain(client, watch, worker_id, runner.requeue_worker_queue, log)
    kv_format = kv_format_name(config.kv_dtype)

    def info() -> WorkerInfo:
        stats = engine.stats()
        return WorkerInfo(
            worker_id=worker_id,
            deployment=spec.name,
            pool=pool,
            queue=worker_queue(worker_id),
            host=host,
            pid=os.getpid(),
            last_seen=time.time(),
            kv_pages_total=stats["kv_pages_total"],
            kv_pages_used=stats["kv_pages_used"],
            running=stats["running"],
            waiting=stats["waiting"],
            inflight=len(runner.inflight),
            kv_format=kv_format,
            integrity_mismatches=stats["integrity_mismatches"],
            prefix_cache_query_tokens=stats["prefix_cache_query_tokens"],
            prefix_cache_hit_tokens=stats["prefix_cache_hit_tokens"],
            generated_tokens=stats["generated_tokens"],
            steps=stats["steps"],
            preemptions=stats["preemptions"],
            config_version=watch.version,
            integrity_check=spec.integrity_check,
            config_stale=reload.stale.is_set(),
            draining=reload.draining.is_set(),
        )

    def upkeep() -> None:
        runner.inflight.renew()
        store.sweep()
        reload.tick(heartbeat)  # a config change: stale, then drain (the docstring says when)

    heartbeat = Heartbeat(
        client,
        info,
        on_tick=upkeep,
        on_dead_peer=runner.recover,
        on_draining_peer=runner.requeue_worker_queue,
    )

    def on_engine_failure(error: BaseException) -> None:
        log.critical("worker %s: the engine failed for good (%s); leaving the pool", worker_id, error)
        heartbeat.stop()  # routers stop choosing this worker now, not a heartbeat TTL from now
        # Celery's warm shutdown: no new tasks, the running ones end (each with worker_lost), then exit.
        celery_state.should_stop = EXIT_ENGINE_FAILED

    queues = [spec.queue(pool), worker_queue(worker_id)]
    exporter = Exporter(  # budgets-metrics: the worker's Prometheus meters
        EngineCollector(spec.name, pool, engine.stats, lambda: sum(client.llen(q) for q in queues)),
        metrics_port,
    )
    exporter.start()  # first: a port already taken fails the worker before it serves anything
    engine.start(on_failure=on_engine_failure)
    heartbeat.start()
    log.info("worker %s serving %s/%s on %s (%s KV)", worker_id, spec.name, pool, device, kv_format)
    try:
        consume(app, worker_id, host, queues, threads, loglevel)
    finally:
        reloading = reload.draining.is_set() and engine.failed is None
        heartbeat.stop(leave=reload.leave_on_stop(reloading))
        exporter.stop()
        engine.stop()
    # Stopped while stale too: its supervisor let it drain before a successor.
    if reloading or reload.stale.is_set():
        runner.requeue_worker_queue(worker_id)  # what was queued for it while it drained: its successor's
    if reloading:
        log.info("worker %s drained; exits with %d to restart on the new config", worker_id, EXIT_RELOAD)
        raise SystemExit(EXIT_RELOAD)
    if engine.failed is not None:
        # Nobody consumes this worker's own queue any more, and with its entry gone no peer recovers it.
        runner.requeue_worker_queue(worker_id)
        log.critical("worker %s exits with %d so that it is restarted", worker_id, EXIT_ENGINE_FAILED)
        raise SystemExit(EXIT_ENGINE_FAILED)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_workers.pools.worker", description=__doc__)
    parser.add_argument("--spec-json", required=True, help="the DeploymentSpec as JSON")
    parser.add_argument("--pool", required=True, choices=POOLS)
    parser.add_argument("--redis-url", required=True, help="redis://host:port/db or redis+socket:///path")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--handoff", default="auto", choices=("auto", "redis", "shm"))
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--loglevel", default="INFO")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus meters on this port (0: off)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        print(f"error: set {SECRET_ENV} to the deployment's prefix-cache secret", file=sys.stderr)
        return 2
    run_worker(
        DeploymentSpec.from_json(args.spec_json),
        args.pool,
        args.redis_url,
        secret.encode(),
        worker_id=args.worker_id,
        threads=args.threads,
        handoff=args.handoff,
        device=args.device,
        loglevel=args.loglevel,
        metrics_port=args.metrics_port,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
