"""Workers-AI async batches (``?queueRequest=true``) against the real app, Redis and SQLite with
test_gateway's scripted worker pools: queue and poll, per-item validation, the size limit, isolation, retries
when a worker dies, quotas checked when an item runs, lower priority than interactive traffic, two runners
sharing one queue, and items surviving a gateway restart. The run with real worker processes, one of them
killed midway, and a client written to Cloudflare's REST docs, are at the end (real worker processes)."""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections import Counter

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from tessera import batch, db, deployments, quota_config, tenancy
from tessera.app import create_app
from tessera.limits import Limits
from tessera.models import BatchItem, RequestRecord
from tessera.settings import Settings
from test_admin_api import migrated_sessions as migrated_sessions
from test_gateway import FakePools, fail, reply, silent, sync_redis, wait_for
from test_gateway import gw as gw
from test_gateway import redis_url as redis_url
from test_gateway import stack as stack

from gpu_workers.protocol import worker_queue, workers_key

PREFIXES = ("", "/client/v4")


@pytest.fixture
def account(gw) -> str:
    with gw.sessions() as session:
        return tenancy.get_tenant(session, "acme").id


def queue(client, account: str, model: str, requests: list, key: str, prefix: str = ""):
    return client.post(
        f"{prefix}/accounts/{account}/ai/run/{model}",
        params={"queueRequest": "true"},
        headers={"Authorization": f"Bearer {key}"},
        json={"requests": requests},
    )


def poll(client, account: str, model: str, request_id: str, key: str, prefix: str = ""):
    return client.post(
        f"{prefix}/accounts/{account}/ai/run/{model}",
        params={"queueRequest": "true"},
        headers={"Authorization": f"Bearer {key}"},
        json={"request_id": request_id},
    )


def queued_id(response) -> str:
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["success"] is True and out["errors"] == []
    assert out["result"]["status"] == "queued"
    return out["result"]["request_id"]


def results(client, account: str, model: str, request_id: str, key: str, timeout_s: float = 30.0) -> dict:
    def done():
        response = poll(client, account, model, request_id, key)
        assert response.status_code == 200, response.text
        result = response.json()["result"]
        return result if "responses" in result else None

    return wait_for(done, timeout_s)


def items_of(sessions, batch_id: str) -> list[BatchItem]:
    with sessions() as session:
        rows = session.query(BatchItem).filter_by(batch_id=batch_id).order_by(BatchItem.index).all()
        session.expunge_all()
        return rows


def passes_later(app, n: int = 3) -> None:
    """Wait until the app's batch runner has looked for work ``n`` more times."""
    runner = app.state.batch_runner
    start = runner.passes
    wait_for(lambda: runner.passes >= start + n, 15)


