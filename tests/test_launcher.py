"""``tessera up`` as a user runs it: a subprocess that prints a URL and a key, serves, and on Ctrl-C or
SIGTERM stops every process it started (workers, API, embedded Redis), leaving nothing running.

``start_up`` / ``stop_up`` are shared with test_openai_sdk.py.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from tessera.launcher import DEFAULT_MODEL

pytestmark = pytest.mark.slow

READY_TIMEOUT_S = 240.0


@dataclass
class Up:
    process: subprocess.Popen
    data_dir: Path
    port: int
    lines: list[str] = field(default_factory=list)
    key: str | None = None
    redis_socket: str = ""
    redis_pid: int = 0
    pids: set[int] = field(default_factory=set)  # every process it started, recorded once it was up

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def started_for(data_dir: Path) -> set[int]:
    """Live processes whose environment names ``data_dir``: what ``tessera up`` started, even once orphaned."""
    marker = f"TESSERA_DATA_DIR={data_dir}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0") and running(int(entry.name)):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def start_up(data_dir: Path, port: int | None = None, wait: bool = True) -> Up:
    """Run ``tessera up`` on a free port and read its output until it says it is up (or exits)."""
    port = port or free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    command = [sys.executable, "-m", "tessera.cli", "up", "--port", str(port), "--data-dir", str(data_dir)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    up = Up(process, data_dir, port)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    up._lines_queue = lines  # type: ignore[attr-defined]
    if not wait:
        return up
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError(f"tessera up exited ({process.wait()}):\n{up.output}")
        up.lines.append(line)
        if match := re.match(r"API key: (\S+)$", line):
            up.key = match.group(1)
        if match := re.search(r"embedded Redis: socket (\S+) \(pid (\d+)\)", line):
            up.redis_socket, up.redis_pid = match.group(1), int(match.group(2))
        if line.startswith("Ctrl-C stops everything"):  # the last line of the banner
            up.pids = descendants(process.pid) | {up.redis_pid}
            return up
    stop_up(up, signal.SIGTERM)
    raise AssertionError(f"tessera up not ready in {READY_TIMEOUT_S}s:\n{up.output}")


def drain(up: Up, timeout_s: float) -> None:
    lines = up._lines_queue  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if up.process.poll() is not None:
                return
            continue
        if line is None:
            return
        up.lines.append(line)


def stop_up(up: Up, sig: int, timeout_s: float = 40.0) -> int:
    """Signal ``tessera up`` and wait for it; returns its exit code."""
    up.process.send_signal(sig)
    try:
        code = up.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        up.process.kill()
        raise AssertionError(f"tessera up did not stop in {timeout_s}s:\n{up.output}") from None
    drain(up, 2.0)
    return code


def assert_all_stopped(up: Up) -> None:
    assert up.pids, "no processes were recorded"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(running(p) for p in up.pids):
        time.sleep(0.1)
    left = {p for p in up.pids if running(p)} | started_for(up.data_dir)
    assert not left, f"still running after tessera up stopped: {left}\n{up.output}"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("up")


def test_up_prints_url_and_key_serves_and_ctrl_c_stops_everything(data_dir):
    up = start_up(data_dir)
    try:
        assert up.key and up.key.startswith("tsk_")
        assert f"{up.url}/v1" in up.output
        assert f"Authorization: Bearer {up.key}" in up.output  # the curl example is ready to paste
        assert len(up.pids) >= 4  # prefill worker, decode worker, API, Redis
        assert httpx.get(f"{up.url}/readyz").status_code == 200
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        response = httpx.post(
            f"{up.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {up.key}"},
            json=body,
            timeout=60,
        )
        assert response.status_code == 200, response.text
    finally:
        code = stop_up(up, signal.SIGINT)
    assert code == 0, up.output
    assert "stopped." in up.output
    assert_all_stopped(up)
    (data_dir / "first-key").write_text(up.key)


def test_up_again_reuses_the_data_dir_prints_no_new_key_and_sigterm_stops_everything(data_dir):
    up = start_up(data_dir)
    try:
        assert up.key is None and "tenants exist already" in up.output
        assert "writing the demo model" not in up.output
        first_key = (data_dir / "first-key").read_text()
        models = httpx.get(f"{up.url}/v1/models", headers={"Authorization": f"Bearer {first_key}"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == DEFAULT_MODEL
    finally:
        code = stop_up(up, signal.SIGTERM)
    assert code == 0, up.output
    assert_all_stopped(up)


def test_up_stops_everything_and_fails_when_a_part_cannot_start(data_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = start_up(data_dir, port=port, wait=False)
        try:
            code = up.process.wait(timeout=READY_TIMEOUT_S)
        finally:
            if up.process.poll() is None:
                stop_up(up, signal.SIGTERM)
        drain(up, 2.0)
    assert code == 1, up.output
    assert "the api exited" in up.output and "stopped." in up.output
    match = re.search(r"embedded Redis: socket (\S+) \(pid (\d+)\)", up.output)
    assert match and not running(int(match.group(2)))
    assert not started_for(data_dir)
