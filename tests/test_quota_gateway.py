"""Quotas enforced by the gateway, against real Redis, real SQLite and the real app (workers faked as in
test_gateway.py): exact admission under a race across two API processes, concurrency that never overshoots,
slots and tokens given back on every ending, rate-limit headers on streams, and 503 when Redis is down."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import urlsplit

import httpx
import pytest
import redis
import uvicorn
from api_processes import api_processes, free_port
from fastapi.testclient import TestClient
from tessera import db, deployments, quota_config, quotas, tenancy
from tessera.api.gateway import in_flight_scope
from tessera.app import create_app
from tessera.limits import Limits, Scope
from tessera.quotas import Quotas
from tessera.settings import Settings
from test_gateway import FakePools, reply, silent, stack_worker, wait_for

from gpu_workers.protocol import GenerateTask, cancel_key, worker_queue, workers_key

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RATE_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


@dataclass
class Stack:
    settings: Settings
    sessions: object
    pools: FakePools
    model: str
    base: str  # a real uvicorn server: clients can hang up mid-request
    app: object

    def tenant(self, **limits: int) -> tuple[str, str, str]:
        """A new tenant with ``limits`` and one key: (tenant name, tenant id, raw key)."""
        name = f"q-{uuid.uuid4().hex[:12]}"
        with self.sessions() as session:
            tenant = tenancy.create_tenant(session, name)
            _, raw = tenancy.create_key(session, name)
            quota_config.set_limits(session, name, Limits(**limits))
        return name, tenant.id, raw

    def body(self, max_tokens: int = 4, **extra) -> dict:
        return {"model": self.model, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, **extra}

    def in_flight(self, tenant_id: str) -> int:
        quotas = Quotas(redis.asyncio.Redis.from_url(REDIS_URL))
        return asyncio.run(quotas.in_flight(Scope(quota_config.tenant_scope(tenant_id), Limits())))

    def reserved_tokens(self, tenant_id: str) -> int:
        scope = Scope(quota_config.tenant_scope(tenant_id), Limits())
        return int(self.pools.redis.hget(scope.key("tpm:amounts"), "__total") or 0)

    def worker(self, pool: str) -> str:
        return stack_worker(self.model, pool)

    def live(self) -> None:
        for pool in ("prefill", "decode"):
            self.pools.heartbeat(self.model, pool, self.worker(pool))

    @contextlib.contextmanager
    def heartbeating(self):
        """Workers that stay live however slowly a loaded machine serves the test's requests."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(0.5):
                self.live()

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def auth(raw: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {raw}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, demo_model_dir):
    data = tmp_path_factory.mktemp("quota-gateway")
    settings = Settings(
        data_dir=data,
        redis_url=REDIS_URL,
        secret_key="quota-gateway-test-secret-" * 2,
        records_stream=f"tessera:test:records:{uuid.uuid4().hex}",
        # Hundreds of requests at once on a loaded 2-core machine may wait seconds to be admitted: these
        # tests prove what happens to admitted ones, not the overload refusal (tested on its own).
        admission_wait_s=300.0,
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    model = f"@test/quota-{uuid.uuid4().hex[:8]}"
    with sessions() as session:
        deployments.create_deployment(
            session,
            {"name": model, "checkpoint": str(demo_model_dir), "max_model_len": 128, "max_tokens_limit": 32},
            actor="test",
        )
    client_redis = redis.Redis.from_url(REDIS_URL)
    pools = FakePools(client_redis, reply())
    app = create_app(settings)
    app.state.gateway.celery = pools
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout_s=30)
    stack = Stack(settings, sessions, pools, model, f"http://127.0.0.1:{port}", app)
    yield stack
    server.should_exit = True
    thread.join(timeout=10)
    for pool in ("prefill", "decode"):
        client_redis.delete(workers_key(model, pool))
    client_redis.delete(settings.records_stream)


