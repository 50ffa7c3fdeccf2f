"""Monthly spend budgets against the real app, Redis and SQLite (workers stood in for as in test_gateway.py):
the most a request can cost is reserved in the quota script, so a race never overspends; settled to the cost
the ledger records; released when a request fails before producing a token; 429 with the reset date. And
``usage.cost`` on every answer equals the ledger's cost for that request."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import redis
import uvicorn
from sqlalchemy import select
from tessera import db, deployments, quota_config, tenancy
from tessera.cli.quotas import parse_usd
from tessera.limits import Limits, Scope, usd
from tessera.models import SCOPE_ADMIN
from tessera.quotas import Quotas
from tessera.settings import Settings
from test_gateway import FakePools, fail, reply, stack_worker, wait_for

import billing
from billing import LedgerEvent, PriceSpec
from gpu_workers.protocol import workers_key

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
# micro-USD per million tokens: 1 micro-USD per fresh input token, 0.25 per cached one, 2 per output token.
PRICE = PriceSpec(fresh_input=1_000_000, cached_input=250_000, output=2_000_000)
PROMPT = [1, 2, 3, 4]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def auth(raw: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {raw}"}


@dataclass
class Stack:
    settings: Settings
    sessions: object
    pools: FakePools
    model: str
    base: str
    admin_key: str

    def tenant(self, **limits) -> tuple[str, str, str]:
        """A new tenant with ``limits`` and one key: (tenant name, tenant id, raw key)."""
        name = f"b-{uuid.uuid4().hex[:12]}"
        with self.sessions() as session:
            tenant = tenancy.create_tenant(session, name)
            _, raw = tenancy.create_key(session, name)
            quota_config.set_limits(session, name, Limits(**limits))
        return name, tenant.id, raw

    def body(self, max_tokens: int = 8, **extra) -> dict:
        return {"model": self.model, "prompt": PROMPT, "max_tokens": max_tokens, **extra}

    def spent(self, scope_name: str) -> int:
        async def go() -> int:
            async with redis.asyncio.Redis.from_url(REDIS_URL) as client:
                return await Quotas(client).spent(Scope(scope_name, Limits()))

        return asyncio.run(go())

    def ledger(self, tenant_id: str) -> dict[str, LedgerEvent]:
        with self.sessions() as session:
            rows = session.scalars(select(LedgerEvent).where(LedgerEvent.tenant_id == tenant_id))
            return {row.request_id: row for row in rows}

    def ledger_rows(self, tenant_id: str, n: int) -> dict[str, LedgerEvent]:
        """The tenant's ledger once the app's billing consumer has charged ``n`` requests."""
        wait_for(lambda: len(self.ledger(tenant_id)) >= n, timeout_s=30)
        rows = self.ledger(tenant_id)
        assert len(rows) == n
        return rows


@pytest.fixture(scope="module")
def stack(tmp_path_factory, demo_model_dir):
    from tessera.app import create_app

    data = tmp_path_factory.mktemp("budgets")
    settings = Settings(
        data_dir=data,
        redis_url=REDIS_URL,
        secret_key="budgets-test-secret-" * 3,
        records_stream=f"tessera:test:records:{uuid.uuid4().hex}",
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    model = f"@test/budget-{uuid.uuid4().hex[:8]}"
    with sessions() as session:
        deployments.create_deployment(
            session,
            {"name": model, "checkpoint": str(demo_model_dir), "max_model_len": 128, "max_tokens_limit": 32},
            actor="test",
        )
        billing.set_price(session, model, PRICE, effective_from=datetime(2026, 1, 1, tzinfo=timezone.utc))
        tenancy.create_tenant(session, "ops")
        _, admin_key = tenancy.create_key(session, "ops", scopes=(SCOPE_ADMIN,))
    client_redis = redis.Redis.from_url(REDIS_URL)
    pools = FakePools(client_redis, reply())
    app = create_app(settings)
    app.state.gateway.celery = pools
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout_s=30)
    yield Stack(settings, sessions, pools, model, f"http://127.0.0.1:{port}", admin_key)
    server.should_exit = True
    thread.join(timeout=10)
    for pool in ("prefill", "decode"):
        client_redis.delete(workers_key(model, pool))
    client_redis.delete(settings.records_stream)


@pytest.fixture
def gw(stack):
    for pool in ("prefill", "decode"):
        stack.pools.heartbeat(stack.model, pool, stack_worker(stack.model, pool))
    stack.pools.script = reply()
    return stack


def full_output(n: int = 8):
    """A worker that produces every allowed token: the request costs exactly its reservation."""
    return reply(tuple(f"t{i}" for i in range(n)))


async def _post_many(base: str, raw: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(
        base_url=base, timeout=60, limits=httpx.Limits(max_connections=200)
    ) as client:
        return await asyncio.gather(
            *(client.post("/v1/completions", headers=auth(raw), json=b) for b in bodies)
        )


def _next_month(now: datetime) -> datetime:
    return (now.replace(day=1, hour=0, minute=0, second=0, microsecond=0) + timedelta(days=32)).replace(day=1)


# -- the race ---------------------------------------------------------------------------------------------------


def test_100_concurrent_requests_against_a_budget_for_10_admit_10_and_never_overspend(gw):
    # Each request may cost 4 prompt tokens x 1 + 8 output tokens x 2 = 20 micro-USD, and does.
    cap = 10 * 20
    _, tenant_id, raw = gw.tenant(monthly_spend=cap)
    gw.pools.script = full_output()
    responses = asyncio.run(_post_many(gw.base, raw, [gw.body()] * 100))
    codes = [r.status_code for r in responses]
    assert codes.count(200) == 10 and codes.count(429) == 90, codes
    now = datetime.now(timezone.utc)
    reset = _next_month(now)
    for r in responses:
        if r.status_code != 429:
            continue
        error = r.json()["error"]
        assert error["code"] == "spend_budget_exceeded"
        assert "monthly spend budget of $0.0002" in error["message"]
        assert f"resets on {reset:%Y-%m-%d} 00:00 UTC" in error["message"]
        retry = int(r.headers["retry-after"])
        assert abs(retry - (reset - now).total_seconds()) < 120
    rows = gw.ledger_rows(tenant_id, 10)
    assert sum(row.cost for row in rows.values()) == cap  # spend never above the cap, to the micro-USD
    assert gw.spent(quota_config.tenant_scope(tenant_id)) == cap


def test_a_request_that_could_cost_more_than_the_room_left_is_refused_even_if_it_would_cost_less(gw):
    _, tenant_id, raw = gw.tenant(
        monthly_spend=19
    )  # the cheapest possible answer costs 6, the reservation 20
    response = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
    assert response.status_code == 429 and response.json()["error"]["code"] == "spend_budget_exceeded"
    ok = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body(max_tokens=7))  # 4 + 14 = 18
    assert ok.status_code == 200, ok.text


# -- settle and release -----------------------------------------------------------------------------------------


def test_settled_to_the_ledgers_cost_with_cached_tokens_at_the_cached_price(gw):
    _, tenant_id, raw = gw.tenant(monthly_spend=1_000_000)
    gw.pools.script = reply(("a", "b", "c"), cached=2)
    response = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
    assert response.status_code == 200, response.text
    # 2 cached x 0.25 -> 1 (half up), 2 fresh x 1 = 2, 3 output x 2 = 6: 9, where 20 was reserved.
    usage = response.json()["usage"]
    assert usage["cost_details"]["micro_usd"] == 9 and usage["cost"] == pytest.approx(9e-6)
    assert usage["cost_details"]["cached_input_discount"] == pytest.approx(1e-6)  # 2 at 1 = 2, paid 1
    assert wait_for(lambda: gw.spent(quota_config.tenant_scope(tenant_id)) == 9)
    (row,) = gw.ledger_rows(tenant_id, 1).values()
    assert row.cost == 9 and row.cached_input_cost == 1


def test_a_request_failing_before_any_token_gives_its_whole_reservation_back(gw):
    _, tenant_id, raw = gw.tenant(monthly_spend=20)
    gw.pools.script = fail("engine_failed")
    response = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
    assert response.status_code == 500
    assert wait_for(lambda: gw.spent(quota_config.tenant_scope(tenant_id)) == 0)
    gw.pools.script = full_output()
    again = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
    assert again.status_code == 200, again.text  # the whole budget was there again


def test_a_key_budget_limits_that_key_alone(gw):
    name, tenant_id, raw = gw.tenant(monthly_spend=1_000)
    with gw.sessions() as session:
        key, key_raw = tenancy.create_key(session, name)
        quota_config.set_limits(session, name, Limits(monthly_spend=20), key_prefix=key.prefix)
    gw.pools.script = full_output()
    codes = [
        httpx.post(f"{gw.base}/v1/completions", headers=auth(key_raw), json=gw.body()).status_code
        for _ in range(2)
    ]
    assert codes == [200, 429]
    error = httpx.post(f"{gw.base}/v1/completions", headers=auth(key_raw), json=gw.body()).json()["error"]
    assert "for this API key exceeded" in error["message"]
    assert httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body()).status_code == 200
    assert gw.spent(quota_config.key_scope(key.id)) == 20
    assert gw.spent(quota_config.tenant_scope(tenant_id)) == 40


def test_a_spend_counter_lost_with_redis_restarts_from_the_ledger_and_still_refuses(gw):
    _, tenant_id, raw = gw.tenant(monthly_spend=50)
    gw.pools.script = full_output()
    codes = [
        httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body()).status_code
        for _ in range(3)
    ]
    assert codes == [200, 200, 429]
    gw.ledger_rows(tenant_id, 2)  # 40 micro-USD charged
    scope = Scope(quota_config.tenant_scope(tenant_id), Limits())
    month = f"{datetime.now(timezone.utc):%Y-%m}"
    assert gw.pools.redis.delete(scope.key(f"spend:{month}")) == 1  # as a Redis restarted empty
    time.sleep(quota_config.CACHE_TTL_S + 0.2)  # the gateway's lookup reads the ledger again
    response = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
    assert response.status_code == 429 and response.json()["error"]["code"] == "spend_budget_exceeded"
    assert gw.spent(scope.name) == 40


# -- usage.cost equals the ledger ------------------------------------------------------------------------------


def _sse_usage(response: httpx.Response) -> dict:
    events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def test_usage_cost_on_chat_completions_and_streams_equals_the_ledger(gw):
    _, tenant_id, raw = gw.tenant()
    gw.pools.script = reply(("x", "y"), cached=2)
    seen: dict[str, dict] = {}
    plain = httpx.post(
        f"{gw.base}/v1/chat/completions",
        headers=auth(raw),
        json={"model": gw.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    )
    assert plain.status_code == 200, plain.text
    seen[plain.headers["x-request-id"]] = plain.json()["usage"]
    body = gw.body(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{gw.base}/v1/completions", headers=auth(raw), json=body) as streamed:
        assert streamed.status_code == 200
        seen[streamed.headers["x-request-id"]] = _sse_usage(streamed)
    rows = gw.ledger_rows(tenant_id, 2)
    assert set(rows) == set(seen)
    for request_id, usage in seen.items():
        row = rows[request_id]
        assert usage["cost_details"]["micro_usd"] == row.cost
        assert usage["cost"] == pytest.approx(row.cost / 1e6, abs=1e-12)
        assert usage["cost_details"]["cached_input"] == pytest.approx(row.cached_input_cost / 1e6, abs=1e-12)
        assert usage["prompt_tokens_details"]["cached_tokens"] == row.cached_input_tokens == 2


def test_usage_cost_on_the_workers_ai_route_equals_the_ledger(gw):
    name, tenant_id, raw = gw.tenant()
    gw.pools.script = reply(("x", "y", "z"))
    response = httpx.post(
        f"{gw.base}/accounts/{tenant_id}/ai/run/{gw.model}",
        headers=auth(raw),
        json={"prompt": "def f(", "max_tokens": 8},
    )
    assert response.status_code == 200, response.text
    usage = response.json()["result"]["usage"]
    (row,) = gw.ledger_rows(tenant_id, 1).values()
    assert usage["cost_details"]["micro_usd"] == row.cost > 0
    assert usage["cost"] == pytest.approx(row.cost / 1e6, abs=1e-12)


# -- configuration -----------------------------------------------------------------------------------------------


def test_the_admin_api_sets_and_shows_the_spend_budget_in_usd(gw):
    name, tenant_id, _ = gw.tenant()
    path = f"{gw.base}/admin/tenants/{name}/quotas"
    response = httpx.put(path, headers=auth(gw.admin_key), json={"rpm": 60, "monthly_spend_usd": 12.5})
    assert response.status_code == 200, response.text
    assert response.json()["monthly_spend_usd"] == 12.5
    with gw.sessions() as session:
        assert quota_config.get_limits(session, name) == Limits(rpm=60, monthly_spend=12_500_000)
    assert httpx.get(path, headers=auth(gw.admin_key)).json()["monthly_spend_usd"] == 12.5


@pytest.mark.parametrize("value", [-1, 0.0000001, "lots", 1e12])
def test_the_admin_api_refuses_a_bad_spend_budget_saying_why(gw, value):
    name, _, _ = gw.tenant()
    response = httpx.put(
        f"{gw.base}/admin/tenants/{name}/quotas",
        headers=auth(gw.admin_key),
        json={"monthly_spend_usd": value},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "monthly_spend_usd"


def test_usd_amounts_parse_to_micro_usd_and_print_back():
    assert parse_usd("25.50") == 25_500_000
    assert parse_usd("0.000001") == 1
    assert parse_usd("none") is None
    assert usd(25_500_000) == "$25.50" and usd(200) == "$0.0002" and usd(1_234_000_000) == "$1,234.00"
    for bad in ("-1", "0.0000001", "abc", "nan", "inf"):
        with pytest.raises(Exception, match="USD"):
            parse_usd(bad)


def test_the_cli_sets_the_spend_budget_in_usd_and_refuses_more_than_6_decimals(tmp_path, capsys):
    from tessera.cli import main

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    db.upgrade(url)
    assert main(["tenants", "create", "acme", "--database-url", url]) in (0, None)
    capsys.readouterr()
    args = ["quotas", "set", "--tenant", "acme", "--database-url", url, "--json"]
    assert main([*args, "--monthly-spend-usd", "25.50"]) in (0, None)
    assert json.loads(capsys.readouterr().out.splitlines()[0])["monthly_spend_usd"] == 25.5
    with db.session_factory(db.make_engine(url))() as session:
        assert quota_config.get_limits(session, "acme").monthly_spend == 25_500_000
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--monthly-spend-usd", "1.0000001"])
    assert exit_.value.code == 2 and "at most 6 decimals" in capsys.readouterr().err


def test_an_expired_quota_entry_is_read_once_however_many_requests_find_it_expired(tmp_path):
    """Every concurrent request that finds a caller's scopes expired used to read the database itself; now
    one reads and the others take its result. The database is made slow (a sleep on each limits query, in
    SQLAlchemy's own cursor hook), so all eight requests are there while the first read runs."""
    import threading
    import time

    from sqlalchemy import event

    url = f"sqlite:///{tmp_path / 'quotas.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    sessions = db.session_factory(engine)
    with sessions() as session:
        tenancy.create_tenant(session, "acme")
        key, _ = tenancy.create_key(session, "acme")
        tenant_id, key_id = key.tenant_id, key.id
    reads = []

    @event.listens_for(engine, "before_cursor_execute")
    def slow_limits(conn, cursor, statement, *args):
        if "quota_limits" in statement:
            reads.append(statement)
            time.sleep(0.2)

    lookup = quota_config.QuotaLookup(sessions, ttl_s=0.5)  # outlives a read (0.2 s here)
    first = lookup.scopes(tenant_id, key_id)
    assert len(reads) == 1
    time.sleep(0.6)  # expired
    start = threading.Barrier(8)
    results = []

    def request():
        start.wait()
        results.append(lookup.scopes(tenant_id, key_id))

    threads = [threading.Thread(target=request) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 2 and results == [first] * 8
