"""The admin API (``/admin``) against real Redis and SQLite: admin-only access on every route, the tenant → key →
revoke lifecycle reaching inference auth at once, validated and audited deployment changes, cursor pages,
quotas through the shared service layer, and pool status read from worker heartbeats in Redis."""

from __future__ import annotations

import os
import re
import time
import uuid

import pytest
import redis
from fastapi.testclient import TestClient
from tessera import auth, db, deployments, tenancy
from tessera.app import create_app
from tessera.errors import InvalidConfig
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE
from tessera.settings import Settings

from gpu_workers.protocol import WorkerInfo, pool_queue, worker_queue, workers_key

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


class Admin:
    def __init__(self, client: TestClient, sessions, admin_key: str, tenant_key: str, model: str):
        self.client = client
        self.sessions = sessions
        self.admin_key = admin_key
        self.tenant_key = tenant_key
        self.model = model

    def call(self, method: str, path: str, key: str | None = None, **kwargs):
        headers = {"Authorization": f"Bearer {key or self.admin_key}"}
        return self.client.request(method, path, headers=headers, **kwargs)


@pytest.fixture(scope="module")
def admin(tmp_path_factory):
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.ConnectionError:
        pytest.fail(f"the admin API tests need Redis at {REDIS_URL} (set TESSERA_TEST_REDIS_URL)")
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("admin"),
        redis_url=REDIS_URL,
        secret_key="admin-test-secret-" * 4,
        records_stream=f"tessera:test:records:{uuid.uuid4().hex}",
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    model = f"@test/admin-{uuid.uuid4().hex[:8]}"
    with sessions() as session:
        tenancy.create_tenant(session, "ops")
        tenancy.create_tenant(session, "acme")
        _, admin_key = tenancy.create_key(session, "ops", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
        _, tenant_key = tenancy.create_key(session, "acme")
        config = {"name": model, "checkpoint": "/nowhere", "mode": "disaggregated"}
        deployments.create_deployment(session, config, actor="test", check_checkpoint_files=False)
    auth.key_cache.clear()
    with TestClient(create_app(settings)) as client:
        yield Admin(client, sessions, admin_key, tenant_key, model)
    r = redis.Redis.from_url(REDIS_URL)
    for pool in ("prefill", "decode", "serve"):
        r.delete(workers_key(model, pool), pool_queue(model, pool))
    r.delete(settings.records_stream)


def assert_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def admin_operations(app) -> list[tuple[str, str]]:
    """Every (method, path) under /admin in the OpenAPI schema, path parameters filled in."""
    operations = []
    for path, methods in app.openapi()["paths"].items():
        if path.startswith("/admin"):
            concrete = re.sub(r"\{[^}]+\}", "x", path)
            operations += [(method.upper(), concrete) for method in methods]
    return operations


def test_every_admin_route_refuses_tenant_keys_403_and_missing_keys_401(admin):
    operations = admin_operations(admin.client.app)
    assert len(operations) >= 16  # the schema really lists the routes (tenants, keys, quotas, deployments...)
    for method, path in operations:
        body = {} if method in ("POST", "PUT", "PATCH") else None
        refused = admin.call(method, path, key=admin.tenant_key, json=body)
        assert_error(refused, 403, "permission_denied")
        anonymous = admin.client.request(method, path, json=body)
        assert_error(anonymous, 401, "invalid_api_key")


def test_every_admin_route_has_pydantic_models_and_our_error_shape_in_openapi(admin):
    schema = admin.client.app.openapi()
    for path, methods in schema["paths"].items():
        if not path.startswith("/admin"):
            continue
        for method, operation in methods.items():
            responses = operation["responses"]
            success = next(v for k, v in responses.items() if k.startswith("2"))
            assert "$ref" in str(success["content"]["application/json"]["schema"]), (method, path)
            for status in ("401", "403", "422"):
                assert responses[status]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"
                }, (method, path, status)