@pytest.mark.parametrize("prefix", PREFIXES)
def test_a_queued_batch_runs_every_item_and_the_poll_returns_each_result_with_usage(gw, account, prefix):
    gw.pools.script = reply(("Hi", " there"), cached=1)
    requests = [
        {"prompt": "Tell me a joke", "max_tokens": 8, "external_reference": "joke"},
        {"messages": [{"role": "user", "content": "Hello"}], "temperature": 0.5},
        {"prompt": "Another", "seed": 3},
    ]
    batch_id = queued_id(queue(gw.client, account, gw.model, requests, gw.key, prefix))
    result = results(gw.client, account, gw.model, batch_id, gw.key)
    responses = result["responses"]
    assert [r["id"] for r in responses] == [0, 1, 2]
    assert [r["external_reference"] for r in responses] == ["joke", None, None]
    assert all(r["success"] and r["result"]["response"] == "Hi there" for r in responses)
    sent = {s.task.request_id: s.task for s in gw.pools.sent}
    items = items_of(gw.sessions, batch_id)
    assert len({i.request_id for i in items}) == 3 and {i.request_id for i in items} <= set(sent)
    assert sent[items[0].request_id].sampling.max_tokens == 8
    assert sent[items[1].request_id].sampling.temperature == 0.5
    prompt_total = sum(len(sent[i.request_id].prompt_ids) for i in items)
    assert result["usage"] == {
        "prompt_tokens": prompt_total,
        "completion_tokens": 6,
        "total_tokens": prompt_total + 6,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    # Each item is a request of its own: its record (and so its ledger entry) under the submitting tenant.
    for item in items:
        record = wait_for(lambda item=item: _record(gw.sessions, item.request_id), 10)
        assert record.tenant_id == account and record.status == "completed" and record.completion_tokens == 2


def _record(sessions, request_id: str):
    with sessions() as session:
        return session.get(RequestRecord, request_id)


def test_polling_a_batch_still_waiting_says_queued_and_then_running(gw, account):
    started = threading.Event()
    release = threading.Event()

    def slow(pools, task):
        started.set()
        release.wait(20)
        reply()(pools, task)

    queue_name = worker_queue(gw.worker("prefill"))
    gw.pools.redis.rpush(queue_name, "waiting")  # interactive work waiting: the batch holds back
    try:
        batch_id = queued_id(queue(gw.client, account, gw.model, [{"prompt": "a"}, {"prompt": "b"}], gw.key))
        passes_later(gw.client.app)
        assert poll(gw.client, account, gw.model, batch_id, gw.key).json()["result"] == {
            "status": "queued",
            "request_id": batch_id,
            "model": gw.model,
        }
        gw.pools.script = slow
    finally:
        gw.pools.redis.delete(queue_name)
    assert started.wait(15)
    assert poll(gw.client, account, gw.model, batch_id, gw.key).json()["result"]["status"] == "running"
    release.set()
    assert len(results(gw.client, account, gw.model, batch_id, gw.key)["responses"]) == 2


def test_items_are_validated_like_run_bodies_and_every_bad_one_is_named(gw, account):
    requests = [
        {"prompt": "fine"},
        {"prompt": 5},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10_000},
        {"prompt": "word " * 300},
        {"prompt": "also fine", "messages": [{"role": "user", "content": "x"}]},
    ]
    response = queue(gw.client, account, gw.model, requests, gw.key)
    assert response.status_code == 400, response.text
    out = response.json()
    assert out["success"] is False and out["result"] is None
    assert [e["message"].split(":")[0] for e in out["errors"]] == [
        "requests[1]",
        "requests[2]",
        "requests[3]",
        "requests[4]",
    ]
    assert [e["code"] for e in out["errors"]] == [5007, 3006, 3006, 5007]
    assert "max_tokens" in out["errors"][1]["message"]
    assert gw.pools.sent == []


@pytest.mark.parametrize(
    "body, message",
    [
        ({"requests": []}, "requests"),
        ({"requests": "not a list"}, "requests"),
        ({"prompt": "Hi"}, "queueRequest"),
    ],
    ids=["empty", "not-a-list", "a-run-body"],
)
def test_bad_batch_bodies_are_400_with_5007(gw, account, body, message):
    response = gw.client.post(
        f"/accounts/{account}/ai/run/{gw.model}",
        params={"queueRequest": "true"},
        headers=gw.auth(),
        json=body,
    )
    assert response.status_code == 400, response.text
    [error] = response.json()["errors"]
    assert error["code"] == 5007 and message in error["message"]


def test_requests_without_queue_request_are_refused_with_a_hint(gw, account):
    response = gw.client.post(
        f"/accounts/{account}/ai/run/{gw.model}", headers=gw.auth(), json={"requests": [{"prompt": "Hi"}]}
    )
    assert response.status_code == 400
    assert "queueRequest=true" in response.json()["errors"][0]["message"]


def test_a_batch_over_the_size_limit_is_413_in_the_envelope(gw, account, monkeypatch):
    assert Settings().batch_max_body_bytes == 10_000_000  # the default: Workers AI's 10 MB
    monkeypatch.setattr(gw.settings, "batch_max_body_bytes", 2_000)
    big = queue(gw.client, account, gw.model, [{"prompt": "x" * 100}] * 30, gw.key)
    assert big.status_code == 413, big.text
    out = big.json()
    assert out["success"] is False and out["errors"][0]["code"] == 3006
    assert "2000 bytes" in out["errors"][0]["message"]
    small = queued_id(queue(gw.client, account, gw.model, [{"prompt": "x" * 100}] * 3, gw.key))
    assert len(results(gw.client, account, gw.model, small, gw.key)["responses"]) == 3


