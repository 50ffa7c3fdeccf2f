"""Real ``tessera api`` processes (replicas) sharing one Redis and one database, for the tests that prove
something holds across API processes (test_auth.py, test_quota_gateway.py)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Replicas:
    urls: list[str]
    logs: list[Path]


@contextlib.contextmanager
def api_processes(env: dict[str, str], log_dir: Path, count: int = 2) -> Iterator[Replicas]:
    """``count`` `tessera api` processes run with ``env`` (its TESSERA_* name the shared Redis, database
    and secret), each answering /healthz before this yields; all stopped after."""
    procs, urls, logs = [], [], []
    try:
        for i in range(count):
            port = free_port()
            log = log_dir / f"api-{i}.log"
            with log.open("wb") as out:
                cmd = [sys.executable, "-m", "tessera.cli", "api", "--port", str(port)]
                procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
            logs.append(log)
        for url, proc, log in zip(urls, procs, logs, strict=True):
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                assert proc.poll() is None, f"the API process exited: {log.read_text()}"
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"the API did not start: {log.read_text()}"
                time.sleep(0.1)
        yield Replicas(urls, logs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a teardown must not leave it running
                proc.kill()
                proc.wait()
