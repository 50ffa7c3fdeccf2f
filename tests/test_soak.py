"""The metering soak: a few hundred streamed and non-streamed requests from several tenants through real API and
worker processes on PostgreSQL, with random client disconnects, one API process (and so its billing consumer)
killed and restarted, and a worker killed and restarted midway. Afterwards the ledger holds exactly one row per
request that ended, its token counts are the usage the clients saw, the rollups and invoices equal it to the
micro-USD, and the Prometheus counters equal it.

Slow (minutes): ``python -m pytest -q tests/test_soak.py``; ``-m "not slow"`` leaves it out.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select
from tessera import db, deployments, tenancy
from tessera.models import SCOPE_ADMIN
from test_db import postgres_admin as postgres_admin
from test_db import postgres_url as postgres_url

import billing
from billing import LedgerEvent
from gpu_workers.protocol import workers_key

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REQUESTS = 240
CONCURRENCY = 12
TENANTS = 4
# Refused before a worker was asked: such a request never ends on a worker and has no usage event.
NOT_STARTED = {"rate_limit_exceeded", "no_live_worker", "queue_full", "queue_unavailable", "out_of_capacity"}
PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\n\n\ndef list_files(path):\n    ",
    # Long and repeated: later requests of a tenant find its pages in the prefix cache (cached price).
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n    def ",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Processes:
    """Real `tessera api` and `tessera worker` processes sharing Redis, PostgreSQL and a metrics folder."""

    env: dict[str, str]
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, *args: str) -> None:
        log = (self.log_dir / f"{name}.log").open("ab")
        cmd = [sys.executable, "-m", "tessera.cli", *args]
        self.procs[name] = subprocess.Popen(cmd, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def api(self, name: str) -> str:
        port = _free_port()
        self.start(name, "api", "--port", str(port))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert self.procs[name].poll() is None, self.log(name)
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, self.log(name)
            time.sleep(0.2)

    def worker(self, name: str, deployment: str, client: redis.Redis) -> None:
        self.start(name, "worker", "--deployment", deployment, "--pool", "serve", "--worker-id", name)
        deadline = time.monotonic() + 180
        while not client.hexists(workers_key(deployment, "serve"), name):
            assert self.procs[name].poll() is None, self.log(name)
            assert time.monotonic() < deadline, self.log(name)
            time.sleep(0.2)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=30)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-4000:]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass
class Seen:
    """What one client saw of one request."""

    request_id: str
    tenant_id: str
    status: int
    ended: bool  # reached a worker: it must have exactly one ledger row
    usage: dict | None = None  # the usage the client was shown (a finished request)
    disconnected: bool = False


async def _one(client: httpx.AsyncClient, rng: random.Random, tenant: tuple[str, str], model: str) -> Seen:
    tenant_id, raw = tenant
    stream = rng.random() < 0.5
    disconnect = stream and rng.random() < 0.3
    body = {
        "model": model,
        "prompt": rng.choice(PROMPTS),
        "max_tokens": rng.randint(3, 12),
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {raw}"}
    if not stream:
        response = await client.post("/v1/completions", headers=headers, json=body)
        rid = response.headers["x-request-id"]
        if response.status_code == 200:
            return Seen(rid, tenant_id, 200, True, response.json()["usage"])
        code = response.json()["error"]["code"]
        return Seen(rid, tenant_id, response.status_code, code not in NOT_STARTED)
    async with client.stream("POST", "/v1/completions", headers=headers, json=body) as response:
        rid = response.headers["x-request-id"]
        if response.status_code != 200:
            code = json.loads(await response.aread())["error"]["code"]
            return Seen(rid, tenant_id, response.status_code, code not in NOT_STARTED)
        usage = None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if disconnect and chunk.get("choices"):
                return Seen(rid, tenant_id, 200, True, disconnected=True)  # hang up mid-stream
            usage = chunk.get("usage") or usage
        return Seen(rid, tenant_id, 200, True, usage)


def _scrape(url: str, key: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_soak_ledger_rollups_invoices_and_meters_agree_with_what_clients_saw(
    postgres_url, demo_model_dir, tmp_path
):
    model = f"@soak/m-{uuid.uuid4().hex[:8]}"
    db.upgrade(postgres_url)
    sessions = db.session_factory(db.make_engine(postgres_url))
    with sessions() as session:
        deployments.create_deployment(
            session,
            {
                "name": model,
                "checkpoint": str(demo_model_dir),
                "mode": "colocated",
                "dtype": "float32",
                "max_num_seqs": 8,
                "max_model_len": 256,
                "max_tokens_limit": 16,
            },
            actor="test",
        )
        tenants = []
        for i in range(TENANTS):
            tenant = tenancy.create_tenant(session, f"soak-{i}-{uuid.uuid4().hex[:6]}")
            _, raw = tenancy.create_key(session, tenant.name)
            tenants.append((tenant.id, raw))
        ops = tenancy.create_tenant(session, f"ops-{uuid.uuid4().hex[:6]}")
        _, admin_key = tenancy.create_key(session, ops.name, scopes=(SCOPE_ADMIN,))
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    env = dict(
        os.environ,
        TESSERA_DATA_DIR=str(tmp_path / "data"),
        TESSERA_DATABASE_URL=postgres_url,
        TESSERA_REDIS_URL=REDIS_URL,
        TESSERA_SECRET_KEY="soak-test-secret-" * 3,
        TESSERA_RECORDS_STREAM=f"tessera:test:soak:{uuid.uuid4().hex}",
        TESSERA_RECORDS_CLAIM_IDLE_S="2",  # a killed consumer's entries are claimed by the other within seconds
        PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
    )
    client_redis = redis.Redis.from_url(REDIS_URL)
    procs = Processes(env, tmp_path)
    rng = random.Random(12)
    seen: list[Seen] = []
    try:
        front = procs.api("api-front")  # every client talks to this one
        procs.api("api-back")  # a second billing consumer (and records writer), killed midway
        procs.worker("worker-a", model, client_redis)
        procs.worker("worker-b", model, client_redis)

        async def soak() -> None:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(REQUESTS):
                queue.put_nowait(i)

            async def client_loop(client: httpx.AsyncClient) -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    if i == REQUESTS // 3:
                        procs.kill("worker-a")
                        procs.kill("api-back")
                    if i == REQUESTS // 2:
                        await asyncio.to_thread(procs.worker, "worker-a2", model, client_redis)
                        await asyncio.to_thread(procs.api, "api-back2")
                    seen.append(await _one(client, rng, rng.choice(tenants), model))

            async with httpx.AsyncClient(base_url=front, timeout=120) as client:
                await asyncio.gather(*(client_loop(client) for _ in range(CONCURRENCY)))

        asyncio.run(soak())

        ended = {s.request_id: s for s in seen if s.ended}
        tenant_ids = [t for t, _ in tenants]
        assert len(seen) == REQUESTS
        assert len(ended) > REQUESTS // 2, Counter((s.status, s.ended) for s in seen)
        assert any(s.disconnected for s in seen) and any(not s.usage for s in ended.values())

        def ledger() -> dict[str, LedgerEvent]:
            with sessions() as session:
                rows = session.scalars(select(LedgerEvent).where(LedgerEvent.tenant_id.in_(tenant_ids)))
                return {r.request_id: r for r in rows}

        deadline = time.monotonic() + 120
        while len(ledger()) < len(ended) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # anything charged twice would show up now
        rows = ledger()
        with sessions() as session:
            count = session.scalar(
                select(func.count()).select_from(LedgerEvent).where(LedgerEvent.tenant_id.in_(tenant_ids))
            )
        assert count == len(rows)  # no duplicates
        print(  # shown with -s: what the soak went through
            f"soak: {len(seen)} requests, {len(ended)} ended, "
            f"{sum(s.disconnected for s in seen)} disconnected, client statuses "
            f"{dict(Counter(s.status for s in seen))}, ledger {dict(Counter(r.status for r in rows.values()))}"
        )
        assert set(rows) == set(ended), (set(rows) ^ set(ended), Counter(r.status for r in rows.values()))
        cached_seen = 0
        for rid, s in ended.items():
            row = rows[rid]
            assert row.tenant_id == s.tenant_id
            if s.usage is None:
                continue
            usage = s.usage
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert (row.cached_input_tokens, row.fresh_input_tokens, row.output_tokens) == (
                cached,
                usage["prompt_tokens"] - cached,
                usage["completion_tokens"],
            ), rid
            assert usage["cost_details"]["micro_usd"] == row.cost, rid
            cached_seen += cached
        assert cached_seen > 0  # the repeated prompt was billed partly at the cached price

        period = f"{datetime.now(timezone.utc):%Y-%m}"
        with sessions() as session:
            for tenant_id in tenant_ids:
                check = billing.reconcile(session, period, tenant_id=tenant_id)
                assert check.ok, check.mismatches
                mine = sum(r.cost for r in rows.values() if r.tenant_id == tenant_id)
                assert check.ledger_cost == check.invoice_total == mine

        samples = _scrape(front, admin_key)
        for tenant_id in tenant_ids:
            mine = [r for r in rows.values() if r.tenant_id == tenant_id]
            for kind, column in (
                ("cached", "cached_input_tokens"),
                ("fresh", "fresh_input_tokens"),
                ("output", "output_tokens"),
            ):
                labels = tuple(sorted({"tenant": tenant_id, "model": model, "kind": kind}.items()))
                assert samples.get(("tessera_tokens_total", labels), 0) == sum(
                    getattr(r, column) for r in mine
                )
            labels = tuple(sorted({"tenant": tenant_id, "model": model}.items()))
            assert samples.get(("tessera_cost_usd_total", labels), 0) == pytest.approx(
                sum(r.cost for r in mine) / 1e6, abs=1e-9
            )
        by_status: dict[str, int] = defaultdict(int)
        for r in rows.values():
            by_status[r.status] += 1
        for status, n in by_status.items():
            labels = tuple(sorted({"model": model, "status": status}.items()))
            assert samples.get(("tessera_requests_total", labels), 0) == n
    finally:
        procs.stop_all()
        client_redis.delete(workers_key(model, "serve"), env["TESSERA_RECORDS_STREAM"])
