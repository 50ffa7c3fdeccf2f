"""``tessera bench gateway``: what the authenticated gateway path costs over a bare FastAPI endpoint, and
what the quotas add to it.

Two uvicorn servers run on this machine in one run (``gateway_harness``): a bare FastAPI app whose one POST
endpoint returns a fixed body, and the real gateway whose worker is a stand-in that answers at once. The
gateway is driven twice per round: with the key of a tenant without quotas (no quota script runs) and with
the key of a tenant with every limit set (each request runs the admission and settlement scripts). Identical
requests drive the three sides in rounds whose order rotates, so load from other processes hits all alike;
then each step of the gateway's path is timed alone.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from importlib.metadata import version
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from tessera.bench import BenchError
from tessera.bench.console import print_report, progress
from tessera.bench.gateway_harness import Stack, serving
from tessera.bench.stats import format_ratio, format_spread, quantile, spread

if TYPE_CHECKING:  # imported where used, so that `tessera` starts without loading them
    import httpx
    import psutil

SIDES = (
    "bare",
    "gateway",
    "gateway_quotas",
)  # gateway_quotas: the same gateway, a tenant with every limit set
PROMPT = "Say hello in one word."
STEP_SAMPLES = 200  # timings per gateway step in the breakdown (fewer when --requests is smaller)


def run_gateway(requests: int, concurrency: int, rounds: int, redis_url: str | None, as_json: bool) -> None:
    """Start both servers, drive them in alternating rounds, time the gateway's steps, print the report."""
    with progress(2 * rounds) as advance, serving(redis_url) as stack:
        measured = asyncio.run(measure(stack, requests, concurrency, rounds, advance))
    report = {
        "bench": "gateway",
        "date": date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core CPU, Python {sys.version.split()[0]}, "
        f"uvicorn {version('uvicorn')}, httpx {version('httpx')}",
        "settings": {
            "requests": requests,
            "concurrency": concurrency,
            "rounds": rounds,
            "max_tokens": 1,
            "deployment_mode": "colocated",
            "redis": stack.redis_kind,
        },
        **measured,
    }
    print_report(report, as_json, _tables)


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
            "p50_ms": 1e3 * quantile(self.latencies_s, 0.5),
            "p99_ms": 1e3 * quantile(self.latencies_s, 0.99),
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
        raise BenchError(f"{len(failures)} of {requests} requests to {url} failed; the first: {failures[0]}")
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

    payload = {"model": stack.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    body = json.dumps(payload).encode()

    # Every side gets the same bytes and headers but the key; only the gateway checks it.
    def headers(key: str) -> dict[str, str]:
        return {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}

    gateway_url, gateway_pid = f"{stack.gateway_url}/v1/chat/completions", stack.gateway.process.pid
    targets = {
        "bare": (f"{stack.bare_url}/v1/chat/completions", stack.bare.process.pid, headers(stack.key)),
        "gateway": (gateway_url, gateway_pid, headers(stack.key)),
        "gateway_quotas": (gateway_url, gateway_pid, headers(stack.quota_key)),
    }
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # One client per side, so switching sides never closes another's warm connections.
    clients = {side: httpx.AsyncClient(limits=limits, timeout=30) for side in SIDES}
    try:
        for side in ("gateway", "gateway_quotas"):
            url, _, side_headers = targets[side]
            first = await clients[side].post(url, content=body, headers=side_headers)
            if first.status_code != 200 or first.json()["choices"][0]["message"]["content"] != "Hello":
                raise BenchError(
                    f"the gateway did not answer as expected: {first.status_code} {first.text[:300]}"
                )
            if side == "gateway_quotas" and "x-ratelimit-limit-requests" not in first.headers:
                raise BenchError("the quota'd tenant's answer has no x-ratelimit-* headers: no quota ran")
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        for side in SIDES:  # connections, the tokenizer and the key cache warm; allocator steady
            url, pid, side_headers = targets[side]
            await drive(clients[side], url, body, side_headers, max(4 * concurrency, 100), concurrency, pid)
        runs: dict[str, list[Run]] = {side: [] for side in SIDES}
        for r in range(rounds):
            for side in SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]:  # each side leads in turn
                url, pid, side_headers = targets[side]
                runs[side].append(
                    await drive(clients[side], url, body, side_headers, requests, concurrency, pid)
                )
                advance()
    finally:
        for client in clients.values():
            await client.aclose()
    steps = await measure_steps(stack, body, min(STEP_SAMPLES, requests))
    return {"prompt_tokens": prompt_tokens, **summarize(runs), "steps": steps}


