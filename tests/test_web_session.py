"""The web UI's server side without a browser: sign-in exchanges a key for a signed, HttpOnly, SameSite=Strict
session cookie kept in Redis; the cookie authenticates the public API like a Bearer key, changes need the CSRF
token; sign-out and revocation end the session; pages carry a CSP without inline script and never the key."""

from __future__ import annotations

import os
import re
import uuid
from datetime import datetime, timezone
from html.parser import HTMLParser
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from tessera import PACKAGE_DATA, auth, db, tenancy
from tessera.api.deps import CSRF_COOKIE, SESSION_COOKIE
from tessera.api.web import SESSION_KEY_PREFIX
from tessera.app import create_app
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE
from tessera.settings import Settings

import billing

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = Path(__file__).resolve().parents[1]


class Site:
    def __init__(self, app, sessions, tenant_key: str, admin_key: str, tenant_id: str, key_id: str):
        self.app = app
        self.sessions = sessions
        self.tenant_key = tenant_key
        self.admin_key = admin_key
        self.tenant_id = tenant_id
        self.key_id = key_id

    def client(self) -> TestClient:
        """A fresh browser-like client (its own cookie jar) on the same app."""
        return TestClient(self.app, base_url="http://127.0.0.1", follow_redirects=False)

    def signed_in(self, key: str) -> tuple[TestClient, str]:
        client = self.client()
        response = sign_in(client, key)
        assert response.status_code == 303, response.text
        return client, client.cookies[CSRF_COOKIE]