@pytest.fixture
def gw(stack, monkeypatch):
    stack.live()
    stack.pools.script = reply()
    monkeypatch.setattr(stack.settings, "request_timeout_s", 300.0)
    return stack


async def _post_many(
    base: str, raw: str, bodies: list[dict], path: str = "/v1/completions"
) -> list[httpx.Response]:
    async with httpx.AsyncClient(
        base_url=base, timeout=30, limits=httpx.Limits(max_connections=500)
    ) as client:
        return await asyncio.gather(*(client.post(path, headers=auth(raw), json=b) for b in bodies))


# -- admission --------------------------------------------------------------------------------------------------


def test_admitted_responses_carry_rate_limit_headers_and_settle_to_the_tokens_used(gw):
    _, tenant_id, raw = gw.tenant(rpm=10, tpm=1000)
    response = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body(max_tokens=20))
    assert response.status_code == 200, response.text
    assert response.headers["x-ratelimit-limit-requests"] == "10"
    assert response.headers["x-ratelimit-remaining-requests"] == "9"
    assert response.headers["x-ratelimit-remaining-tokens"] == str(1000 - (4 + 20))  # reserved up front
    assert response.headers["x-ratelimit-reset-requests"].endswith("s")
    # Settled to what the worker reported: 4 prompt + 3 completion tokens, not prompt + max_tokens.
    assert wait_for(lambda: gw.reserved_tokens(tenant_id) == 7)
    assert gw.in_flight(tenant_id) == 0


def test_a_streaming_200_carries_the_rate_limit_headers(gw):
    _, tenant_id, raw = gw.tenant(rpm=10, tpm=1000)
    body = gw.body(stream=True)
    with httpx.stream("POST", f"{gw.base}/v1/completions", headers=auth(raw), json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert all(h in response.headers for h in RATE_HEADERS), dict(response.headers)
        assert response.headers["x-ratelimit-remaining-requests"] == "9"
        assert "data: [DONE]" in response.read().decode()
    assert wait_for(lambda: gw.in_flight(tenant_id) == 0 and gw.reserved_tokens(tenant_id) == 7)


def test_over_the_limit_is_429_with_headers_naming_the_limit_and_its_reset(gw):
    _, _, raw = gw.tenant(rpm=2)
    for _ in range(2):
        assert httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body()).status_code == 200
    response = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
    assert response.status_code == 429
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "2 requests per minute" in error["message"] and "resets in" in error["message"]
    assert int(response.headers["retry-after"]) >= 1
    assert response.headers["x-ratelimit-remaining-requests"] == "0"


def test_an_exhausted_daily_budget_is_429_quota_exceeded(gw):
    _, _, raw = gw.tenant(daily_tokens=30)
    assert (
        httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body(max_tokens=20)).status_code
        == 200
    )
    response = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body(max_tokens=20))
    assert response.status_code == 429 and response.json()["error"]["code"] == "quota_exceeded"
    assert "daily budget of 30 tokens" in response.json()["error"]["message"]


def test_every_attempt_counts_against_rpm_but_an_rpm_refusal_does_not(gw):
    _, tenant_id, raw = gw.tenant(rpm=5, tpm=100)
    # Too many tokens for tpm: refused by tpm after the attempt was counted, so each takes an rpm slot.
    rejected = asyncio.run(
        _post_many(gw.base, raw, [gw.body(max_tokens=32) | {"prompt": list(range(1, 80))}] * 3)
    )
    assert [r.status_code for r in rejected] == [429] * 3
    assert {r.json()["error"]["code"] for r in rejected} == {"rate_limit_exceeded"}
    assert all("tokens per minute" in r.json()["error"]["message"] for r in rejected)
    admitted = asyncio.run(_post_many(gw.base, raw, [gw.body()] * 2))
    assert [r.status_code for r in admitted] == [200] * 2
    # Refused by rpm itself: the window holds exactly the 5 attempts it let through.
    over = asyncio.run(_post_many(gw.base, raw, [gw.body()] * 10))
    assert [r.status_code for r in over] == [429] * 10
    assert all("requests per minute" in r.json()["error"]["message"] for r in over)
    rpm_log = Scope(quota_config.tenant_scope(tenant_id), Limits()).key("rpm")
    assert gw.pools.redis.zcard(rpm_log) == 5


