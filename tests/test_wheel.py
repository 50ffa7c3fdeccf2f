"""Issue 18: Tessera installs from a wheel. `python -m build` makes the sdist and (from it) the wheel; the
wheel goes into a fresh venv outside the checkout (torch first, as the README says), and from an empty
directory `tessera db upgrade` migrates a new SQLite file and `tessera up` serves the trained default model
(its packaged copy, not the random demo), answers a completion and stops on Ctrl-C."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.test_launcher import (
    READY_TIMEOUT_S,
    Up,
    assert_all_stopped,
    completion,
    descendants,
    free_port,
    read_line,
    stop_up,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "pycode-tiny"
# What a copy of the checkout leaves out: environments, caches, build outputs.
SKIP = shutil.ignore_patterns(
    ".git", ".venv", ".ci", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
)


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist and wheel built by `python -m build` from a copy of the checkout (so the checkout gets no build/)."""
    pytest.importorskip("build")
    base = tmp_path_factory.mktemp("dist")
    source = base / "src"
    shutil.copytree(ROOT, source, symlinks=True, ignore=SKIP)
    out = base / "out"
    run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        base,
        dict(os.environ),
        300,
    )
    return out


def test_the_wheel_carries_the_model_and_the_migrations_and_stays_small(dist):
    (wheel,) = dist.glob("tessera-*.whl")
    (sdist,) = dist.glob("tessera-*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        sizes = {info.filename: info.file_size for info in archive.infolist()}
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "TRAINING.md",
    ):
        assert sizes[f"tessera/_models/pycode-tiny/{name}"] == (MODEL / name).stat().st_size, name
    assert "tessera/_migrations/env.py" in sizes and "tessera/_migrations/script.py.mako" in sizes
    versions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("*.py"))
    assert versions and all(f"tessera/_migrations/versions/{v}" in sizes for v in versions)
    assert not any("__pycache__" in name for name in sizes)
    # The web UI ships (its vendored chart library included); axe-core is for the browser tests only.
    assert "tessera/_web/templates/dashboard.html" in sizes
    assert "tessera/_web/static/vendor/chart.js/chart.umd.min.js" in sizes
    assert not any("axe" in name for name in sizes)
    # The model is the only large file: everything else together is under 3 MB (2.0 MB on 2026-12-04: the
    # code 1.4 MB, the tokenizer 0.26 MB, the chart library 0.21 MB), no other file over 500 kB.
    weights = sizes["tessera/_models/pycode-tiny/model.safetensors"]
    assert (
        sum(sizes.values()) - weights < 3_000_000
        and max(s for n, s in sizes.items() if s != weights) < 500_000
    )
    assert wheel.stat().st_size < weights * 1.1 and sdist.stat().st_size < weights * 1.2


def test_a_wheel_install_outside_the_checkout_migrates_serves_the_trained_model_and_stops(dist, tmp_path):
    (wheel,) = dist.glob("tessera-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, dict(os.environ), 120)
    # As a user's shell has it. PYTHONDONTWRITEBYTECODE too: with it, each process would compile anew every
    # module it imports (pip installs with --no-compile, below).
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_") and k not in drop}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    # --no-compile: pip byte-compiles every installed module by default (torch's thousands: most of the
    # install's time); the ones this test imports are compiled once, by the first process importing them.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]
    run([*pip, "torch==2.13.0"], tmp_path, env, 600)  # as the README says: torch first
    run([*pip, f"{wheel}[embedded]"], tmp_path, env, 600)

    empty = tmp_path / "empty"
    empty.mkdir()
    where = run(
        [str(venv / "bin" / "python"), "-c", "import tessera; print(tessera.__file__)"], empty, env, 60
    )
    assert where.strip().startswith(str(venv)), where  # the installed copy, not the checkout
    tessera = str(venv / "bin" / "tessera")

    url = f"sqlite:///{empty / 'fresh.db'}"
    upgraded = run([tessera, "db", "upgrade", "--database-url", url], empty, env, 120)
    assert re.search(r"upgraded from an empty database to revision \w+", upgraded), upgraded

    port = free_port()
    env["TESSERA_DATABASE_URL"] = url
    process = subprocess.Popen(
        [tessera, "up", "--port", str(port)],
        cwd=empty,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    up = Up(process, empty / ".tessera", port)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    up._lines_queue = lines  # type: ignore[attr-defined]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not up.output.endswith("Ctrl-C stops everything."):
            line = read_line(up, 1)
            if line is None and process.poll() is not None:
                raise AssertionError(f"tessera up exited ({process.wait()}):\n{up.output}")
            if line and (match := re.match(r"API key: (\S+)$", line)):
                up.key = match.group(1)
            if line and (match := re.search(r"embedded Redis: socket (\S+) \(pid (\d+)\)", line)):
                up.redis_socket, up.redis_pid = match.group(1), int(match.group(2))
        up.pids = descendants(process.pid) | {up.redis_pid}
        assert up.output.endswith("Ctrl-C stops everything."), up.output
        assert "demo model" not in up.output, up.output
        # The deployment's checkpoint is the wheel's copy of the trained model.
        checkpoint = Path(re.search(r"model: @tessera/pycode-tiny \((.+)\)", up.output).group(1))
        assert checkpoint.is_relative_to(venv) and checkpoint.name == "pycode-tiny", up.output
        assert json.loads((checkpoint / "config.json").read_text()) == json.loads(
            (MODEL / "config.json").read_text()
        )
        assert httpx.get(f"{up.url}/readyz").status_code == 200
        assert httpx.get(f"{up.url}/signin").status_code == 200  # the UI's templates came with the wheel
        reply = completion(up, timeout=120, model="@tessera/pycode-tiny")
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == "@tessera/pycode-tiny" and body["usage"]["completion_tokens"] > 0, body
    finally:
        code = stop_up(up, signal.SIGINT)
    assert code == 0 and "stopped." in up.output, up.output
    assert_all_stopped(up)
