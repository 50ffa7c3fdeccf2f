"""A deployment's config changed through the admin API while requests stream, on a real ``tessera up`` (real
worker processes, supervisor, API, embedded Redis): the workers drain and reload, no request fails, new
requests run on the new config (``/admin/pools``), and the audit log holds each change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
import redis
from tessera.launcher import DEFAULT_MODEL
from test_launcher import assert_all_stopped, read_line, start_up, stop_up
from worker_deployments import worker_deployment

from gpu_workers.protocol import HEARTBEAT_INTERVAL_S, WorkerInfo, workers_key

RELOAD_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    up = start_up(tmp_path_factory.mktemp("reload"))
    yield up
    assert stop_up(up, signal.SIGTERM) == 0, up.output
    assert_all_stopped(up)


def admin(up, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {up.key}"}
    return httpx.request(method, f"{up.url}/admin{path}", headers=headers, timeout=60, **kwargs)


def pools(up) -> list[dict]:
    response = admin(up, "GET", "/pools")
    assert response.status_code == 200, response.text
    return [p for p in response.json()["data"] if p["deployment"] == DEFAULT_MODEL]


def wait_for_config(up, version: int, decode_kv: str, integrity_check: bool) -> list[dict]:
    """Until both pools' live workers all serve ``version`` (none draining); the pools then."""
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while time.monotonic() < deadline:
        found = pools(up)
        workers = [w for p in found for w in p["workers"]]
        if (
            {p["pool"] for p in found if p["live_workers"]} == {"prefill", "decode"}
            and {w["config_version"] for w in workers} == {version}
            and not any(w["draining"] for w in workers)
        ):
            decode = next(p for p in found if p["pool"] == "decode")
            assert decode["kv_formats"] == [decode_kv]
            assert {w["integrity_check"] for w in workers} == {integrity_check}
            return found
        time.sleep(0.5)
    raise AssertionError(f"workers not on config {version} in {RELOAD_TIMEOUT_S}s: {pools(up)}\n{up.output}")