def test_a_prompt_far_over_the_context_is_refused_untokenised_and_counts_against_rpm(gw, monkeypatch):
    from gpu_workers.tokenizer import Tokenizer

    tokenised = []
    for name in ("encode", "encode_chat"):
        original = getattr(Tokenizer, name)

        def spy(self, *args, _original=original, **kwargs):
            tokenised.append(args)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Tokenizer, name, spy)
    _, _, raw = gw.tenant(rpm=3)
    huge = "word " * 20_000  # 100 kB: far over a context of 128 tokens whatever the tokenizer makes of it
    answers = [
        httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body() | {"prompt": huge}),
        httpx.post(
            f"{gw.base}/v1/chat/completions",
            headers=auth(raw),
            json={"model": gw.model, "messages": [{"role": "user", "content": huge}]},
        ),
    ]
    for response in answers:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and "100000 bytes" in error["message"]
    assert tokenised == []
    assert httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body()).status_code == 200
    # The two refusals took their places in the window: the fourth request is over rpm.
    over = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
    assert over.status_code == 429 and "3 requests per minute" in over.json()["error"]["message"]


def test_a_key_override_limits_that_key_alone(gw):
    name, _, raw = gw.tenant(rpm=100)
    with gw.sessions() as session:
        limited, limited_raw = tenancy.create_key(session, name)
        quota_config.set_limits(session, name, Limits(rpm=2), key_prefix=limited.prefix)
    codes = [
        httpx.post(f"{gw.base}/v1/completions", headers=auth(limited_raw), json=gw.body()).status_code
        for _ in range(3)
    ]
    assert codes == [200, 200, 429]
    assert httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body()).status_code == 200


def test_concurrency_4_never_has_5_in_flight_on_the_workers(gw):
    _, tenant_id, raw = gw.tenant(concurrency=4)
    lock = threading.Lock()
    running = {"now": 0, "max": 0}

    def slow(pools: FakePools, task: GenerateTask) -> None:
        with lock:
            running["now"] += 1
            running["max"] = max(running["max"], running["now"])
        time.sleep(0.3)
        with lock:  # before the final event: the gateway releases the slot only after it
            running["now"] -= 1
        reply()(pools, task)

    gw.pools.script = slow
    with gw.heartbeating():
        responses = asyncio.run(_post_many(gw.base, raw, [gw.body()] * 24))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(200) >= 4
    assert {r.json()["error"]["code"] for r in responses if r.status_code == 429} <= {"rate_limit_exceeded"}
    assert 1 <= running["max"] <= 4
    assert wait_for(lambda: gw.in_flight(tenant_id) == 0)


def test_a_tenant_beyond_its_in_flight_bound_is_refused_at_once_with_retry_after(gw, monkeypatch):
    # The bound is tenant_in_flight_batches engine batches: 2 requests of the deployment's max_num_seqs (64).
    monkeypatch.setattr(gw.settings, "tenant_in_flight_batches", 2 / 64)
    monkeypatch.setattr(gw.settings, "request_timeout_s", 20.0)
    gw.pools.script = silent  # admitted requests stay in flight (queued, as far as the gateway can tell)
    _, tenant_id, raw = gw.tenant()
    _, _, other = gw.tenant()
    with contextlib.ExitStack() as held, gw.heartbeating():
        for _ in range(2):
            response = held.enter_context(
                httpx.stream(
                    "POST", f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body(stream=True)
                )
            )
            assert response.status_code == 200
        # Refused while both streams are still held open: it did not wait for a slot.
        refused = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "out_of_capacity"
        assert "2 requests in flight" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        # Refused before its body is read: headers alone get the 429 (the body never comes).
        assert _status_with_no_body(gw.base, raw) == 429
        # Another tenant's requests are not held back by this one's.
        response = held.enter_context(
            httpx.stream("POST", f"{gw.base}/v1/completions", headers=auth(other), json=gw.body(stream=True))
        )
        assert response.status_code == 200
    # The streams ended: their slots are free again.
    leases = Scope(in_flight_scope(gw.model, tenant_id), Limits()).key("leases")
    assert wait_for(lambda: gw.pools.redis.zcard(leases) == 0)
    gw.pools.script = reply()
    with gw.heartbeating():
        assert httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body()).status_code == 200


