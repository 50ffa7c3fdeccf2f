"""The audit log of tenant, key and quota changes: written with each change (admin API and CLI alike), never
holding a secret, listed newest first by ``GET /admin/audit`` (filters, cursor pages) and ``tessera audit list``."""

from __future__ import annotations

import json
import uuid

import pytest
from tessera import quota_config, tenancy
from tessera.errors import Conflict, InvalidConfig
from tessera.limits import Limits
from tessera.models import AuditEvent

# test_admin_api's fixtures; `name as name` re-exports them to pytest.
from test_admin_api import admin as admin
from test_admin_api import assert_error
from test_admin_api import migrated_sessions as migrated_sessions
from test_cli_admin import migrated as migrated
from test_cli_admin import tessera as tessera


def events(admin, **params) -> list[dict]:
    response = admin.call("GET", "/admin/audit", params=params)
    assert response.status_code == 200, response.text
    return response.json()["data"]


def test_every_tenant_key_and_quota_change_through_the_api_is_audited_with_actor_before_and_after(admin):
    name = f"audited-{uuid.uuid4().hex[:6]}"
    assert admin.call("POST", "/admin/tenants", json={"name": name}).status_code == 201
    created = admin.call("POST", f"/admin/tenants/{name}/keys", json={"name": "ci"}).json()
    prefix, secret = created["id"], created["secret"]
    expiry = admin.call("PATCH", f"/admin/keys/{prefix}", json={"expires_at": "2999-01-01T00:00:00Z"})
    assert expiry.status_code == 200 and expiry.json()["expires_at"].startswith("2999-01-01")
    assert admin.call("PUT", f"/admin/tenants/{name}/quotas", json={"rpm": 60}).status_code == 200
    assert admin.call("PUT", f"/admin/keys/{prefix}/quotas", json={"tpm": 1000}).status_code == 200
    assert admin.call("PATCH", f"/admin/tenants/{name}", json={"disabled": True}).status_code == 200
    assert admin.call("PATCH", f"/admin/tenants/{name}", json={"disabled": False}).status_code == 200
    assert admin.call("DELETE", f"/admin/keys/{prefix}").status_code == 200
    assert admin.call("DELETE", f"/admin/keys/{prefix}").status_code == 200  # changes nothing: no event

    log = events(admin, tenant=name)
    actor = f"key:{admin.admin_key.split('_')[1]}"
    assert {e["actor"] for e in log} == {actor}
    assert [(e["target_type"], e["action"], e["target"]) for e in reversed(log)] == [
        ("tenant", "create", name),
        ("key", "create", prefix),
        ("key", "expiry", prefix),
        ("quota", "set", f"tenant:{name}"),
        ("quota", "set", f"key:{prefix}"),
        ("tenant", "suspend", name),
        ("tenant", "restore", name),
        ("key", "revoke", prefix),
    ]
    by_action = {(e["target_type"], e["action"]): e for e in log}
    assert by_action[("tenant", "suspend")]["before"] == {"disabled": False}
    assert by_action[("tenant", "suspend")]["after"] == {"disabled": True}
    assert by_action[("key", "create")]["before"] is None
    assert by_action[("key", "create")]["after"]["scopes"] == ["inference"]
    assert by_action[("key", "expiry")]["before"] == {"expires_at": None}
    assert by_action[("key", "expiry")]["after"]["expires_at"].startswith("2999-01-01")
    assert by_action[("key", "revoke")]["before"]["revoked_at"] is None
    assert by_action[("key", "revoke")]["after"]["revoked_at"] is not None
    tenant_quota = next(e for e in log if e["target"] == f"tenant:{name}")
    assert tenant_quota["before"]["rpm"] is None and tenant_quota["after"]["rpm"] == 60
    key_quota = next(e for e in log if e["target"] == f"key:{prefix}")
    assert key_quota["before"] is None and key_quota["after"]["tpm"] == 1000
    # Never a secret, nor the stored hash or salt.
    with admin.sessions() as session:
        key = tenancy.get_key(session, prefix)
        stored = (key.hash, key.salt)
    text = json.dumps(log)
    assert secret not in text and secret.split("_", 2)[2] not in text  # tsk_<prefix>_<random part>
    assert all(part not in text for part in stored)