def summarize(runs: dict[str, list[Run]]) -> dict:
    """Per side, each metric's median and range over rounds; per round, gateway over (and minus) bare, and
    the gateway with quotas over (and minus) without."""
    summaries = {side: [run.summary() for run in runs[side]] for side in SIDES}
    metrics = list(summaries["bare"][0])
    report = {
        "rounds": summaries,
        "results": {side: {m: spread(s[m] for s in summaries[side]) for m in metrics} for side in SIDES},
    }
    for name, base, other in (("gateway", "bare", "gateway"), ("quotas_on", "gateway", "gateway_quotas")):
        pairs = list(zip(summaries[base], summaries[other], strict=True))
        below = "bare" if base == "bare" else "off"
        report[f"{name}_over_{below}"] = {m: _ratios(pairs, m) for m in metrics}
        report[f"{name}_minus_{below}"] = {
            m: spread(o[m] - b[m] for b, o in pairs) for m in metrics if m != "requests_per_s"
        }
    return report


def _ratios(pairs: list[tuple[dict, dict]], metric: str) -> dict | None:
    """Gateway over bare per round; None when every round's bare figure is 0 (CPU time comes in 10 ms
    ticks, which a short round of the bare server can fall under)."""
    ratios = [g[metric] / b[metric] for b, g in pairs if b[metric] > 0]
    return spread(ratios) if ratios else None


async def measure_steps(stack: Stack, body: bytes, samples: int) -> list[dict]:
    """Each step of the gateway's path timed alone, in this process, on the gateway's own objects.

    Not under load and without the HTTP server, so the steps don't add up to the measured overhead;
    they say which parts are large.
    """
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    from gpu_workers.protocol import (
        STREAM_FIELD,
        TASK_SERVE,
        Event,
        GenerateTask,
        connect_redis,
        send_task,
        stream_key,
        worker_queue,
    )
    from tessera import records, responses, routing, streaming
    from tessera.api.schemas import ChatCompletionRequest
    from tessera.app import create_app
    from tessera.auth import KeyCache, verify_key

    app = create_app(stack.settings)
    gateway, sessions = app.state.gateway, app.state.sessions
    sync = connect_redis(gateway.settings.redis_url)
    scratch_queue = worker_queue(f"{stack.worker_id}-scratch")  # nobody consumes it: deleted below
    request = ChatCompletionRequest.model_validate(json.loads(body))
    prepared = gateway.prepare(request)
    spec = prepared.model.spec
    ttl = gateway.settings.worker_heartbeat_ttl_s
    with sessions() as session:
        caller = verify_key(session, stack.key)
        quota_caller = verify_key(session, stack.quota_key)
    quota_scopes = gateway.quota_lookup.scopes(quota_caller.tenant_id, quota_caller.id)
    quota_tokens = len(prepared.prompt_ids) + prepared.sampling.max_tokens
    quota_ids = iter([f"bench-quota-{secrets.token_hex(6)}" for _ in range(samples + 1)])
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

    async def admit_and_settle() -> None:
        decision, reservation = await gateway.quotas.admit(next(quota_ids), quota_scopes, quota_tokens)
        if not decision.admitted:
            raise BenchError(f"the quota'd tenant was refused ({decision.limit}): GENEROUS_LIMITS too low")
        await gateway.quotas.settle(reservation, quota_tokens)

    result = responses.Result(text="Hello", token_ids=[100], finish_reason="length")
    shape = responses.OpenAIShape("chat", "chatcmpl-bench", spec.name, int(time.time()))

    def record() -> None:
        with sessions() as session:
            records.record_request(
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
            lambda: send_task(gateway.celery, TASK_SERVE, task.to_json(), scratch_queue, expires=60),
        ),
        (
            "quotas: admit + settle, every limit set (two Lua scripts; tenants with quotas only)",
            1,
            True,
            admit_and_settle,
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
                    "us_median": round(1e6 * quantile(times, 0.5), 1),
                    "us_p90": round(1e6 * quantile(times, 0.9), 1),
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


def _tables(report: dict) -> list:
    s = report["settings"]
    table = Table(
        title=f"gateway (quotas off, and on) vs bare FastAPI: chat completion, max_tokens=1, "
        f"{report['prompt_tokens']}-token prompt, concurrency {s['concurrency']}, {s['rounds']} rounds x "
        f"{s['requests']} requests per side"
    )
    for col in [
        "metric (median [min, max] over rounds)",
        "bare FastAPI",
        "gateway",
        "gateway / bare",
        "gateway - bare",
        "gateway, quotas on",
        "quotas on / off",
        "quotas on - off",
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
        quota_minus = report["quotas_on_minus_off"].get(metric)
        table.add_row(
            label,
            format_spread(report["results"]["bare"][metric], fmt),
            format_spread(report["results"]["gateway"][metric], fmt),
            format_ratio(ratio) if (ratio := report["gateway_over_bare"][metric]) else "-",
            "" if minus is None else format_spread(minus, "+" + fmt),
            format_spread(report["results"]["gateway_quotas"][metric], fmt),
            format_ratio(ratio) if (ratio := report["quotas_on_over_off"][metric]) else "-",
            "" if quota_minus is None else format_spread(quota_minus, "+" + fmt),
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
        f"on the request's path (a tenant with quotas): {on_path:.0f} µs per request; redis: {s['redis']}",
    ]