@dataclass
class Load:
    """Streaming completions sent back to back from a few clients until stopped; every outcome kept."""

    up: object
    clients: int = 3
    outcomes: list[tuple[int, str]] = field(default_factory=list)  # (status, what went wrong or "")
    _stop: threading.Event = field(default_factory=threading.Event)

    def one(self) -> tuple[int, str]:
        body = {"model": DEFAULT_MODEL, "prompt": "def add(a, b):", "max_tokens": 16, "stream": True}
        headers = {"Authorization": f"Bearer {self.up.key}"}
        try:
            with httpx.stream(
                "POST", f"{self.up.url}/v1/completions", headers=headers, json=body, timeout=120
            ) as response:
                text = response.read().decode()
        except httpx.HTTPError as e:
            return 0, f"transport: {e!r}"
        # SSE lines end at \n (or \r): str.splitlines would also split on U+2028, U+0085 and other
        # characters a completion's text may hold unescaped inside a data line.
        events = [line[6:] for line in text.replace("\r\n", "\n").split("\n") if line.startswith("data: ")]
        if response.status_code != 200 or events[-1:] != ["[DONE]"]:
            return response.status_code, text[-500:]
        errors = [e for e in events[:-1] if "error" in json.loads(e)]
        return 200, errors[0] if errors else ""

    def run(self) -> None:
        while not self._stop.is_set():
            self.outcomes.append(self.one())

    def __enter__(self) -> Load:
        self._pool = ThreadPoolExecutor(self.clients)
        self._futures = [self._pool.submit(self.run) for _ in range(self.clients)]
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for future in self._futures:
            future.result()
        self._pool.shutdown()

    def wait_for(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < n:
            assert time.monotonic() < deadline, f"only {len(self.outcomes)} requests ended in {timeout_s}s"
            time.sleep(0.2)


def decode_generated(up) -> dict[str, int]:
    client = redis.Redis(unix_socket_path=up.redis_socket)
    try:
        infos = [WorkerInfo.from_json(v) for v in client.hvals(workers_key(DEFAULT_MODEL, "decode"))]
    finally:
        client.close()
    return {i.worker_id: i.generated_tokens for i in infos if not i.draining}


@pytest.mark.slow
def test_switching_decode_kv_and_integrity_while_requests_stream_fails_no_request(up):
    # `tessera up` made the deployment (version 1) with FP8 decode KV; start from bf16, integrity on. With
    # the CLI, which does not know the embedded Redis: `tessera up` announces what it finds in the database.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    cli = [sys.executable, "-m", "tessera.cli", "deployments", "update", DEFAULT_MODEL, "--decode-kv", "bf16"]
    done = subprocess.run([*cli, "--data-dir", str(up.data_dir)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    wait_for_config(up, version=2, decode_kv="bf16", integrity_check=True)

    with Load(up) as load:
        load.wait_for(3)
        first = admin(up, "PATCH", f"/deployments/{DEFAULT_MODEL}", json={"decode_kv": "fp8_e4m3"})
        assert first.status_code == 200, first.text
        load.wait_for(len(load.outcomes) + 2)  # the second change lands while the first one drains
        second = admin(up, "PATCH", f"/deployments/{DEFAULT_MODEL}", json={"integrity_check": False})
        assert second.status_code == 200, second.text
        wait_for_config(up, version=4, decode_kv="fp8_e4m3", integrity_check=False)
        before = decode_generated(up)
        settled = len(load.outcomes)
        load.wait_for(settled + 6)  # requests sent after every worker serves the new config
    failed = [o for o in load.outcomes if o != (200, "")]
    assert not failed, f"{len(failed)} of {len(load.outcomes)} requests failed: {failed[:3]}\n{up.output}"
    # The new requests ran on the reloaded decode worker: it produced their tokens. Its count reaches Redis
    # with its next heartbeat, which on a fast machine can come after the requests have all finished.
    deadline = time.monotonic() + 3 * HEARTBEAT_INTERVAL_S
    after = decode_generated(up)
    while sum(after.values()) <= sum(before.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        after = decode_generated(up)
    assert after.keys() == before.keys() and sum(after.values()) > sum(before.values())
    # Each worker was replaced by a successor started first; each old one left, its requests finished.
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while (started := up.output.count("to take over from pid")) < 4 or started != up.output.count(
        "it replaced exited"
    ):
        assert time.monotonic() < deadline, f"the old workers were not all replaced:\n{up.output}"
        read_line(up, 0.5)
    assert up.output.count("it replaced exited with code 75") == started, up.output

    audit = admin(up, "GET", f"/deployments/{DEFAULT_MODEL}/audit").json()["data"]
    assert [e["changes"] for e in audit[:3]] == [
        {"integrity_check": [True, False]},
        {"decode_kv": ["bf16", "fp8_e4m3"]},
        {"decode_kv": ["int8", "bf16"]},
    ]
    assert all(e["action"] == "update" for e in audit[:3])
    assert [e["actor"].split(":")[0] for e in audit[:3]] == ["key", "key", "cli"]


REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.mark.slow
def test_without_a_successor_first_a_worker_drains_restarts_at_once_and_its_queue_is_served(
    tmp_path, demo_model_dir
):
    """A worker under a supervisor that only restarts it (as systemd would): it drains, exits 75, is restarted
    at once on the new config, and a request queued for it while it restarted is served by its successor."""
    import io

    from tessera import deployments
    from tessera.supervisor import Supervisor

    from gpu_workers.protocol import (
        TASK_SERVE,
        GenerateTask,
        Sampling,
        config_key,
        make_celery,
        stream_key,
        worker_queue,
    )

    client = redis.Redis.from_url(REDIS_URL)
    name = f"@test/reload-{os.getpid()}-{int(time.time() * 1000) % 10**6}"
    config = {"name": name, "checkpoint": str(demo_model_dir), "mode": "colocated", "max_model_len": 128}
    stack = worker_deployment(
        tmp_path, client, REDIS_URL, {**config, "max_tokens_limit": 32}, "reload-test-secret-" * 3
    )
    sessions, env = stack.sessions, stack.env
    supervisor = Supervisor(io.StringIO(), backoff_s=60)  # only an immediate restart passes in time
    command = [sys.executable, "-m", "tessera.cli", "worker", "--deployment", name, "--pool", "serve"]
    supervisor.spawn("serve worker", [*command, "--threads", "4"], env, tmp_path / "worker.log")

    def workers() -> list[WorkerInfo]:
        return [WorkerInfo.from_json(raw) for raw in client.hvals(workers_key(name, "serve"))]

    def tend_until(done, what: str):
        deadline = time.monotonic() + RELOAD_TIMEOUT_S
        while not (found := done()):
            assert time.monotonic() < deadline, (
                f"{what}: {workers()}\n{(tmp_path / 'worker.log').read_text()}"
            )
            supervisor.tend()
            time.sleep(0.1)
        return found

    try:
        old = tend_until(lambda: next((w for w in workers() if w.config_version == 1), None), "no worker")
        with sessions() as session:
            deployments.update_deployment(
                session, name, {"integrity_check": False}, actor="test", redis=client
            )
        tend_until(lambda: supervisor.children[0].process.pid != old.pid, "not restarted")
        assert "exited to reload its config; restarted it at once" in supervisor.out.getvalue()
        left = next(w for w in workers() if w.worker_id == old.worker_id)
        assert left.draining and left.config_stale  # still routable while its successor starts
        task = GenerateTask(
            request_id=f"reload-{old.worker_id}",
            deployment=name,
            tenant="t",
            prompt_ids=[1, 2, 3, 4],
            sampling=Sampling(max_tokens=4),
            deadline=time.time() + RELOAD_TIMEOUT_S,
        )
        make_celery(REDIS_URL).send_task(TASK_SERVE, args=[task.to_json()], queue=worker_queue(old.worker_id))
        new = tend_until(lambda: next((w for w in workers() if w.config_version == 2), None), "no successor")
        assert new.integrity_check is False and new.pid == supervisor.children[0].process.pid
        final = tend_until(
            lambda: [e for _, e in client.xrange(stream_key(task.request_id)) if b'"final"' in e[b"event"]],
            "the request queued for the old worker was not served",
        )
        assert b'"worker_id":"' + new.worker_id.encode() in final[0][b"event"]
    finally:
        supervisor.stop()
        client.delete(workers_key(name, "serve"), config_key(name))


def test_each_committed_change_is_announced_with_its_audit_count_and_a_no_op_update_announces_again(
    tmp_path, demo_model_dir
):
    from tessera import db, deployments

    from gpu_workers.pools.heartbeat import ConfigWatch
    from gpu_workers.protocol import DeploymentSpec, config_key

    client = redis.Redis.from_url(REDIS_URL)
    database_url = f"sqlite:///{tmp_path / 'tessera.db'}"
    db.upgrade(database_url)
    sessions = db.session_factory(db.make_engine(database_url))
    name = f"@test/announce-{os.getpid()}-{int(time.time() * 1000) % 10**6}"

    def announced() -> tuple[int, DeploymentSpec]:
        version, spec = client.hmget(config_key(name), "version", "spec")
        return int(version), DeploymentSpec.from_json(spec)

    try:
        with sessions() as session:
            config = {"name": name, "checkpoint": str(demo_model_dir)}
            created = deployments.create_deployment(session, config, actor="test", redis=client)
            assert announced() == (1, created.to_spec())
            deployments.update_deployment(session, name, {"decode_kv": "bf16"}, actor="test", redis=client)
            deployments.update_deployment(session, name, {"page_size": 32}, actor="test", redis=client)
            version, spec = announced()
            assert version == len(deployments.deployment_audit(session, name)) == 3
            assert (spec.decode_kv, spec.page_size) == ("bf16", 32)
            client.delete(config_key(name))  # as if the announcement had been lost
            deployments.update_deployment(session, name, {"page_size": 32}, actor="test", redis=client)
            assert announced() == (3, spec)  # nothing changed, nothing audited: announced again
            # A routing-only field (the gateway's): a new version, the same worker spec, so no worker
            # on the old version counts as stale and none restarts.
            watch = ConfigWatch(client, spec)
            deployments.update_deployment(
                session, name, {"local_prefill_max_tokens": 32}, actor="test", redis=client
            )
            assert announced() == (4, spec)
            assert watch.current() and watch.version == 4
            deployments.update_deployment(
                session, name, {"decode_kv": "fp8_e4m3"}, actor="test", redis=client
            )
            assert not watch.current()
    finally:
        client.delete(config_key(name))


@pytest.mark.slow
def test_a_change_reverted_before_the_successor_is_live_leaves_one_worker_on_the_latest_version(
    tmp_path, demo_model_dir
):
    """Under `tessera up`'s launcher (successor first): a change makes the worker stale and the launcher starts
    its successor; the change is reverted before that successor is live, so the old worker's config is the
    announced one again. Once things settle the pool holds exactly one live worker, on the latest version,
    and the launcher supervises that one alone: the old worker still leaves for the successor started for
    it, instead of both serving the same version."""
    import io

    from tessera import db, deployments
    from tessera.launcher import Launcher
    from tessera.settings import Settings

    from gpu_workers.protocol import SUCCESSOR_FIRST_ENV, config_key, connect_redis

    client = redis.Redis.from_url(REDIS_URL)
    name = f"@test/revert-{os.getpid()}-{int(time.time() * 1000) % 10**6}"
    config = {"name": name, "checkpoint": str(demo_model_dir), "mode": "colocated", "max_model_len": 128}
    stack = worker_deployment(
        tmp_path,
        client,
        REDIS_URL,
        {**config, "max_tokens_limit": 32},
        "revert-test-secret-" * 3,
        OMP_NUM_THREADS="1",
        **{SUCCESSOR_FIRST_ENV: "1"},
    )
    sessions, env, database_url = stack.sessions, stack.env, stack.database_url
    out = io.StringIO()
    launcher = Launcher(Settings(data_dir=tmp_path, redis_url=REDIS_URL, database_url=database_url), out)
    launcher.redis = connect_redis(REDIS_URL)
    launcher.database = db.make_engine(database_url)
    (tmp_path / "logs").mkdir()
    slot = "serve worker"
    launcher.worker_pools[slot] = (name, "serve")
    command = [sys.executable, "-m", "tessera.cli", "worker", "--deployment", name, "--pool", "serve"]
    launcher.spawn(slot, [*command, "--threads", "4"], env)

    def workers() -> list[WorkerInfo]:
        return [WorkerInfo.from_json(raw) for raw in client.hvals(workers_key(name, "serve"))]

    def children() -> list[int]:
        return [c.process.pid for c in launcher.supervisor.children if c.name == slot]

    def tend_until(done, what: str):
        deadline = time.monotonic() + RELOAD_TIMEOUT_S
        while not (found := done()):
            logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
            assert time.monotonic() < deadline, (
                f"{what}: workers {workers()}, children {children()}\n{out.getvalue()}\n{logs}"
            )
            launcher.tend()
            time.sleep(0.1)
        return found

    def settled() -> WorkerInfo | None:
        """The one worker of the pool, when it is the one child the launcher supervises and serves the
        latest version, none stale or draining."""
        found = workers()
        if len(found) != 1 or children() != [found[0].pid]:
            return None
        only = found[0]
        return None if only.config_stale or only.draining or only.config_version != 3 else only

    try:
        old = tend_until(lambda: next((w for w in workers() if w.config_version == 1), None), "no worker")
        with sessions() as session:
            deployments.update_deployment(
                session, name, {"integrity_check": False}, actor="test", redis=client
            )
        tend_until(lambda: len(children()) == 2, "no successor started for the stale worker")
        # The successor is starting (importing torch, loading its engine): not in the pool yet.
        assert [w.pid for w in workers()] == [old.pid]
        with sessions() as session:  # reverted: version 3 is version 1's config again
            deployments.update_deployment(
                session, name, {"integrity_check": True}, actor="test", redis=client
            )
        survivor = tend_until(settled, "the pool did not settle on one worker serving version 3")
        assert survivor.pid != old.pid and survivor.integrity_check is True
        assert "it replaced exited with code 75" in out.getvalue()
        # And it stays settled: two more heartbeats of the survivor (each at least an interval after the
        # one before), and it is still alone.
        tend_until(
            lambda: any(
                w.worker_id == survivor.worker_id and w.last_seen > survivor.last_seen + HEARTBEAT_INTERVAL_S
                for w in workers()
            ),
            "the survivor stopped heartbeating",
        )
        again = settled()
        assert again is not None and again.worker_id == survivor.worker_id, (workers(), children())
    finally:
        launcher.supervisor.stop()
        launcher.redis.close()
        launcher.database.dispose()
        client.delete(workers_key(name, "serve"), config_key(name))