def test_a_request_not_admitted_within_the_admission_wait_is_refused_overloaded(gw, monkeypatch):
    _, tenant_id, raw = gw.tenant()
    # Every request has waited longer than this by the time it is tokenised: the API counts as overloaded.
    monkeypatch.setattr(gw.settings, "admission_wait_s", 1e-9)
    refused = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "overloaded"
    assert "more than its bound of 1e-09s" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"
    leases = Scope(in_flight_scope(gw.model, tenant_id), Limits()).key("leases")
    assert gw.pools.redis.zcard(leases) == 0  # nothing was admitted or reserved
    monkeypatch.setattr(gw.settings, "admission_wait_s", 10.0)
    with gw.heartbeating():
        assert httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body()).status_code == 200


def _status_with_no_body(base: str, raw: str) -> int:
    """The status answered to a completion request whose headers promise a body that is never sent."""
    host, port = urlsplit(base).hostname, urlsplit(base).port
    with socket.create_connection((host, port), timeout=20) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {raw}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        )
        sock.sendall(head.encode())
        return int(sock.recv(4096).split(b" ", 2)[1])


# -- every ending gives the slot back ----------------------------------------------------------------------------


async def _hang_up_after_first_chunk(base: str, raw: str, body: dict) -> int:
    async with (
        httpx.AsyncClient(base_url=base, timeout=30) as client,
        client.stream("POST", "/v1/completions", headers=auth(raw), json=body) as response,
    ):
        async for _ in response.aiter_lines():
            break
        return response.status_code


async def _give_up_waiting(base: str, raw: str, body: dict) -> str:
    # Only the wait for the answer is short: connecting and sending may be slow on a loaded machine (a
    # 0.5 s write timeout failed a full CI run with 200 requests starting at once on 2 cores).
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(30, read=0.5)) as client:
        try:
            await client.post("/v1/completions", headers=auth(raw), json=body)
        except httpx.ReadTimeout:
            return "gave up"
        return "answered"


def test_after_cancelled_and_timed_out_requests_nothing_is_in_flight(gw, monkeypatch):
    n = 20
    _, tenant_id, raw = gw.tenant(concurrency=3 * n, tpm=100_000)
    monkeypatch.setattr(gw.settings, "request_timeout_s", 0.5)
    gw.pools.script = silent  # the worker never answers: the deadline, or the client, ends each request

    async def campaign():
        async with httpx.AsyncClient(
            base_url=gw.base, timeout=30, limits=httpx.Limits(max_connections=500)
        ) as c:
            timed_out = [c.post("/v1/completions", headers=auth(raw), json=gw.body()) for _ in range(n)]
            return await asyncio.gather(
                asyncio.gather(*timed_out),
                asyncio.gather(
                    *(_hang_up_after_first_chunk(gw.base, raw, gw.body(stream=True)) for _ in range(n))
                ),
                asyncio.gather(*(_give_up_waiting(gw.base, raw, gw.body()) for _ in range(n))),
            )

    assert httpx.get(f"{gw.base}/v1/models", headers=auth(raw)).status_code == 200  # the key is cached
    with gw.heartbeating():
        timed_out, streams, gave_up = asyncio.run(campaign())
    assert [r.status_code for r in timed_out] == [504] * n, {
        r.text for r in timed_out if r.status_code != 504
    }
    assert streams == [200] * n and gave_up == ["gave up"] * n
    # Settled, not expired: the leases would take 30 s to lapse on their own.
    assert wait_for(lambda: gw.in_flight(tenant_id) == 0, timeout_s=5)
    assert wait_for(lambda: gw.reserved_tokens(tenant_id) == 0, timeout_s=5)  # no token was produced
    for rid in [s.task.request_id for s in gw.pools.sent[-n:]]:
        assert gw.pools.redis.exists(cancel_key(rid))


