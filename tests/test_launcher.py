"""``tessera up`` as a user runs it: a subprocess that prints a URL and a key, serves, restarts a worker that
dies, refuses a second run on its data dir or port, and on Ctrl-C or SIGTERM stops every process it started
(workers, API, embedded Redis), leaving nothing running.

``start_up`` / ``stop_up`` are shared with test_openai_sdk.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
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
from openai import OpenAI
from tessera.launcher import CHAT_MODEL, DEFAULT_MODEL, worker_threads_env

from gpu_workers.protocol import WorkerInfo, connect_redis, workers_key

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


def read_line(up: Up, timeout_s: float) -> str | None:
    """The next line ``tessera up`` prints (recorded), None if it printed none in time or exited."""
    try:
        line = up._lines_queue.get(timeout=timeout_s)  # type: ignore[attr-defined]
    except queue.Empty:
        return None
    if line is not None:
        up.lines.append(line)
    return line


def wait_for_line(up: Up, pattern: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = read_line(up, 0.2)
        if line is not None and (match := re.search(pattern, line)):
            return match
        if line is None and up.process.poll() is not None:
            break
    raise AssertionError(f"no line matching {pattern!r} in {timeout_s}s:\n{up.output}")


def start_up(data_dir: Path, port: int | None = None, wait: bool = True) -> Up:
    """Run ``tessera up`` on a free port and read its output until it says it is up (or exits)."""
    port = port or free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    # Sixteen requests at once beside two model workers and another test process on two cores may wait
    # seconds to be admitted: these tests prove what admitted requests get, not the overload refusal.
    env["TESSERA_ADMISSION_WAIT_S"] = "60"
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
        line = read_line(up, 1)
        if line is None:
            if process.poll() is not None:
                raise AssertionError(f"tessera up exited ({process.wait()}):\n{up.output}")
            continue
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
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if read_line(up, 0.2) is None and up.process.poll() is not None:
            return


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


def api_pid(up: Up) -> int:
    """The API process among those ``tessera up`` started (by its command line)."""
    for pid in up.pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-3:-1] == [b"tessera.cli", b"api"]:
                return pid
    raise AssertionError(f"no API process among {up.pids}")


def assert_all_stopped(up: Up) -> None:
    assert up.pids, "no processes were recorded"
    # Orphaned helpers (a worker's multiprocessing resource tracker) exit once they notice their parent is
    # gone: they get the same grace as the recorded processes.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (any(running(p) for p in up.pids) or started_for(up.data_dir)):
        time.sleep(0.1)
    left = {p for p in up.pids if running(p)} | started_for(up.data_dir)
    assert not left, f"still running after tessera up stopped: {left}\n{up.output}"


def banner_commands(up: Up) -> str:
    """The shell lines the banner tells a user to run: the export, then the example request."""
    lines = up.output.splitlines()
    start = lines.index("Use the key:")
    end = next(i for i, line in enumerate(lines) if line.startswith("Ctrl-C stops everything"))
    return "\n".join(line[2:] for line in lines[start + 1 : end] if line.startswith("  "))


def completion(
    up: Up, key: str | None = None, timeout: float = 60, model: str = DEFAULT_MODEL
) -> httpx.Response:
    body = {"model": model, "prompt": "def add(a, b):", "max_tokens": 8}
    headers = {"Authorization": f"Bearer {key or up.key}"}
    return httpx.post(f"{up.url}/v1/completions", headers=headers, json=body, timeout=timeout)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("up")


def test_up_prints_url_and_key_serves_and_ctrl_c_stops_everything(data_dir):
    up = start_up(data_dir)
    try:
        assert up.key and up.key.startswith("tsk_")
        assert f"{up.url}/v1" in up.output
        served = re.findall(r"^model: (\S+) \(.*\); (\w+)$", up.output, re.M)
        assert served and served[0][0] == DEFAULT_MODEL, up.output
        expected_workers = sum(2 if mode == "disaggregated" else 1 for _, mode in served)
        assert len(up.pids) >= expected_workers + 2  # the workers, the API, Redis
        assert httpx.get(f"{up.url}/readyz").status_code == 200
        # The two workers share the cores (OMP_NUM_THREADS each), unless the user set it for them.
        expected = (
            os.environ.get("OMP_NUM_THREADS") or worker_threads_env({}, expected_workers)["OMP_NUM_THREADS"]
        )
        workers = [p for p in up.pids if b"worker" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]
        assert len(workers) == expected_workers
        for pid in workers:
            environ = dict(
                e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e
            )
            assert environ[b"OMP_NUM_THREADS"].decode() == expected
        # What the banner says to run works when pasted into a shell, and answers the question.
        commands = banner_commands(up)
        assert commands.startswith(f"export TESSERA_KEY={up.key}\n") and "/v1/chat/completions" in commands
        pasted = subprocess.run(["bash", "-c", commands], capture_output=True, text=True, timeout=60)
        reply = json.loads(pasted.stdout)
        assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] > 0, pasted
        if DEFAULT_MODEL == CHAT_MODEL:  # README's example: the OpenAI SDK, greedy, answers the question
            client = OpenAI(base_url=f"{up.url}/v1", api_key=up.key)
            answer = client.chat.completions.create(
                model=CHAT_MODEL,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=16,
                temperature=0,
            )
            assert "Paris" in answer.choices[0].message.content, answer
    finally:
        code = stop_up(up, signal.SIGINT)
    assert code == 0, up.output
    assert "stopped." in up.output
    assert_all_stopped(up)
    assert not Path(up.redis_socket).parent.exists()  # this run's temp dir (Redis socket, config, log)
    (data_dir / "first-key").write_text(up.key)


@pytest.fixture(scope="module")
def again(data_dir):
    """``tessera up`` run again on the first test's data dir: the refusals test runs against it, then the test
    of the second run stops it (SIGTERM), so the module starts one platform less."""
    up = start_up(data_dir)
    yield up
    if up.process.poll() is None:  # the second-run test failed before stopping it
        stop_up(up, signal.SIGTERM)


def test_a_second_up_on_the_same_data_dir_or_port_refuses_and_the_first_keeps_serving(again, tmp_path):
    first = again
    same_dir = start_up(first.data_dir, wait=False)
    assert same_dir.process.wait(timeout=60) == 1
    drain(same_dir, 2.0)
    assert f"another `tessera up` (pid {first.process.pid}) is running" in same_dir.output
    same_port = start_up(tmp_path / "second", port=first.port, wait=False)
    assert same_port.process.wait(timeout=60) == 1
    drain(same_port, 2.0)
    assert f"pid {api_pid(first)} holds it" in same_port.output, same_port.output
    for refused in (same_dir, same_port):
        assert "embedded Redis" not in refused.output and "stopped." not in refused.output
    # The first is untouched: its Redis, workers and API all still run, and it serves.
    assert all(running(pid) for pid in first.pids)
    key = first.key or (first.data_dir / "first-key").read_text()  # a second run prints no key
    served = completion(first, key)
    assert served.status_code == 200, served.text
    assert httpx.get(f"{first.url}/readyz").status_code == 200


def test_up_again_reuses_the_data_dir_prints_no_new_key_and_sigterm_stops_everything(data_dir, again):
    up = again
    try:
        assert up.key is None and "tenants exist already" in up.output
        assert "writing the demo model" not in up.output
        assert "export TESSERA_KEY=<your key>" in up.output
        first_key = (data_dir / "first-key").read_text()
        models = httpx.get(f"{up.url}/v1/models", headers={"Authorization": f"Bearer {first_key}"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == DEFAULT_MODEL
        assert revoked_with_the_cli_within(up) < 1.0
        streams = streams_across(up, 4, first_key)
    finally:
        code = stop_up(up, signal.SIGTERM)
    assert code == 0, up.output
    assert_all_stopped(up)
    # Every client saw its whole answer, or an error event: none a silent cut.
    for ends in streams.results():
        assert ends[-1] == "[DONE]", ends
        assert ends[-2].get("error", {}).get("code") == "server_shutting_down" or ends[-2]["choices"][0][
            "finish_reason"
        ] in ("stop", "length"), ends
    assert group_or_other_readable(data_dir) == []  # the database, Redis' snapshot, every log, the models


def cli(up: Up, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    command = [sys.executable, "-m", "tessera.cli", *args, "--data-dir", str(up.data_dir)]
    return subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=60).stdout


def revoked_with_the_cli_within(up: Up) -> float:
    """Seconds from `tessera keys revoke` (beside `tessera up`, knowing only its data dir) to the first 401."""
    secret = cli(up, "keys", "create", "--tenant", "default").strip()
    headers = {"Authorization": f"Bearer {secret}"}
    assert httpx.get(f"{up.url}/v1/models", headers=headers).status_code == 200  # cached as valid
    cli(up, "keys", "revoke", secret[: len("tsk_") + 8])
    revoked = time.monotonic()
    while httpx.get(f"{up.url}/v1/models", headers=headers).status_code != 401:
        assert time.monotonic() - revoked < 5, "the revoked key still works"
        time.sleep(0.02)
    return time.monotonic() - revoked


@dataclass
class Streams:
    """Streams running on a thread each: their last two payloads (JSON decoded, but [DONE]) once they end."""

    futures: list

    def results(self) -> list[list]:
        return [future.result(timeout=60) for future in self.futures]


def streams_across(up: Up, count: int, key: str) -> Streams:
    """``count`` long streams, each past its first token when this returns."""
    started = threading.Barrier(count + 1, timeout=120)
    body = {"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}

    def run() -> list:
        ends: list = []
        try:
            for data in stream_lines(up, {**body, "stream": True}, key):
                ends = [*ends[-1:], data if data == "[DONE]" else json.loads(data)]
                if len(ends) == 1:
                    started.wait()
        except BaseException:
            started.abort()  # the test sees this error, not a barrier that never fills
            raise
        return ends

    pool = concurrent.futures.ThreadPoolExecutor(count)
    futures = [pool.submit(run) for _ in range(count)]
    try:
        started.wait()
    except threading.BrokenBarrierError:
        for future in futures:
            future.result(timeout=60)
        raise
    return Streams(futures)


def test_up_on_a_port_in_use_refuses_before_starting_anything(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = start_up(tmp_path, port=port, wait=False)
        code = up.process.wait(timeout=60)
        drain(up, 2.0)
    assert code == 1, up.output
    assert f"cannot listen on 127.0.0.1:{port}" in up.output and f"pid {os.getpid()} holds it" in up.output
    assert "embedded Redis" not in up.output and not (tmp_path / "tessera.db").exists()
    assert not started_for(tmp_path)


def stream_lines(up: Up, body: dict, key: str | None = None):
    headers = {"Authorization": f"Bearer {key or up.key}"}
    with httpx.stream("POST", f"{up.url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield line[len("data: ") :]


def live_decode_pids(up: Up) -> set[int]:
    client = connect_redis(f"redis+socket://{up.redis_socket}")
    try:
        infos = [WorkerInfo.from_json(raw) for raw in client.hvals(workers_key(DEFAULT_MODEL, "decode"))]
    finally:
        client.close()
    return {info.pid for info in infos if time.time() - info.last_seen < 5}


def test_killing_the_decode_worker_mid_stream_ends_that_stream_with_an_error_and_the_platform_recovers(
    tmp_path,
):
    up = start_up(tmp_path)
    try:
        (decode_pid,) = live_decode_pids(up)
        api = api_pid(up)
        body = {
            "model": DEFAULT_MODEL,
            "prompt": "class Stack:\n    def __init__(self):",
            "max_tokens": 256,
            "temperature": 0.8,
            "seed": 1,
            "stream": True,
        }
        chunks, error, killed_at = [], None, None
        for data in stream_lines(up, body):
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                continue
            assert event["choices"][0]["finish_reason"] is None, f"finished before the kill: {chunks}"
            chunks.append(event["choices"][0]["text"])
            if len(chunks) == 3:  # decode is streaming: kill it as a crash would
                os.kill(decode_pid, signal.SIGKILL)
                killed_at = time.monotonic()
        assert killed_at is not None, f"the stream ended before the kill: {chunks}"
        ended_s = time.monotonic() - killed_at
        assert error is not None and error["code"] == "worker_lost", (error, chunks)
        assert ended_s < 45, f"the stream took {ended_s:.0f}s to end after its worker died"

        match = wait_for_line(up, r"restarted the decode worker \(pid (\d+)\)", 60)
        assert f"the decode worker (pid {decode_pid}) was killed by SIGKILL" in up.output
        new_decode = int(match.group(1))
        deadline = killed_at + 60
        while new_decode not in live_decode_pids(up) or httpx.get(f"{up.url}/readyz").status_code != 200:
            assert time.monotonic() < deadline, f"the restarted decode worker never became live:\n{up.output}"
            time.sleep(0.5)
        while (response := completion(up, timeout=30)).status_code != 200:
            assert time.monotonic() < deadline, f"no 200 within 60s of the kill: {response.text}"
            time.sleep(1)
        assert up.process.poll() is None and running(api)  # the platform and its API stayed up
    finally:
        up.process.kill()  # kill -9 of the supervisor: no stop() runs
        up.process.wait()
    # Its children die with it; only the embedded Redis, which daemonised, is left for the next run.
    up.pids = descendants(up.process.pid) | up.pids | started_for(tmp_path)
    deadline = time.monotonic() + 5
    while orphans := {p for p in up.pids | started_for(tmp_path) if running(p)} - {up.redis_pid}:
        assert time.monotonic() < deadline, f"orphans of the killed supervisor: {orphans}"
        time.sleep(0.1)
    following = start_up(tmp_path, wait=False)
    try:
        match = wait_for_line(following, r"embedded Redis: socket \S+ \(pid (\d+)\)", 60)
        following.pids = {up.redis_pid, int(match.group(1))}
        assert (
            f"stopping the embedded Redis (pid {up.redis_pid}) an earlier run left running"
            in following.output
        )
        assert not running(up.redis_pid)
    finally:
        code = stop_up(following, signal.SIGTERM)
    assert code == 0, following.output
    assert_all_stopped(following)


def group_or_other_readable(data_dir: Path) -> list[str]:
    return [
        f"{path} {oct(path.stat().st_mode & 0o777)}"
        for path in [data_dir, *data_dir.rglob("*")]
        if not path.is_symlink() and path.stat().st_mode & 0o077
    ]


def test_up_keeps_the_data_dir_and_its_redirected_output_to_its_owner(tmp_path):
    """Files an earlier run (or an older version) left readable, the output redirected into the data dir, and
    what this run writes (Redis' snapshot, logs): all owner-only. Stopped as soon as its Redis runs."""
    data_dir = tmp_path / "data"
    (data_dir / "logs").mkdir(parents=True)
    for name in ("tessera.db", "logs/api.log"):
        (data_dir / name).touch(mode=0o644)
        (data_dir / name).chmod(0o644)
    (data_dir / "logs").chmod(0o755)
    data_dir.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    command = [
        sys.executable,
        "-m",
        "tessera.cli",
        "up",
        "--port",
        str(free_port()),
        "--data-dir",
        str(data_dir),
    ]
    log = data_dir / "up.log"
    with log.open("w") as out:  # as `tessera up > .tessera/up.log` opens it: the shell's umask, 0644
        os.chmod(log, 0o644)
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while "embedded Redis: socket" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()
    assert "made 6 path(s) readable by their owner only" in log.read_text(), log.read_text()
    assert (data_dir / "redis.rdb").stat().st_size > 0  # written by this run's Redis as it stopped
    assert group_or_other_readable(data_dir) == []


def test_worker_threads_share_the_cores_and_keep_a_users_setting():
    cores = len(os.sched_getaffinity(0))
    assert worker_threads_env({}) == {"OMP_NUM_THREADS": str(max(1, cores // 2))}
    assert worker_threads_env({}, workers=4 * cores) == {"OMP_NUM_THREADS": "1"}
    assert worker_threads_env({"OMP_NUM_THREADS": "3"}) == {}


def test_up_gives_up_saying_why_when_a_worker_keeps_failing_right_after_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    missing = tmp_path / "no-such-model"
    for args in (
        ["db", "upgrade"],
        ["deployments", "create", DEFAULT_MODEL, "--checkpoint", str(missing), "--no-checkpoint-check"],
    ):
        command = [sys.executable, "-m", "tessera.cli", *args, "--data-dir", str(tmp_path)]
        subprocess.run(command, env=env, check=True, capture_output=True, timeout=60)
    up = start_up(tmp_path, wait=False)
    try:
        code = up.process.wait(timeout=READY_TIMEOUT_S)
    finally:
        if up.process.poll() is None:
            stop_up(up, signal.SIGTERM)
    drain(up, 2.0)
    assert code == 1, up.output
    assert re.search(
        r"the (prefill|decode) worker .* failed 5 times in a row within 30s of starting", up.output
    )
    assert str(missing) in up.output  # why, from the worker's log
    assert up.output.count("restarting it in") >= 4 and "stopped." in up.output
    assert not started_for(tmp_path)