@pytest.mark.parametrize("prefix", PREFIXES)
def test_a_batch_may_exceed_the_interactive_body_limit_but_a_run_may_not(gw, account, prefix):
    interactive = gw.settings.max_body_bytes
    # Items that fail validation (max_tokens 0), so nothing is queued: what matters is who refused them.
    items = [{"prompt": "x" * 1000, "max_tokens": 0}] * (interactive // 1000 + 100)
    over = queue(gw.client, account, gw.model, items, gw.key, prefix)
    assert over.status_code == 400, over.text[:300]  # the route read it: per-item errors, not a 413
    assert over.json()["errors"][0]["message"].startswith("requests[0]")
    run = gw.client.post(
        f"{prefix}/accounts/{account}/ai/run/{gw.model}",
        headers={"Authorization": f"Bearer {gw.key}"},
        json={"prompt": "x" * (interactive + 1)},
    )
    assert run.status_code == 413
    assert run.json()["success"] is False and run.json()["errors"][0]["code"] == 3006  # Workers AI's envelope


@pytest.mark.parametrize("prefix", PREFIXES)
def test_another_tenant_cannot_poll_a_batch(gw, account, prefix):
    batch_id = queued_id(queue(gw.client, account, gw.model, [{"prompt": "secret"}], gw.key, prefix))
    with gw.sessions() as session:
        other = tenancy.get_tenant(session, "globex").id
    stolen = poll(gw.client, other, gw.model, batch_id, gw.other_key, prefix)
    made_up = poll(gw.client, other, gw.model, "f" * 32, gw.other_key, prefix)
    assert stolen.status_code == made_up.status_code == 404
    assert stolen.json()["errors"][0]["message"].replace(batch_id, "X") == made_up.json()["errors"][0][
        "message"
    ].replace("f" * 32, "X")
    # B's key on A's account is the account 404.
    wrong_account = poll(gw.client, account, gw.model, batch_id, gw.other_key, prefix)
    assert wrong_account.status_code == 404 and wrong_account.json()["errors"][0]["code"] == 7003
    assert results(gw.client, account, gw.model, batch_id, gw.key)["responses"][0]["success"] is True


def test_an_item_whose_worker_died_runs_again_as_a_new_request(gw, account):
    seen: Counter[str] = Counter()

    def flaky(pools, task):
        prompt = tuple(task.prompt_ids)
        seen[prompt] += 1
        (fail("worker_lost", "the worker stopped") if seen[prompt] == 1 else reply())(pools, task)

    gw.pools.script = flaky
    batch_id = queued_id(
        queue(gw.client, account, gw.model, [{"prompt": "once"}, {"prompt": "twice"}], gw.key)
    )
    responses = results(gw.client, account, gw.model, batch_id, gw.key)["responses"]
    assert all(r["success"] for r in responses)
    assert [i.attempts for i in items_of(gw.sessions, batch_id)] == [2, 2]
    request_ids = [s.task.request_id for s in gw.pools.sent]
    assert len(request_ids) == 4 == len(set(request_ids))


def test_an_item_whose_worker_keeps_dying_fails_after_the_bounded_attempts(gw, account):
    gw.pools.script = fail("worker_lost", "the worker stopped")
    batch_id = queued_id(queue(gw.client, account, gw.model, [{"prompt": "doomed"}], gw.key))
    [response] = results(gw.client, account, gw.model, batch_id, gw.key)["responses"]
    assert response["success"] is False and response["result"] is None
    [error] = response["errors"]
    assert error["code"] == 3040 and f"after {gw.settings.batch_max_attempts} attempts" in error["message"]
    assert len(gw.pools.sent) == gw.settings.batch_max_attempts


def test_an_item_failing_for_good_is_not_retried(gw, account):
    gw.pools.script = fail("kv_budget_exceeded", "the prompt does not fit the KV budget")
    batch_id = queued_id(queue(gw.client, account, gw.model, [{"prompt": "big"}, {"prompt": "b"}], gw.key))
    responses = results(gw.client, account, gw.model, batch_id, gw.key)["responses"]
    assert [r["success"] for r in responses] == [False, False]
    assert responses[0]["errors"][0]["code"] == 3006
    assert len(gw.pools.sent) == 2


def test_items_of_a_key_revoked_after_queueing_fail_without_running(gw, account):
    with gw.sessions() as session:
        key, secret = tenancy.create_key(session, "acme")
    queue_name = worker_queue(gw.worker("prefill"))
    gw.pools.redis.rpush(queue_name, "waiting")  # hold the batch back until the key is revoked
    try:
        batch_id = queued_id(queue(gw.client, account, gw.model, [{"prompt": "a"}, {"prompt": "b"}], secret))
        with gw.sessions() as session:
            tenancy.revoke_key(session, key.prefix)
    finally:
        gw.pools.redis.delete(queue_name)

    def failed() -> list[BatchItem] | None:
        items = items_of(gw.sessions, batch_id)
        return items if all(i.status == "failed" for i in items) else None

    items = wait_for(failed, 30)
    assert all(i.error["code"] == "invalid_api_key" and "revoked" in i.error["message"] for i in items)
    assert gw.pools.sent == []


def test_quotas_are_checked_when_an_item_runs_and_a_429_leaves_it_queued(gw, account):
    name = f"batchq-{uuid.uuid4().hex[:8]}"  # a fresh tenant: its quota counters start empty
    with gw.sessions() as session:
        tenant_id = tenancy.create_tenant(session, name).id
        _, key = tenancy.create_key(session, name)
        quota_config.set_limits(session, name, Limits(daily_tokens=1))
    # Queued although the quota would refuse it now: quotas apply when items run, not when queued.
    batch_id = queued_id(queue(gw.client, tenant_id, gw.model, [{"prompt": "a"}, {"prompt": "b"}], key))
    passes_later(gw.client.app, 4)
    assert {i.status for i in items_of(gw.sessions, batch_id)} <= {"queued", "running"}  # never failed
    assert gw.pools.sent == []  # nor sent to a worker
    # Meanwhile another tenant's batch on the same model runs.
    other = queued_id(queue(gw.client, account, gw.model, [{"prompt": "unaffected"}], gw.key))
    assert results(gw.client, account, gw.model, other, gw.key)["responses"][0]["success"] is True
    with gw.sessions() as session:
        quota_config.set_limits(session, name, Limits(daily_tokens=10_000))
    responses = results(gw.client, tenant_id, gw.model, batch_id, key)["responses"]
    assert all(r["success"] for r in responses)
    assert [i.attempts for i in items_of(gw.sessions, batch_id)] == [1, 1]


def test_batch_items_wait_while_interactive_requests_queue_for_the_deployment(gw, account):
    queue_name = worker_queue(gw.worker("prefill"))
    gw.pools.redis.rpush(queue_name, *["waiting"] * gw.settings.batch_max_queue_depth)
    try:
        batch_id = queued_id(queue(gw.client, account, gw.model, [{"prompt": "later"}], gw.key))
        passes_later(gw.client.app)
        assert [i.status for i in items_of(gw.sessions, batch_id)] == ["queued"]
        assert gw.pools.sent == []
        interactive = gw.client.post(
            f"/accounts/{account}/ai/run/{gw.model}", headers=gw.auth(), json={"prompt": "now"}
        )
        assert interactive.status_code == 200  # interactive traffic still runs
    finally:
        gw.pools.redis.delete(queue_name)
    assert results(gw.client, account, gw.model, batch_id, gw.key)["responses"][0]["success"] is True


def test_items_of_a_model_without_live_workers_wait_for_one(gw, account):
    gw.pools.redis.delete(workers_key(gw.model, "prefill"), workers_key(gw.model, "decode"))
    batch_id = queued_id(queue(gw.client, account, gw.model, [{"prompt": "patience"}], gw.key))
    passes_later(gw.client.app)
    assert [(i.status, i.attempts) for i in items_of(gw.sessions, batch_id)] == [("queued", 0)]
    gw.live()
    assert results(gw.client, account, gw.model, batch_id, gw.key)["responses"][0]["success"] is True


def test_two_api_processes_share_the_queue_and_run_each_item_once(gw, account):
    other_pools = FakePools(sync_redis(gw.settings.redis_url), reply())
    second = create_app(gw.settings)
    second.state.gateway.celery = other_pools
    with TestClient(second):
        batch_id = queued_id(
            queue(gw.client, account, gw.model, [{"prompt": f"n{i}"} for i in range(30)], gw.key)
        )
        responses = results(gw.client, account, gw.model, batch_id, gw.key)["responses"]
    assert len(responses) == 30 and all(r["success"] for r in responses)
    sent = [s.task.request_id for s in gw.pools.sent + other_pools.sent]
    assert len(sent) == len(set(sent)) == 30
    assert {i.request_id for i in items_of(gw.sessions, batch_id)} == set(sent)


# -- restarts: an installation of its own, so no other runner takes its items ---------------------------


@pytest.fixture
def lone(tmp_path, demo_model_dir, redis_url):
    settings = Settings(
        data_dir=tmp_path,
        redis_url=redis_url,
        secret_key="batch-test-secret-" * 3,
        records_stream=f"tessera:test:records:{uuid.uuid4().hex}",
        batch_runner_ttl_s=2.0,
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    model = f"@test/batch-{uuid.uuid4().hex[:8]}"
    with sessions() as session:
        config = {
            "name": model,
            "checkpoint": str(demo_model_dir),
            "max_model_len": 128,
            "max_tokens_limit": 32,
        }
        deployments.create_deployment(session, config, actor="test")
        tenant_id = tenancy.create_tenant(session, "acme").id
        _, key = tenancy.create_key(session, "acme")
    pools = FakePools(sync_redis(redis_url), silent)
    stop = threading.Event()

    def heartbeat() -> None:  # live workers for the whole test, however long it takes
        while not stop.is_set():
            for pool in ("prefill", "decode"):
                pools.heartbeat(model, pool, f"{pool}-{model}")
            stop.wait(1.0)

    beating = threading.Thread(target=heartbeat, daemon=True)
    beating.start()
    yield settings, sessions, pools, model, tenant_id, key
    stop.set()
    beating.join()
    pools.redis.delete(workers_key(model, "prefill"), workers_key(model, "decode"), settings.records_stream)


def test_a_gateway_restart_resumes_the_items_it_was_running(lone):
    settings, sessions, pools, model, tenant_id, key = lone
    first = create_app(settings)
    first.state.gateway.celery = pools  # silent: the items run until the gateway stops
    with TestClient(first) as client:
        batch_id = queued_id(queue(client, tenant_id, model, [{"prompt": "a"}, {"prompt": "b"}], key))
        wait_for(lambda: [i.status for i in items_of(sessions, batch_id)] == ["running", "running"], 15)
        assert poll(client, tenant_id, model, batch_id, key).json()["result"]["status"] == "running"
    # Stopped cleanly: back in the queue, the attempts it cut short not counted.
    assert [(i.status, i.attempts) for i in items_of(sessions, batch_id)] == [("queued", 0), ("queued", 0)]
    pools.script = reply(("done",))
    second = create_app(settings)
    second.state.gateway.celery = pools
    with TestClient(second) as client:
        responses = results(client, tenant_id, model, batch_id, key)["responses"]
    assert [r["result"]["response"] for r in responses] == ["done", "done"]


def test_items_of_a_gateway_that_died_are_resumed_by_another(lone):
    settings, sessions, pools, model, tenant_id, key = lone
    with sessions() as session:
        key_id = tenancy.get_key(session, key).id
        batch_id = batch.submit(
            session, tenant_id=tenant_id, key_id=key_id, model=model, items=[({"prompt": "orphan"}, "ref")]
        ).id
        # A runner claims it, then its process dies: no clean stop, and its liveness key never existed.
        [claimed] = batch.claim(session, model, "runner-that-died", 10)
    assert claimed.batch_id == batch_id and items_of(sessions, batch_id)[0].status == "running"
    pools.script = reply(("resumed",))
    app = create_app(settings)
    app.state.gateway.celery = pools
    with TestClient(app) as client:
        [response] = results(client, tenant_id, model, batch_id, key)["responses"]
    assert response["result"]["response"] == "resumed" and response["external_reference"] == "ref"
    assert items_of(sessions, batch_id)[0].attempts == 2  # the dead runner's attempt counts


# -- real worker processes: a Cloudflare-style client, and a decode worker killed midway -----------------


@pytest.fixture(scope="module")
def platform_up(tmp_path_factory, demo_model_dir, redis_url):
    """The gateway on a real uvicorn server with real Celery, and real prefill and decode worker processes
    (test_pools' ``Workers``) for a deployment of the demo model."""
    from test_pools import Workers

    ns = f"test-batchw-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("batch-workers"),
        redis_url=redis_url,
        secret_key="batch-workers-secret-" * 3,
        records_stream=f"tessera:test:records:{ns}",
        worker_heartbeat_ttl_s=4.0,  # notice the killed worker soon
        batch_concurrency=8,
        batch_max_queue_depth=4,
        batch_max_attempts=6,  # attempts routed to the dead worker before its heartbeat lapses count too
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    model = f"@test/{ns}"
    with sessions() as session:
        config = {
            "name": model,
            "checkpoint": str(demo_model_dir),
            "dtype": "float32",
            "prefill_kv": "auto",
            "decode_kv": "fp8_e4m3",
            "kv_budget_bytes": 16 * 2**20,
            "max_num_seqs": 8,
            "max_model_len": 128,
            "max_tokens_limit": 32,
        }
        spec = deployments.create_deployment(session, config, actor="test").to_spec()
        accounts = {}
        for name in ("acme", "globex"):
            tenant_id = tenancy.create_tenant(session, name).id
            accounts[name] = (tenant_id, tenancy.create_key(session, name)[1])
    client = sync_redis(redis_url)
    workers = Workers(client)
    log_dir = tmp_path_factory.mktemp("batch-worker-logs")
    ids = {"prefill": f"{ns}-prefill", "decode": f"{ns}-decode"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    try:
        for pool, worker_id in ids.items():
            workers.start(spec, pool, worker_id, log_dir)
        workers.wait_ready([(spec, pool, worker_id) for pool, worker_id in ids.items()])
        thread.start()
        wait_for(lambda: server.started, 30)
        yield f"http://127.0.0.1:{port}", sessions, workers, spec, ids, accounts, log_dir
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        workers.stop_all()
        for key in client.scan_iter(match=f"*{ns}*", count=1000):
            client.delete(key)


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["/client/v4", ""])
def test_a_client_written_to_cloudflares_rest_docs_runs_prompt_messages_stream_and_a_batch(
    platform_up, prefix
):
    """Plain httpx, written as Cloudflare's REST docs show the API: POST .../ai/run/{model} with a Bearer
    token; ``?queueRequest=true`` with ``{"requests"}`` queues, POST ``{"request_id"}`` polls."""
    base, _, _, spec, _, accounts, _ = platform_up
    account_id, token = accounts["acme"]
    url = f"{base}{prefix}/accounts/{account_id}/ai/run/{spec.name}"
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    with httpx.Client(timeout=60) as http:
        prompt = http.post(url, headers=headers, json={"prompt": "def add(a, b):", "max_tokens": 8}).json()
        assert prompt["success"] is True and isinstance(prompt["result"]["response"], str)
        assert prompt["result"]["usage"]["completion_tokens"] > 0
        chat = {
            "messages": [
                {"role": "system", "content": "You are a friendly assistant"},
                {"role": "user", "content": "Why is pizza so good"},
            ],
            "max_tokens": 8,
        }
        answer = http.post(url, headers=headers, json=chat).json()
        assert answer["success"] is True and answer["result"]["usage"]["total_tokens"] > 0
        events, done = [], False
        with http.stream("POST", url, headers=headers, json={**chat, "stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[len("data: ") :]))
        # Sampled text may be empty (an end token first); the events' shape and the closing usage are not.
        assert done and all(isinstance(e["response"], str) for e in events)
        assert events[-1]["usage"]["completion_tokens"] >= 1
        queued = http.post(
            url + "?queueRequest=true",
            headers=headers,
            json={
                "requests": [
                    {"prompt": "def fib(n):", "max_tokens": 8, "external_reference": "fib"},
                    {"messages": chat["messages"], "max_tokens": 8, "external_reference": "pizza"},
                ]
            },
        ).json()
        assert queued["success"] is True and queued["result"]["status"] == "queued"
        assert queued["result"]["model"] == spec.name
        request_id = queued["result"]["request_id"]

        def retrieved():
            out = http.post(
                url + "?queueRequest=true", headers=headers, json={"request_id": request_id}
            ).json()
            assert out["success"] is True, out
            return out["result"] if "responses" in out["result"] else None

        result = wait_for(retrieved, 60)
        assert [(r["id"], r["external_reference"], r["success"]) for r in result["responses"]] == [
            (0, "fib", True),
            (1, "pizza", True),
        ]
        assert result["usage"]["total_tokens"] == sum(
            r["result"]["usage"]["total_tokens"] for r in result["responses"]
        )
        # Tenant B, with its own key on its own account, cannot retrieve A's batch.
        other_id, other_token = accounts["globex"]
        other_url = f"{base}{prefix}/accounts/{other_id}/ai/run/{spec.name}"
        stolen = http.post(
            other_url, headers={"Authorization": f"Bearer {other_token}"}, json={"request_id": request_id}
        )
        assert stolen.status_code == 404 and stolen.json()["success"] is False


@pytest.mark.slow
def test_fifty_items_all_complete_with_usage_after_the_decode_worker_is_killed_and_restarted(platform_up):
    base, sessions, workers, spec, ids, accounts, log_dir = platform_up
    account_id, token = accounts["acme"]
    url = f"{base}/accounts/{account_id}/ai/run/{spec.name}?queueRequest=true"
    headers = {"Authorization": f"Bearer {token}"}
    requests = [
        {"prompt": f"def task_{i}(x):", "max_tokens": 24, "external_reference": f"r{i}"} for i in range(50)
    ]
    with httpx.Client(timeout=60) as http:
        queued = http.post(url, headers=headers, json={"requests": requests})
        batch_id = queued_id(queued)

        def statuses() -> Counter[str]:
            return Counter(i.status for i in items_of(sessions, batch_id))

        # Midway: some items done, some on the workers right now.
        wait_for(lambda: statuses()["completed"] >= 3 and statuses()["running"] >= 1, 120)
        workers.kill(ids["decode"])
        at_kill = statuses()
        assert at_kill["completed"] < 50
        # With no live decode worker the items wait in the queue (never failing for it).
        wait_for(lambda: statuses()["running"] == 0, 60)
        assert statuses()["failed"] == 0
        restarted = f"{ids['decode']}-restarted"
        workers.start(spec, "decode", restarted, log_dir)
        workers.wait_ready([(spec, "decode", restarted)])

        def retrieved():
            out = http.post(url, headers=headers, json={"request_id": batch_id}).json()
            return out["result"] if "responses" in out["result"] else None

        result = wait_for(retrieved, 240)
    responses = result["responses"]
    assert [r["external_reference"] for r in responses] == [f"r{i}" for i in range(50)]
    assert all(r["success"] for r in responses), [r["errors"] for r in responses if not r["success"]]
    assert all(r["result"]["usage"]["completion_tokens"] > 0 for r in responses)
    items = items_of(sessions, batch_id)
    assert any(i.attempts >= 2 for i in items)  # the kill cut some short: they ran again
    # Every item's last attempt is a request of its own with its usage recorded (the ledger reads the same).
    for item, response in zip(items, responses, strict=True):
        record = wait_for(lambda item=item: _record(sessions, item.request_id), 30)
        assert record.status == "completed" and record.tenant_id == account_id
        assert record.completion_tokens == response["result"]["usage"]["completion_tokens"]
    assert result["usage"]["completion_tokens"] == sum(
        r["result"]["usage"]["completion_tokens"] for r in responses
    )


def test_the_batch_bodies_and_answers_are_in_the_openapi_schema(gw):
    schema = gw.client.get("/openapi.json").json()
    components = set(schema["components"]["schemas"])
    assert {
        "RunRequest",
        "BatchRequest",
        "PollRequest",
        "BatchStatus",
        "BatchResults",
        "BatchResponse",
    } <= components
    for path in ("/accounts/{account_id}/ai/run/{model}", "/client/v4/accounts/{account_id}/ai/run/{model}"):
        operation = schema["paths"][path]["post"]
        assert "queueRequest" in [p["name"] for p in operation["parameters"]]
        body = json.dumps(operation["requestBody"])
        assert all(name in body for name in ("RunRequest", "BatchRequest", "PollRequest"))
        assert "413" in operation["responses"]


def test_concurrent_claims_take_each_item_exactly_once_on_both_databases(migrated_sessions):
    with migrated_sessions() as session:
        tenant_id = tenancy.create_tenant(session, "racer").id
        batch_id = batch.submit(
            session,
            tenant_id=tenant_id,
            key_id=None,
            model="@t/race",
            items=[({"prompt": f"p{i}"}, None) for i in range(60)],
        ).id
    claims: list[list[batch.Claimed]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def runner(n: int) -> None:
        start.wait()
        with migrated_sessions() as session:
            while taken := batch.claim(session, "@t/race", f"runner-{n}", 3):
                claims[n] += taken

    threads = [threading.Thread(target=runner, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    taken = [(c.batch_id, c.index) for runner_claims in claims for c in runner_claims]
    assert sorted(taken) == [(batch_id, i) for i in range(60)]  # all, and none twice
    items = items_of(migrated_sessions, batch_id)
    by_item = {
        (c.batch_id, c.index): f"runner-{n}" for n, runner_claims in enumerate(claims) for c in runner_claims
    }
    assert all(i.status == "running" and i.claimed_by == by_item[(batch_id, i.index)] for i in items)