def test_a_failed_enqueue_gives_the_slot_back(gw, monkeypatch):
    _, tenant_id, raw = gw.tenant(concurrency=1)
    for pool in ("prefill", "decode"):
        gw.pools.redis.delete(workers_key(gw.model, pool))
    for _ in range(3):  # no live worker: 503 each time, never 429 for a leaked slot
        response = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
        assert response.status_code == 503 and response.json()["error"]["code"] == "no_live_worker"
    assert gw.in_flight(tenant_id) == 0


# -- fail closed --------------------------------------------------------------------------------------------------


def test_unreachable_redis_is_503_never_unlimited(stack):
    _, _, raw = stack.tenant(rpm=1000)
    dead = f"redis://127.0.0.1:{free_port()}/0"
    settings = stack.settings.model_copy(update={"redis_url": dead})
    with TestClient(create_app(settings)) as client:
        response = client.post("/v1/completions", headers=auth(raw), json=stack.body())
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "quota_unavailable" and "unreachable" in error["message"]
    assert response.headers["retry-after"]


# -- two API processes sharing Redis ----------------------------------------------------------------------------


def _replica_env(stack: Stack, **settings: str) -> dict[str, str]:
    return {
        **os.environ,
        "TESSERA_DATA_DIR": str(stack.settings.data_dir),
        "TESSERA_DATABASE_URL": stack.settings.database_url,
        "TESSERA_REDIS_URL": REDIS_URL,
        "TESSERA_SECRET_KEY": stack.settings.secret_key.get_secret_value(),
        "TESSERA_RECORDS_STREAM": stack.settings.records_stream,
        "TESSERA_ADMISSION_WAIT_S": str(stack.settings.admission_wait_s),
        **{f"TESSERA_{name.upper()}": value for name, value in settings.items()},
    }


@pytest.fixture(scope="module")
def replicas(stack):
    """Two `tessera api` processes sharing the stack's Redis and database (no live workers needed: an
    admitted request that finds none is a 503, which still proves it was admitted)."""
    with api_processes(_replica_env(stack), stack.settings.data_dir) as started:
        yield started.urls


@pytest.fixture(scope="module")
def impatient_replicas(stack, tmp_path_factory):
    """Two more `tessera api` processes whose requests time out after a second (and whose tenants may have
    hundreds in flight: their test is the leases every ending gives back, not load shedding)."""
    logs = tmp_path_factory.mktemp("impatient-replicas")
    env = _replica_env(stack, request_timeout_s="1", tenant_in_flight_batches="100")
    with api_processes(env, logs) as started:
        yield started.urls


@pytest.fixture(scope="module")
def served(stack, demo_model_dir):
    """A colocated deployment whose worker is a real process (the gateway bench's stand-in): it takes each
    task off its Celery queue and answers at once with one token and its usage."""
    model = f"@test/quota-served-{uuid.uuid4().hex[:8]}"
    with stack.sessions() as session:
        config = {
            "name": model,
            "checkpoint": str(demo_model_dir),
            "mode": "colocated",
            "max_tokens_limit": 32,
        }
        deployments.create_deployment(session, config, actor="test", redis=stack.pools.redis)
    worker_id = f"stand-in-{uuid.uuid4().hex[:8]}"
    code = "import sys; from tessera.bench.gateway_harness import stand_in_worker; stand_in_worker(*sys.argv[1:])"
    log = stack.settings.data_dir / "stand-in-worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-c", code, REDIS_URL, model, worker_id], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        assert wait_for(lambda: stack.pools.redis.hexists(workers_key(model, "serve"), worker_id), 60)
        yield model
    finally:
        worker.terminate()
        worker.wait(timeout=20)
        stack.pools.redis.delete(workers_key(model, "serve"), worker_queue(worker_id))