def sign_in(client: TestClient, key: str, next_page: str = ""):
    form = client.get("/signin")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text).group(1)
    return client.post("/signin", data={"api_key": key, "csrf_token": token, "next": next_page})


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.ConnectionError:
        pytest.fail(f"the web session tests need Redis at {REDIS_URL} (set TESSERA_TEST_REDIS_URL)")
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("web"),
        redis_url=REDIS_URL,
        secret_key="web-test-secret-" * 4,
        records_stream=f"tessera:test:records:{uuid.uuid4().hex}",
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    with sessions() as session:
        tenant = tenancy.create_tenant(session, "acme")
        tenancy.create_tenant(session, "ops")
        key, tenant_key = tenancy.create_key(session, "acme")
        _, admin_key = tenancy.create_key(session, "ops", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
        tenant_id, key_id = tenant.id, key.id
        billing.record_events(
            session,
            [
                billing.UsageEvent(
                    request_id=f"web-{n}",
                    tenant_id=tenant_id,
                    key_id=key_id,
                    deployment="@tessera/pycode-tiny",
                    model="@tessera/pycode-tiny",
                    status="completed",
                    prompt_tokens=100,
                    cached_tokens=40,
                    output_tokens=10 + n,
                    started_at=datetime(2026, 11, 2 + n, 8, tzinfo=timezone.utc),
                    first_token_at=None,
                    finished_at=datetime(2026, 11, 2 + n, 8, 1, tzinfo=timezone.utc),
                )
                for n in range(3)
            ],
        )
    auth.key_cache.clear()
    app = create_app(settings)
    with TestClient(app):  # runs the lifespan (records writer, billing consumer) for the module
        yield Site(app, sessions, tenant_key, admin_key, tenant_id, key_id)
    redis.Redis.from_url(REDIS_URL).delete(settings.records_stream)


class Scripts(HTMLParser):
    """Every <script> tag's attributes and whether it has a body; every inline handler or style attribute."""

    def __init__(self):
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.inline_attributes: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        names = dict(attrs)
        self.inline_attributes += [n for n in names if n.startswith("on") or n == "style"]
        if tag == "script":
            self.scripts.append({**names, "body": None})
            self._in_script = True

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.scripts[-1]["body"] = data


def test_sign_in_sets_a_signed_httponly_samesite_strict_cookie_and_keeps_the_key_out(site):
    client = site.client()
    response = sign_in(client, site.tenant_key)
    assert response.status_code == 303 and response.headers["location"] == "/dashboard"
    cookies = response.headers.get_list("set-cookie")
    session_cookie = next(c for c in cookies if c.startswith(f"{SESSION_COOKIE}="))
    flags = {part.strip().lower() for part in session_cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= flags
    assert any(f.startswith("max-age=") for f in flags)
    csrf_cookie = next(c for c in cookies if c.startswith(f"{CSRF_COOKIE}="))
    assert "httponly" not in csrf_cookie.lower() and "samesite=strict" in csrf_cookie.lower()
    value = client.cookies[SESSION_COOKIE]
    assert site.tenant_key not in value and site.tenant_key.split("_", 2)[2] not in value
    # Server-side: Redis holds the session under a hash of its id, with an expiry, and never the key.
    # (This session's own entry: other test files' sessions share the prefix on the same Redis.)
    r = redis.Redis.from_url(REDIS_URL)
    store = site.app.state.web_sessions
    name = store._name(store._session_id(value))
    assert name.startswith(SESSION_KEY_PREFIX) and 0 < r.ttl(name) <= 8 * 3600
    stored = r.get(name)
    assert stored and site.tenant_key.encode() not in stored and site.tenant_id.encode() in stored
    page = client.get("/dashboard")
    assert page.status_code == 200 and "Usage of acme" in page.text
    assert site.tenant_key not in page.text and site.tenant_key.split("_", 2)[2] not in page.text


def test_a_bad_key_shows_a_clear_message_and_sets_no_session(site):
    client = site.client()
    for bad in ("tsk_nope", site.tenant_key[:-3] + "xyz", "   "):
        response = sign_in(client, bad)
        assert response.status_code in (400, 401)
        assert "not accepted" in response.text or "Enter your API key" in response.text
        assert 'role="alert"' in response.text
        assert SESSION_COOKIE not in client.cookies
        assert bad.strip() == "" or bad not in response.text  # the page does not echo what was typed


def test_the_sign_in_form_needs_its_token(site):
    client = site.client()
    client.get("/signin")
    response = client.post("/signin", data={"api_key": site.tenant_key, "csrf_token": "forged"})
    assert response.status_code == 403 and "expired" in response.text
    assert SESSION_COOKIE not in client.cookies
    bare = site.client().post("/signin", data={"api_key": site.tenant_key})  # no cookie, no field
    assert bare.status_code == 403


def test_the_cookie_reads_the_usage_api_exactly_like_the_bearer_key(site):
    client, _ = site.signed_in(site.tenant_key)
    params = {"start": "2026-11-01", "end": "2026-11-30", "group_by": "day"}
    by_cookie = client.get("/v1/usage", params=params)
    by_key = site.client().get(
        "/v1/usage", params=params, headers={"Authorization": f"Bearer {site.tenant_key}"}
    )
    assert by_cookie.status_code == 200 and by_cookie.json() == by_key.json()
    assert [row["requests"] for row in by_cookie.json()["data"]] == [1, 1, 1]
    csv_cookie = client.get("/v1/usage", params={**params, "format": "csv"})
    assert (
        csv_cookie.text
        == site.client()
        .get(
            "/v1/usage",
            params={**params, "format": "csv"},
            headers={"Authorization": f"Bearer {site.tenant_key}"},
        )
        .text
    )


def test_changes_with_the_cookie_need_the_csrf_header_matching_session_and_cookie(site):
    client, csrf = site.signed_in(site.admin_key)
    assert client.get("/admin/tenants").status_code == 200  # reads need no token
    refused = client.post("/admin/tenants", json={"name": "no-token"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "csrf_failed"
    wrong = client.post("/admin/tenants", json={"name": "wrong"}, headers={"X-CSRF-Token": "x" * 43})
    assert wrong.status_code == 403
    # A token from another session is not this session's token, even with a matching cookie.
    other, other_csrf = site.signed_in(site.admin_key)
    client.cookies.set(CSRF_COOKIE, other_csrf)
    crossed = client.post("/admin/tenants", json={"name": "crossed"}, headers={"X-CSRF-Token": other_csrf})
    assert crossed.status_code == 403
    client.cookies.set(CSRF_COOKIE, csrf)
    made = client.post("/admin/tenants", json={"name": "with-token"}, headers={"X-CSRF-Token": csrf})
    assert made.status_code == 201, made.text
    names = {t["name"] for t in client.get("/admin/tenants").json()["data"]}
    assert "with-token" in names and not names & {"no-token", "wrong", "crossed"}


def test_a_forged_or_tampered_cookie_is_401(site):
    client, _ = site.signed_in(site.tenant_key)
    value = client.cookies[SESSION_COOKIE]
    for forged in (value[:-2] + ("AA" if not value.endswith("AA") else "BB"), "garbage", ""):
        c = site.client()
        c.cookies.set(SESSION_COOKIE, forged)
        response = c.get("/v1/usage")
        assert response.status_code == 401, forged
        assert c.get("/dashboard").headers["location"] == "/signin?next=/dashboard"


def test_sign_out_ends_the_session_on_the_server(site):
    client, csrf = site.signed_in(site.tenant_key)
    stolen = client.cookies[SESSION_COOKIE]
    assert client.post("/signout", data={"csrf_token": "wrong"}).status_code == 403
    response = client.post("/signout", data={"csrf_token": csrf})
    assert response.status_code == 303 and response.headers["location"] == "/signin"
    cleared = response.headers.get_list("set-cookie")
    assert any(c.startswith(f'{SESSION_COOKIE}=""') and "max-age=0" in c.lower() for c in cleared)
    replay = site.client()
    replay.cookies.set(SESSION_COOKIE, stolen)
    assert replay.get("/v1/usage").status_code == 401  # the copied cookie is dead too
    assert replay.get("/dashboard").status_code == 303


def test_revoking_the_key_ends_its_sessions_at_once(site):
    with site.sessions() as session:
        key, raw = tenancy.create_key(session, "acme")
    client, _ = site.signed_in(raw)
    assert client.get("/v1/usage").status_code == 200
    admin, csrf = site.signed_in(site.admin_key)
    assert admin.delete(f"/admin/keys/{key.prefix}", headers={"X-CSRF-Token": csrf}).status_code == 200
    assert client.get("/v1/usage").status_code == 401
    assert client.get("/dashboard").status_code == 303


def test_a_tenant_key_gets_a_403_page_on_admin_and_no_admin_api(site):
    client, _ = site.signed_in(site.tenant_key)
    page = client.get("/admin")
    assert page.status_code == 403 and "Admin keys only" in page.text and "admin" in page.text
    assert client.get("/admin/tenants").status_code == 403
    anonymous = site.client().get("/admin")
    assert anonymous.status_code == 303 and anonymous.headers["location"] == "/signin?next=/admin"


def test_next_only_goes_to_our_own_pages(site):
    client = site.client()
    assert sign_in(client, site.admin_key, next_page="/admin").headers["location"] == "/admin"
    assert sign_in(site.client(), site.admin_key, "https://evil.example/").headers["location"] == "/dashboard"


def test_every_page_has_a_strict_csp_and_no_inline_script_or_style(site):
    admin, _ = site.signed_in(site.admin_key)
    tenant, _ = site.signed_in(site.tenant_key)
    pages = [
        site.client().get("/signin"),
        admin.get("/admin"),
        admin.get("/dashboard"),
        tenant.get("/dashboard"),
        tenant.get("/admin"),
    ]
    for page in pages:
        csp = page.headers["content-security-policy"]
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"
        parser = Scripts()
        parser.feed(page.text)
        assert parser.inline_attributes == [], page.url
        for script in parser.scripts:
            # A script is a file of ours, or a JSON data block the browser never runs.
            assert (script.get("src") or "").startswith("/static/") or script.get(
                "type"
            ) == "application/json"
            if script.get("src"):
                assert script["body"] is None
        for raw in (site.admin_key, site.tenant_key):
            assert raw not in page.text


def test_static_files_and_the_vendored_libraries_with_their_licences_are_served(site):
    client = site.client()
    for path in (
        "/static/js/api.js",
        "/static/js/dashboard.js",
        "/static/js/admin.js",
        "/static/css/app.css",
    ):
        assert client.get(path).status_code == 200, path
    chart = client.get("/static/vendor/chart.js/chart.umd.min.js")
    assert chart.status_code == 200 and "Chart.js v4" in chart.text[:200]
    for licence in ("chart.js/LICENSE.md", "axe-core/LICENSE"):
        assert (ROOT / "web/static/vendor" / licence).stat().st_size > 500
    # Served from the package data (tessera/_web), which is the checkout's web/ folder.
    assert (PACKAGE_DATA / "_web").resolve() == (ROOT / "web").resolve()


def test_the_sign_in_form_is_in_the_openapi_schema_and_pages_are_not(site):
    paths = site.app.openapi()["paths"]
    form = paths["/signin"]["post"]["requestBody"]["content"]["application/x-www-form-urlencoded"]["schema"]
    assert "$ref" in str(form) or "api_key" in str(form)
    assert "/dashboard" not in paths and "/admin" not in paths


def test_signing_in_again_ends_the_previous_session(site):
    client, _ = site.signed_in(site.tenant_key)
    first = client.cookies[SESSION_COOKIE]
    assert sign_in(client, site.tenant_key).status_code == 303
    assert client.cookies[SESSION_COOKIE] != first
    old = site.client()
    old.cookies.set(SESSION_COOKIE, first)
    assert old.get("/v1/usage").status_code == 401
    assert client.get("/v1/usage").status_code == 200


def test_an_unreachable_session_store_is_a_503_that_says_so(site):
    client, _ = site.signed_in(site.tenant_key)
    sessions = site.app.state.web_sessions
    working = sessions.redis
    sessions.redis = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)  # nothing listens there
    try:
        response = client.get("/v1/usage")
        assert response.status_code == 503
        assert "session store" in response.json()["error"]["message"]
        assert sign_in(site.client(), site.tenant_key).status_code == 503
        # Bearer keys do not depend on the session store.
        bearer = site.client().get("/v1/usage", headers={"Authorization": f"Bearer {site.tenant_key}"})
        assert bearer.status_code == 200
    finally:
        sessions.redis = working
    assert client.get("/v1/usage").status_code == 200
