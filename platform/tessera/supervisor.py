"""Process supervision for ``tessera up``: one run per data dir, a free port, and children restarted with
backoff when they exit, or at once when a worker exits to reload its deployment's changed config."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from gpu_workers.protocol import EXIT_RELOAD

LOCK_FILE = "up.lock"
STOP_TIMEOUT_S = 10.0


class GaveUp(RuntimeError):
    """A child kept failing right after it started: restarting it again would not help."""


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
    quick_reloads: int = 0  # reload exits in a row that came soon after a start
    restart_at: float | None = None  # set while it waits out its backoff
    retiring: bool = False  # a successor took its place: when it exits, it is not restarted
    predecessor: Child | None = None  # the retiring child this one was started to replace

    def start(self) -> None:
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stopping it reaps what it forked
                preexec_fn=die_with(os.getpid()),
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
    ends within ``settle_s`` of its start; gives up after ``max_quick_failures`` such runs in a row.

    A child that exits with ``EXIT_RELOAD`` (a worker whose deployment's config changed, its requests
    finished) is restarted at once, so it reads the new config; only a run of ``max_quick_failures`` such
    exits each soon after its start (a config that never matches what it reads) falls back to backoff.
    ``replace`` starts a child's successor while the child still runs (the launcher's successor-first
    reload)."""

    out: TextIO = sys.stdout
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    settle_s: float = 30.0  # a child that ran this long was healthy: its next failure starts the count over
    max_quick_failures: int = 5
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, command: list[str], env: dict[str, str] | None, log_path: Path) -> Child:
        child = Child(name, command, env, log_path)
        with signals_deferred():
            child.start()
            self.children.append(child)
        self.out.write(f"started the {name} (pid {child.process.pid}, log {log_path})\n")
        self.out.flush()
        return child

    def replace(self, child: Child) -> Child:
        """Start a successor of ``child`` (its command, env and log) now; ``child`` keeps running until it
        exits on its own (a worker drains once its successor is live) and is then not restarted."""
        successor = Child(child.name, child.command, child.env, child.log_path, predecessor=child)
        with signals_deferred():
            child.retiring = True
            successor.start()
            self.children.append(successor)
        self._say(
            f"started the {child.name} (pid {successor.process.pid}) to take over from pid "
            f"{child.process.pid}, which serves an old config and leaves once its successor is live"
        )
        return successor

    def tend(self) -> None:
        """Notice exits and restart what is due; raises GaveUp when a child keeps failing at start."""
        with signals_deferred():
            self._tend()

    def _tend(self) -> None:
        now = time.monotonic()
        for child in list(self.children):
            if child.retiring:
                if (code := child.process.poll()) is not None:
                    signal_group(child.process, signal.SIGKILL)
                    self.children.remove(child)
                    self._say(f"the {child.name} (pid {child.process.pid}) it replaced {describe_exit(code)}")
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.start()
                    self._say(f"restarted the {child.name} (pid {child.process.pid})")
                continue
            code = child.process.poll()
            if code is not None:
                self._exited(child, code, now)

    def _exited(self, child: Child, code: int, now: float) -> None:
        signal_group(child.process, signal.SIGKILL)  # what it forked must not outlive it
        ran_s = now - child.started_at
        old, child.predecessor = child.predecessor, None
        if code != EXIT_RELOAD and any(c is old for c in self.children) and old.process.poll() is None:
            # It may not fit beside the one it replaces (a device holds one engine): let that one drain first.
            signal_group(old.process, signal.SIGTERM)
            self._say(f"the {child.name} (pid {old.process.pid}) it was to replace drains first instead")
        if code == EXIT_RELOAD:
            child.quick_reloads = child.quick_reloads + 1 if ran_s < self.settle_s else 0
            if child.quick_reloads < self.max_quick_failures:
                pid = child.process.pid
                child.start()
                self._say(
                    f"the {child.name} (pid {pid}) exited to reload its config; "
                    f"restarted it at once (pid {child.process.pid})"
                )
                return
        else:
            child.quick_reloads = 0
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
            signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in running:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say(f"the {child.name} did not stop in {STOP_TIMEOUT_S:.0f}s; killing it")
            # Reap stragglers in the group (threads' helpers, forked children) whatever the leader did.
            signal_group(child.process, signal.SIGKILL)
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


@contextlib.contextmanager
def signals_deferred(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, then act on the first that came.

    ``tessera up``'s handlers raise, and an exception between a child's fork and its being recorded in
    ``children`` (inside ``Popen``, while the child execs) would leave that child running untracked:
    ``stop()`` would never signal it. Handlers can only be set from the main thread; elsewhere this is a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, object]] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: caught.append((signum, frame))) for sig in signals
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(sig, handler)
        if caught:
            signum, frame = caught[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


# -- the platform --------------------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_libc = ctypes.CDLL(None, use_errno=True)


def die_with(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child is killed (SIGKILL) when ``parent``, the supervisor, dies, however it
    dies: after a ``kill -9`` of ``tessera up`` no API or worker lives on holding the port and the pools, and
    the next ``tessera up`` starts (it stops the embedded Redis the dead run left, which daemonised)."""

    def preexec() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the supervisor died before the line above: nobody is left to tell
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)  # start_new_session: the child's pid is its group id


def stop_pid(pid: int) -> None:
    """SIGTERM (Redis saves its data and exits), SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
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