async def _race(urls: list[str], raw: str, body: dict, n: int = 200) -> list[httpx.Response]:
    """``n`` concurrent POSTs of ``body``, alternating between ``urls``."""
    await _warm(urls, raw)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=2 * n)) as client:
        return await asyncio.gather(
            *(
                client.post(f"{urls[i % len(urls)]}/v1/completions", headers=auth(raw), json=body)
                for i in range(n)
            )
        )


async def _warm(urls: list[str], raw: str) -> None:
    """Warm each process (key cache, tokenizer) so that a race is about admission alone. Its own client: a
    connection it leaves idle could be closed by the server just as a race reuses it."""
    async with httpx.AsyncClient(timeout=60) as client:
        for url in urls:
            assert (await client.get(f"{url}/v1/models", headers=auth(raw))).status_code == 200


def _ports(responses: list[httpx.Response]) -> set[int]:
    return {r.request.url.port for r in responses}


@pytest.mark.slow
def test_200_concurrent_requests_across_two_api_processes_admit_exactly_the_rpm(stack, replicas):
    for pool in ("prefill", "decode"):
        stack.pools.redis.delete(workers_key(stack.model, pool))
    _, tenant_id, raw = stack.tenant(rpm=50)

    async def race():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=400)) as client:
            # Warm both processes (key cache, tokenizer) first so the race is about admission alone.
            await asyncio.gather(*(client.get(f"{url}/v1/models", headers=auth(raw)) for url in replicas))
            return await asyncio.gather(
                *(
                    client.post(f"{replicas[i % 2]}/v1/completions", headers=auth(raw), json=stack.body())
                    for i in range(200)
                )
            )

    responses = asyncio.run(race())
    admitted = [r for r in responses if r.status_code != 429]
    rejected = [r for r in responses if r.status_code == 429]
    assert {r.status_code for r in admitted} == {503}  # admitted, then found no live worker
    assert len(admitted) == 50 and len(rejected) == 150
    for r in rejected:
        assert r.headers["x-ratelimit-limit-requests"] == "50"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(r.headers["retry-after"]) >= 1
        assert json.loads(r.text)["error"]["code"] == "rate_limit_exceeded"
    # Both processes did admit some: the limit held across replicas, not per process.
    assert {r.request.url.port for r in admitted} == {int(u.rsplit(":", 1)[1]) for u in replicas}
    assert stack.in_flight(tenant_id) == 0


@pytest.mark.slow
def test_tokens_admitted_across_two_api_processes_never_exceed_the_tpm(stack, replicas, served):
    _, tenant_id, raw = stack.tenant(tpm=400)
    # Each request reserves 4 prompt + 16 tokens at admission and settles to the 5 it used: at most 20
    # at once fit, and at most 80 in the minute; 200 sent at once through two processes.
    body = {"model": served, "prompt": [1, 2, 3, 4], "max_tokens": 16}
    responses = asyncio.run(_race(replicas, raw, body))
    admitted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert len(admitted) + len(rejected) == 200, {r.status_code for r in responses}
    assert {r.json()["error"]["code"] for r in rejected} == {"rate_limit_exceeded"}
    used = sum(r.json()["usage"]["total_tokens"] for r in admitted)
    assert 20 * 5 <= used <= 400  # all that fit while every reservation was held, and never more than tpm
    # Both processes answered half the race: a limit kept per process would have let each admit up to tpm.
    assert _ports(responses) == {int(u.rsplit(":", 1)[1]) for u in replicas}
    assert wait_for(lambda: stack.reserved_tokens(tenant_id) == used)  # the window holds exactly the use
    assert stack.in_flight(tenant_id) == 0