def test_key_lifecycle_secret_once_then_inference_then_revoked_401_at_once(admin):
    assert admin.call("POST", "/admin/tenants", json={"name": "initech"}).status_code == 201
    assert_error(admin.call("POST", "/admin/tenants", json={"name": "initech"}), 409, "conflict")
    created = admin.call("POST", "/admin/tenants/initech/keys", json={"name": "ci"})
    assert created.status_code == 201, created.text
    key = created.json()
    secret = key["secret"]
    assert secret.startswith(key["prefix"] + "_") and key["scopes"] == ["inference"]

    listed = admin.call("GET", "/admin/tenants/initech/keys").json()
    assert [k["id"] for k in listed["data"]] == [key["id"]]
    assert secret not in str(listed) and "secret" not in listed["data"][0]

    bearer = {"Authorization": f"Bearer {secret}"}
    models = admin.client.get("/v1/models", headers=bearer)
    assert models.status_code == 200 and admin.model in [m["id"] for m in models.json()["data"]]

    revoked = admin.call("DELETE", f"/admin/keys/{key['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert_error(admin.client.get("/v1/models", headers=bearer), 401, "invalid_api_key")


def test_suspended_tenant_keys_are_refused_until_restored(admin):
    admin.call("POST", "/admin/tenants", json={"name": "umbrella"})
    secret = admin.call("POST", "/admin/tenants/umbrella/keys", json={}).json()["secret"]
    bearer = {"Authorization": f"Bearer {secret}"}
    assert admin.client.get("/v1/models", headers=bearer).status_code == 200  # now cached as valid

    suspended = admin.call("PATCH", "/admin/tenants/umbrella", json={"disabled": True})
    assert suspended.status_code == 200 and suspended.json()["disabled"] is True
    assert admin.call("GET", "/admin/tenants/umbrella").json()["disabled"] is True
    assert_error(admin.client.get("/v1/models", headers=bearer), 401)

    admin.call("PATCH", "/admin/tenants/umbrella", json={"disabled": False})
    assert admin.client.get("/v1/models", headers=bearer).status_code == 200


def test_key_expiry_must_be_in_the_future_and_is_reported(admin):
    admin.call("POST", "/admin/tenants", json={"name": "hooli"})
    past = admin.call("POST", "/admin/tenants/hooli/keys", json={"expires_at": "2000-01-01T00:00:00Z"})
    assert "in the past" in assert_error(past, 422, "invalid_config")["message"]
    future = admin.call("POST", "/admin/tenants/hooli/keys", json={"expires_at": "2999-01-01T00:00:00Z"})
    assert future.status_code == 201 and future.json()["expires_at"].startswith("2999-01-01")


def test_unknown_tenant_key_and_deployment_are_404_and_bad_bodies_400(admin):
    assert_error(admin.call("GET", "/admin/tenants/nobody"), 404, "not_found")
    assert_error(admin.call("DELETE", "/admin/keys/zzzzzzzz"), 404, "not_found")
    assert_error(admin.call("GET", "/admin/deployments/@test/none"), 404, "not_found")
    misspelt = admin.call("PATCH", f"/admin/deployments/{admin.model}", json={"page_sise": 32})
    assert "page_sise" in assert_error(misspelt, 400)["message"]
    enum = admin.call("PATCH", f"/admin/deployments/{admin.model}", json={"decode_kv": "fp4"})
    assert "decode_kv" in assert_error(enum, 400)["message"]


@pytest.mark.parametrize("value", [0.0, 1, "true", "no"])
def test_admin_booleans_take_only_true_or_false(admin, value):
    admin.call("POST", "/admin/tenants", json={"name": "initech"})
    tenant = admin.call("PATCH", "/admin/tenants/initech", json={"disabled": value})
    assert "disabled" in assert_error(tenant, 400)["message"]
    assert admin.call("GET", "/admin/tenants/initech").json()["disabled"] is False
    for field in ("enabled", "integrity_check", "prefix_cache"):
        deployment = admin.call("PATCH", f"/admin/deployments/{admin.model}", json={field: value})
        assert field in assert_error(deployment, 400)["message"]


def test_deployment_patch_is_validated_with_reasons_and_audited_with_before_after_and_actor(admin):
    path = f"/admin/deployments/{admin.model}"
    bad = admin.call("PATCH", path, json={"page_size": 24})
    assert "power of two" in assert_error(bad, 422, "invalid_config")["message"]
    limits = admin.call("PATCH", path, json={"max_model_len": 64, "max_tokens_limit": 128})
    assert "max_tokens_limit (128) exceeds max_model_len (64)" in assert_error(limits, 422)["message"]
    assert admin.call("GET", path).json()["page_size"] == 16  # nothing of a refused change was applied

    ok = admin.call("PATCH", path, json={"page_size": 32, "decode_kv": "bf16", "integrity_check": False})
    assert ok.status_code == 200, ok.text
    assert ok.json()["page_size"] == 32 and ok.json()["decode_kv"] == "bf16"

    audit = admin.call("GET", f"{path}/audit").json()["data"]
    newest = audit[0]
    prefix = auth.parse_prefix(admin.admin_key)
    assert newest["actor"] == f"key:{prefix}" and newest["action"] == "update"
    assert newest["changes"] == {
        "page_size": [16, 32],
        "decode_kv": ["int8", "bf16"],
        "integrity_check": [True, False],
    }
    assert audit[-1]["action"] == "create" and len(audit) == 2  # the refused patches left no trace


def test_local_prefill_max_tokens_is_editable_and_never_negative(admin):
    path = f"/admin/deployments/{admin.model}"
    negative = admin.call("PATCH", path, json={"local_prefill_max_tokens": -1})
    assert "local_prefill_max_tokens" in assert_error(negative, 422, "invalid_config")["message"]
    assert admin.call("GET", path).json()["local_prefill_max_tokens"] == 0  # the default: none
    ok = admin.call("PATCH", path, json={"local_prefill_max_tokens": 64})
    assert ok.status_code == 200, ok.text
    assert admin.call("GET", path).json()["local_prefill_max_tokens"] == 64
    newest = admin.call("GET", f"{path}/audit").json()["data"][0]
    assert newest["changes"] == {"local_prefill_max_tokens": [0, 64]}
    admin.call("PATCH", path, json={"local_prefill_max_tokens": 0})


def test_deployment_create_validates_and_checks_the_checkpoint(admin, tmp_path):
    name = f"@test/new-{uuid.uuid4().hex[:6]}"
    missing = admin.call("POST", "/admin/deployments", json={"name": name, "checkpoint": str(tmp_path)})
    assert "no config.json" in assert_error(missing, 422, "invalid_config")["message"]
    bad = admin.call("POST", "/admin/deployments", json={"name": name, "checkpoint": "/x", "page_size": 3})
    assert "power of two" in assert_error(bad, 400)["message"]
    created = admin.call(
        "POST",
        "/admin/deployments?check_checkpoint=false",
        json={"name": name, "checkpoint": "/x", "mode": "colocated", "decode_weights": "int4"},
    )
    assert created.status_code == 201, created.text
    assert created.json()["mode"] == "colocated" and created.json()["decode_weights"] == "int4"
    assert admin.call("GET", f"/admin/deployments/{name}/audit").json()["data"][0]["action"] == "create"


def test_pages_return_every_item_exactly_once(admin):
    names = [f"page-{i:02d}" for i in range(7)]
    for name in names:
        assert admin.call("POST", "/admin/tenants", json={"name": name}).status_code == 201
        admin.call("POST", "/admin/tenants/page-00/keys", json={"name": name})
    with admin.sessions() as session:
        expected_tenants = [t.name for t in tenancy.list_tenants(session)]

    def collect(path: str, field: str) -> list[str]:
        seen, cursor = [], None
        while True:
            params = {"limit": 3} | ({"cursor": cursor} if cursor else {})
            body = admin.call("GET", path, params=params).json()
            assert len(body["data"]) <= 3
            seen += [item[field] for item in body["data"]]
            cursor = body["next_cursor"]
            if cursor is None:
                return seen

    tenants = collect("/admin/tenants", "name")
    assert tenants == expected_tenants and len(set(tenants)) == len(tenants) and set(names) <= set(tenants)
    keys = collect("/admin/tenants/page-00/keys", "name")
    assert sorted(keys) == sorted(names) and len(keys) == 7
    assert admin.model in collect("/admin/deployments", "name")
    assert_error(admin.call("GET", "/admin/tenants", params={"cursor": "garbage!"}), 400, "invalid_request")
    assert_error(admin.call("GET", "/admin/tenants", params={"limit": 0}), 400)


def token_limits(quotas: dict) -> dict:
    """The request and token limits of a quota body (spend budgets are test_budgets.py's)."""
    return {k: quotas[k] for k in ("rpm", "tpm", "concurrency", "daily_tokens", "monthly_tokens")}


def test_quotas_for_tenants_and_key_overrides_share_the_service_layer(admin):
    from tessera import quota_config

    admin.call("POST", "/admin/tenants", json={"name": "quota-co"})
    key = admin.call("POST", "/admin/tenants/quota-co/keys", json={}).json()
    assert token_limits(admin.call("GET", "/admin/tenants/quota-co/quotas").json()) == {
        "rpm": None,
        "tpm": None,
        "concurrency": None,
        "daily_tokens": None,
        "monthly_tokens": None,
    }
    put = admin.call("PUT", "/admin/tenants/quota-co/quotas", json={"rpm": 50, "tpm": 10_000})
    assert put.status_code == 200 and put.json()["rpm"] == 50
    override = admin.call("PUT", f"/admin/keys/{key['id']}/quotas", json={"rpm": 5}).json()
    assert override["override"]["rpm"] == 5 and token_limits(override["effective"]) == {
        "rpm": 5,
        "tpm": 10_000,
        "concurrency": None,
        "daily_tokens": None,
        "monthly_tokens": None,
    }
    with admin.sessions() as session:  # what the CLI and the gateway read
        assert quota_config.get_limits(session, "quota-co").tpm == 10_000
        assert quota_config.get_key_limits(session, key["id"]).rpm == 5
    assert_error(admin.call("PUT", "/admin/tenants/quota-co/quotas", json={"rpm": -1}), 400)
    assert_error(admin.call("GET", "/admin/tenants/nobody/quotas"), 404)


def test_pools_reflect_worker_heartbeats_and_queue_lengths_in_redis(admin):
    r = redis.Redis.from_url(REDIS_URL)
    now = time.time()
    tag = uuid.uuid4().hex[:8]  # worker ids of its own: another run on this Redis has its own queues
    for pool, worker_id, fmt, used, queried, hit, mismatches in (
        ("prefill", f"pf-1-{tag}", "bf16", 10, 100, 40, 0),
        ("decode", f"dc-1-{tag}", "fp8_e4m3", 30, 0, 0, 2),
        ("decode", f"dc-2-{tag}", "fp8_e4m3", 5, 0, 0, 1),
        ("decode", f"dc-dead-{tag}", "fp8_e4m3", 99, 0, 0, 9),  # heartbeat too old: not live, not counted
    ):
        info = WorkerInfo(
            worker_id=worker_id,
            deployment=admin.model,
            pool=pool,
            queue=worker_queue(worker_id),
            host="test",
            pid=1,
            last_seen=now - (3600 if worker_id == f"dc-dead-{tag}" else 0),
            kv_pages_total=100,
            kv_pages_used=used,
            kv_format=fmt,
            integrity_mismatches=mismatches,
            prefix_cache_query_tokens=queried,
            prefix_cache_hit_tokens=hit,
        )
        r.hset(workers_key(admin.model, pool), worker_id, info.to_json())
    r.rpush(pool_queue(admin.model, "decode"), "m1", "m2")
    r.rpush(worker_queue(f"dc-1-{tag}"), "m3")
    try:
        body = admin.call("GET", "/admin/pools").json()
        pools = {p["pool"]: p for p in body["data"] if p["deployment"] == admin.model}
        assert set(pools) == {"prefill", "decode"}  # a disaggregated deployment: no serve pool
        prefill, decode = pools["prefill"], pools["decode"]
        assert prefill["live_workers"] == 1 and prefill["prefix_cache_hit_rate"] == pytest.approx(0.4)
        assert prefill["kv_formats"] == ["bf16"] and prefill["queue_depth"] == 0
        assert decode["live_workers"] == 2 and [w["worker_id"] for w in decode["workers"]] == [
            f"dc-1-{tag}",
            f"dc-2-{tag}",
        ]
        assert decode["kv_pages_used"] == 35 and decode["kv_pages_total"] == 200
        assert decode["integrity_mismatches"] == 3 and decode["prefix_cache_hit_rate"] is None
        assert decode["queue_depth"] == 3 and decode["workers"][0]["queue_depth"] == 1
    finally:
        r.delete(worker_queue(f"dc-1-{tag}"), pool_queue(admin.model, "decode"))
        for pool in ("prefill", "decode"):
            r.delete(workers_key(admin.model, pool))


POSTGRES_URL = os.environ.get("TESSERA_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(params=["sqlite", "postgresql"])
def migrated_sessions(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'tessera.db'}"
        db.upgrade(url)
        yield db.session_factory(db.make_engine(url))
        return
    psycopg = pytest.importorskip("psycopg")
    try:
        server = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        if os.environ.get("TESSERA_REQUIRE_POSTGRES"):
            pytest.fail(f"no PostgreSQL at {db.redact(POSTGRES_URL)}: {exc}")
        pytest.skip(f"no PostgreSQL at {db.redact(POSTGRES_URL)}")
    name = f"tessera_test_{uuid.uuid4().hex[:12]}"
    server.execute(f'CREATE DATABASE "{name}"')
    url = db.normalize_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    db.upgrade(url)
    engine = db.make_engine(url)
    yield db.session_factory(engine)
    engine.dispose()
    server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    server.close()


def test_cursor_pages_break_timestamp_ties_and_survive_inserts_on_both_databases(migrated_sessions):
    from sqlalchemy import update
    from tessera.models import Tenant, utcnow

    with migrated_sessions() as session:
        for i in range(9):
            tenancy.create_tenant(session, f"t{i}")
        session.execute(update(Tenant).values(created_at=utcnow()))  # every row ties on created_at
        session.commit()
        seen, cursor = [], None
        while True:
            page = tenancy.tenants_page(session, cursor=cursor, limit=2)
            seen += [t.name for t in page.items]
            if len(seen) == 4:
                tenancy.create_tenant(session, "late")  # sorts after every tied row: served once, at the end
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert sorted(seen) == sorted([f"t{i}" for i in range(9)] + ["late"]) and len(seen) == 10

        deployments.create_deployment(
            session, {"name": "@t/d", "checkpoint": "/x"}, actor="a", check_checkpoint_files=False
        )
        for size in (32, 64, 128):
            deployments.update_deployment(session, "@t/d", {"page_size": size}, actor="a")
        first = deployments.audit_page(session, "@t/d", limit=3)
        rest = deployments.audit_page(session, "@t/d", cursor=first.next_cursor, limit=3)
        actions = [(e.action, e.changes.get("page_size")) for e in first.items + rest.items]
        assert actions == [
            ("update", [64, 128]),
            ("update", [32, 64]),
            ("update", [16, 32]),
            ("create", [None, 16]),
        ]
        assert rest.next_cursor is None


def test_deployment_numbers_past_their_columns_are_refused_on_both_databases(migrated_sessions):
    with migrated_sessions() as session:
        deployments.create_deployment(
            session, {"name": "@t/big", "checkpoint": "/x"}, actor="a", check_checkpoint_files=False
        )
        for field, value in (
            ("max_num_seqs", 2**31),
            ("max_tokens_limit", 2**31),
            ("local_prefill_max_tokens", 2**31),
            ("kv_budget_bytes", 2**63),
        ):
            with pytest.raises(InvalidConfig, match=field):
                deployments.update_deployment(session, "@t/big", {field: value}, actor="a")
        # The largest values the columns hold are taken (the database is still usable after the refusals).
        big = {"max_num_seqs": 2**31 - 1, "kv_budget_bytes": 2**63 - 1, "local_prefill_max_tokens": 2**31 - 1}
        deployments.update_deployment(session, "@t/big", big, actor="a")
        got = deployments.get_deployment(session, "@t/big")
        assert (got.max_num_seqs, got.kv_budget_bytes, got.local_prefill_max_tokens) == tuple(big.values())