def test_the_audit_list_filters_by_target_type_and_pages_newest_first(admin):
    name = f"paged-{uuid.uuid4().hex[:6]}"
    admin.call("POST", "/admin/tenants", json={"name": name})
    for rpm in range(1, 6):
        admin.call("PUT", f"/admin/tenants/{name}/quotas", json={"rpm": rpm})
    quota_changes = events(admin, tenant=name, target_type="quota")
    assert [e["after"]["rpm"] for e in quota_changes] == [5, 4, 3, 2, 1]
    seen, cursor = [], None
    while True:
        params = {"tenant": name, "limit": 2, **({"cursor": cursor} if cursor else {})}
        page = admin.call("GET", "/admin/audit", params=params).json()
        seen += [e["id"] for e in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(seen, reverse=True) and len(seen) == len(set(seen)) == 6


def test_bad_audit_filters_are_400_or_404_naming_what_to_fix(admin):
    bad_type = assert_error(admin.call("GET", "/admin/audit", params={"target_type": "planet"}), 400)
    assert "tenant, key, quota" in bad_type["message"] and bad_type["param"] == "target_type"
    assert_error(admin.call("GET", "/admin/audit", params={"cursor": "nonsense"}), 400)
    assert_error(admin.call("GET", "/admin/audit", params={"tenant": "nobody-at-all"}), 404, "not_found")
    assert_error(admin.call("GET", "/admin/audit", key=admin.tenant_key), 403, "permission_denied")


def test_a_refused_change_writes_no_audit_event_and_a_no_op_writes_none(migrated_sessions):
    with migrated_sessions() as session:
        tenancy.create_tenant(session, "solo", actor="test")
        with pytest.raises(Conflict):
            tenancy.create_tenant(session, "solo", actor="test")
        tenancy.set_tenant_disabled(session, "solo", False, actor="test")  # already enabled
        quota_config.set_limits(session, "solo", Limits(), actor="test")  # already unlimited
        key, _ = tenancy.create_key(session, "solo", actor="test")
        with pytest.raises(InvalidConfig):
            tenancy.update_key(session, key.prefix, name="x" * 101, actor="test")
        rows = session.query(AuditEvent).order_by(AuditEvent.id).all()
        assert [(r.target_type, r.action) for r in rows] == [("tenant", "create"), ("key", "create")]
        assert key.name == ""


def test_cli_changes_are_audited_as_the_local_user_and_listed_by_tessera_audit_list(tessera, migrated):
    assert tessera("tenants", "create", "acme").code == 0
    created = tessera("keys", "create", "--tenant", "acme", "--json")
    assert created.code == 0, created.err
    prefix = created.json()["prefix"].removeprefix("tsk_")
    assert tessera("keys", "update", prefix, "--expires-at", "2999-01-01T00:00:00Z").code == 0
    assert tessera("quotas", "set", "--tenant", "acme", "--rpm", "10").code == 0
    assert tessera("tenants", "disable", "acme").code == 0
    assert tessera("keys", "revoke", prefix).code == 0
    listed = tessera("audit", "list", "--tenant", "acme", "--json")
    assert listed.code == 0, listed.err
    rows = [json.loads(line) for line in listed.out.splitlines()]
    assert [(r["target_type"], r["action"]) for r in reversed(rows)] == [
        ("tenant", "create"),
        ("key", "create"),
        ("key", "expiry"),
        ("quota", "set"),
        ("tenant", "suspend"),
        ("key", "revoke"),
    ]
    assert all(r["actor"].startswith("cli") for r in rows)
    assert created.json()["key"] not in listed.out
    only_keys = tessera("audit", "list", "--target-type", "key", "--limit", "2", "--json")
    assert [json.loads(line)["action"] for line in only_keys.out.splitlines()] == ["revoke", "expiry"]
    assert "--cursor" in only_keys.err
    bad = tessera("keys", "update", prefix, "--expires-at", "tomorrow")
    assert bad.code == 2 and "ISO time" in bad.err
    assert tessera("audit", "list", "--limit", "0").code == 2
    assert "no tenant named" in tessera("audit", "list", "--tenant", "nobody").err