@pytest.mark.slow
def test_concurrent_requests_across_two_api_processes_never_overspend_the_daily_budget(
    stack, replicas, served
):
    _, tenant_id, raw = stack.tenant(daily_tokens=300)
    body = {"model": served, "prompt": [1, 2, 3, 4], "max_tokens": 16}
    responses = asyncio.run(_race(replicas, raw, body))
    admitted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert len(admitted) + len(rejected) == 200, {r.status_code for r in responses}
    assert {r.json()["error"]["code"] for r in rejected} == {"quota_exceeded"}
    used = sum(r.json()["usage"]["total_tokens"] for r in admitted)
    assert 15 * 5 <= used <= 300
    assert _ports(responses) == {int(u.rsplit(":", 1)[1]) for u in replicas}
    scope = Scope(quota_config.tenant_scope(tenant_id), Limits())
    day_key = quotas._period_keys(scope, datetime.now(timezone.utc))[0]
    assert wait_for(lambda: int(stack.pools.redis.get(day_key) or 0) == used)  # settled to the use
    assert stack.in_flight(tenant_id) == 0


@pytest.mark.slow
def test_after_100_cancelled_and_100_timed_out_requests_on_two_api_processes_nothing_is_in_flight(
    stack, impatient_replicas
):
    n = 100
    _, tenant_id, raw = stack.tenant(concurrency=2 * n + 10, tpm=1_000_000)
    urls = impatient_replicas

    async def campaign():
        await _warm(urls, raw)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=4 * n)) as c:
            # The worker never answers: each request ends at its deadline (504), or when its client leaves.
            timed_out = [
                c.post(f"{urls[i % 2]}/v1/completions", headers=auth(raw), json=stack.body())
                for i in range(n)
            ]
            hung_up = [
                _hang_up_after_first_chunk(urls[i % 2], raw, stack.body(stream=True)) for i in range(n // 2)
            ]
            gave_up = [_give_up_waiting(urls[i % 2], raw, stack.body()) for i in range(n // 2)]
            return await asyncio.gather(
                asyncio.gather(*timed_out), asyncio.gather(*hung_up), asyncio.gather(*gave_up)
            )

    unserved = [
        worker_queue(stack.worker(pool)) for pool in ("prefill", "decode")
    ]  # nobody takes their tasks
    stack.pools.redis.delete(*unserved)  # under the deployment's queue bound
    try:
        with stack.heartbeating():
            timed_out, streams, gave_up = asyncio.run(campaign())
    finally:
        stack.pools.redis.delete(*unserved)
    assert [r.status_code for r in timed_out] == [504] * n, {
        r.text for r in timed_out if r.status_code != 504
    }
    assert _ports(timed_out) == {int(u.rsplit(":", 1)[1]) for u in urls}
    assert streams == [200] * (n // 2) and gave_up == ["gave up"] * (n // 2)
    # Settled, not expired: the leases would take 30 s to lapse on their own.
    assert wait_for(lambda: stack.in_flight(tenant_id) == 0, timeout_s=10)
    assert wait_for(lambda: stack.reserved_tokens(tenant_id) == 0, timeout_s=10)  # no token was produced


def test_a_changed_limit_applies_within_the_lookup_ttl_without_a_restart(gw):
    name, _, raw = gw.tenant(rpm=100)
    assert httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body()).status_code == 200
    with gw.sessions() as session:
        quota_config.set_limits(session, name, Limits(rpm=1))
    wait_for(  # every process re-reads the limits once its cached copy is CACHE_TTL_S old
        lambda: httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body()).status_code == 429,
        timeout_s=quota_config.CACHE_TTL_S + 4,
    )
