"""The web UI in a real browser: Debian's Chromium driven by Playwright against a real API process (`tessera
api`) with real Redis and a seeded database. Sign in, the dashboard's figures equal `GET /v1/usage`, the charts
draw, the latency and error panel equals `GET /v1/usage/quality` (and a 429 from the gateway shows by its limit),
the CSV equals the API's, an admin flips a deployment's integrity switch (diff, save, audit), a tenant
key cannot open /admin, a bad key gets a clear message, a phone screen holds, axe-core finds nothing serious.

Screenshots go to $TESSERA_ARTIFACTS (default tests/artifacts/, gitignored)."""

from __future__ import annotations

import csv
import io
import os
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import redis
from tessera import SHIPPED_MODEL_DIR, db, deployments, quota_config, tenancy
from tessera.limits import Limits
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE

import billing
from gpu_workers.protocol import WorkerInfo, worker_queue, workers_key

REPO = Path(__file__).resolve().parents[1]
REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(os.environ.get("TESSERA_ARTIFACTS") or REPO / "tests" / "artifacts")
MODELS = ["@tessera/pycode-tiny", "@acme/big", "@acme/small"]
START, END = "2026-11-01", "2026-11-14"
WAIT_MS = 30_000

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")


class Server:
    def __init__(self, url: str, sessions, keys: dict[str, str], deployment: str, key_ids: list[str]):
        self.url = url
        self.sessions = sessions
        self.keys = keys
        self.deployment = deployment
        self.key_ids = key_ids

    def api(self, path: str, key: str = "acme", **params) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.keys[key]}"}
        response = httpx.get(f"{self.url}{path}", params=params, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        return response


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_usage(session, tenant_id: str, key_ids: list[str], tenant: str, n: int) -> None:
    """``n`` charged requests over two weeks of November 2026, three models and the tenant's keys."""
    events = []
    for i in range(n):
        started = datetime(2026, 11, 1 + i % 14, 9, tzinfo=timezone.utc) + timedelta(seconds=i)
        ttft_ms = 2500 if i % 40 == 0 else 30 + 20 * (i % 7)  # 6 ms per output token after the first
        events.append(
            billing.UsageEvent(
                request_id=f"{tenant}-{i}",
                tenant_id=tenant_id,
                key_id=key_ids[i % len(key_ids)],
                deployment=MODELS[i % 3],
                model=MODELS[i % 3],
                # Some fail after their first tokens (billed as usual): errors for the quality panel.
                status="failed" if i % 25 == 24 else "completed",
                error_code=("engine_failed", "kv_integrity_violation")[i % 2] if i % 25 == 24 else None,
                prompt_tokens=200 + 13 * (i % 17),
                cached_tokens=32 * (i % 5),
                output_tokens=20 + 7 * (i % 11),
                started_at=started,
                first_token_at=started + timedelta(milliseconds=ttft_ms),
                finished_at=started + timedelta(milliseconds=ttft_ms + 6 * (19 + 7 * (i % 11))),
            )
        )
    # Recorded as the ledger did mid-November, so they are billed on November's invoice whatever today's
    # date (past its close, the clock would bill them on the open month instead).
    billing.record_events(session, events, now=datetime(2026, 11, 15, tzinfo=timezone.utc))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"the browser tests need Debian's Chromium at {CHROMIUM}: apt-get install -y chromium")
    r = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    r.ping()
    data = tmp_path_factory.mktemp("web-ui")
    database_url = f"sqlite:///{data / 'tessera.db'}"
    db.upgrade(database_url)
    sessions = db.session_factory(db.make_engine(database_url))
    deployment = f"@test/web-{uuid.uuid4().hex[:8]}"
    with sessions() as session:
        acme = tenancy.create_tenant(session, "acme")
        tenancy.create_tenant(session, "globex")
        tenancy.create_tenant(session, "ops")
        acme_keys = [tenancy.create_key(session, "acme", name=f"app-{i}") for i in range(3)]
        globex_key, globex_raw = tenancy.create_key(session, "globex")
        _, admin_raw = tenancy.create_key(
            session, "ops", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN), name="console"
        )
        config = {"name": deployment, "checkpoint": str(SHIPPED_MODEL_DIR), "mode": "disaggregated"}
        deployments.create_deployment(session, config, actor="test")
        key_ids = [k.id for k, _ in acme_keys]
        seed_usage(session, acme.id, key_ids, "acme", 300)
        seed_usage(session, globex_key.tenant_id, [globex_key.id], "globex", 50)
    keys = {"acme": acme_keys[0][1], "globex": globex_raw, "admin": admin_raw}
    port = free_port()
    env = {
        **os.environ,
        "TESSERA_DATA_DIR": str(data),
        "TESSERA_DATABASE_URL": database_url,
        "TESSERA_REDIS_URL": REDIS_URL,
        "TESSERA_SECRET_KEY": "web-ui-test-secret-" * 4,
        "TESSERA_RECORDS_STREAM": f"tessera:test:records:{uuid.uuid4().hex}",
    }
    log = data / "api.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "tessera.app:create_app", "--port", str(port)],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the API process exited: {log.read_text()}"
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the API did not start: {log.read_text()}"
            time.sleep(0.1)
        yield Server(url, sessions, keys, deployment, key_ids)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        r.delete(env["TESSERA_RECORDS_STREAM"], billing.rejections_key(env["TESSERA_RECORDS_STREAM"]))
        for pool in ("prefill", "decode", "serve"):
            r.delete(workers_key(deployment, pool))


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def context(browser, server):
    """A desktop browser context; any script error or CSP violation on its pages fails the test."""
    context = browser.new_context(base_url=server.url, viewport={"width": 1366, "height": 768})
    context.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    # A refused resource (the 401/403 pages the tests ask for) is logged too; anything else is a fault.
    context.on(
        "console",
        lambda m: (
            m.type == "error" and not m.text.startswith("Failed to load resource") and errors.append(m.text)
        ),
    )
    context.on("weberror", lambda e: errors.append(str(e.error)))
    yield context
    context.close()
    assert errors == [], errors


def sign_in(page, key: str, path: str = "/signin"):
    page.goto(path)
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()


def wait_ready(page) -> None:
    page.wait_for_selector("body[data-ready=true]")


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def open_dashboard(page, server) -> None:
    sign_in(page, server.keys["acme"])
    page.wait_for_url("**/dashboard")
    page.goto(f"/dashboard?start={START}&end={END}")
    wait_ready(page)


def canvas_has_pixels(page, canvas_id: str) -> int:
    """How many pixels of the canvas are painted (alpha > 0)."""
    return page.evaluate(
        """(id) => {
            const canvas = document.getElementById(id);
            const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
            let painted = 0;
            for (let i = 3; i < data.length; i += 4) if (data[i] > 0) painted++;
            return painted;
        }""",
        canvas_id,
    )


def table(page, table_id: str) -> list[list[str]]:
    return page.eval_on_selector_all(
        f"#{table_id} tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent.trim()))"
    )


def test_sign_in_and_the_dashboard_shows_what_the_usage_api_says(context, server):
    page = context.new_page()
    sign_in(page, server.keys["acme"])
    page.wait_for_url("**/dashboard")
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(f"/dashboard?start={START}&end={END}")
    wait_ready(page)
    days = server.api("/v1/usage", start=START, end=END, group_by="day", limit=366).json()["data"]
    models = server.api("/v1/usage", start=START, end=END, group_by="model").json()["data"]
    keys = server.api("/v1/usage", start=START, end=END, group_by="key").json()["data"]
    total = lambda field: sum(row[field] for row in days)  # noqa: E731
    shown = {dd.get_attribute("data-total"): dd.text_content() for dd in page.locator("[data-total]").all()}
    assert shown["requests"] == f"{total('requests'):,}" == "300"  # acme's only, not globex's 50
    assert shown["cached_input_tokens"] == f"{total('cached_input_tokens'):,}"
    assert shown["fresh_input_tokens"] == f"{total('fresh_input_tokens'):,}"
    assert shown["output_tokens"] == f"{total('output_tokens'):,}"
    cost = total("cost")
    assert shown["cost_usd"] == f"{cost // 10**6}.{cost % 10**6:06d}"
    ratio = 100 * total("cached_input_tokens") / total("input_tokens")
    assert shown["cache_hit_ratio"] == f"{ratio:.1f}%"
    price = billing.DEFAULT_PRICES["*"]
    saved = sum(
        (m["cached_input_tokens"] * (price.fresh_input - price.cached_input) + 500_000) // 10**6
        for m in models
    )
    assert shown["saved_usd"] == f"{saved // 10**6}.{saved % 10**6:06d}" and saved > 0
    assert [row[0] for row in table(page, "by-model")] == [m["model"] for m in models]
    assert [row[5] for row in table(page, "by-model")] == [m["cost_usd"] for m in models]
    assert sorted(row[0].removesuffix(" (this key)") for row in table(page, "by-key")) == sorted(
        k["key_id"] for k in keys
    )
    assert [row[0] for row in table(page, "by-day")] == [d["day"] for d in days] and len(days) == 14
    for chart in ("tokens-chart", "cost-chart"):
        assert canvas_has_pixels(page, chart) > 1000, chart
    page.wait_for_selector("body[data-invoices=ready]")
    invoices = server.api("/v1/invoices").json()["data"]
    assert [r[0] for r in table(page, "invoices")] == [i["period"] for i in invoices] and invoices
    assert [r[3] for r in table(page, "invoices")] == [i["total_usd"] for i in invoices]
    # Bounded: the page, its stylesheet, four scripts and five API calls, whatever the ledger holds (and the
    # icon, which the browser may take from its cache).
    api_calls = [u for u in requests if "/v1/" in u]
    assert len(api_calls) == 5 and len([u for u in requests if not u.endswith("/favicon.svg")]) == 10, (
        requests
    )
    assert all(u.startswith(server.url) for u in requests)  # nothing from a CDN
    shot(page, "dashboard")


def test_filters_narrow_the_figures_to_one_model(context, server):
    page = context.new_page()
    open_dashboard(page, server)
    page.get_by_label("Model", exact=True).select_option("@acme/big")
    page.get_by_role("button", name="Apply").click()
    page.wait_for_function("() => new URLSearchParams(location.search).get('model') === '@acme/big'")
    page.wait_for_selector("#by-model tbody tr:only-child")
    want = server.api("/v1/usage", start=START, end=END, group_by="day", model="@acme/big", limit=366).json()
    requests = sum(row["requests"] for row in want["data"])
    page.wait_for_function(
        "(n) => document.querySelector('[data-total=requests]').textContent === n", arg=f"{requests:,}"
    )
    assert table(page, "by-model")[0][0] == "@acme/big"


def seconds(value: float | None) -> str:
    """As the dashboard shows a latency (dashboard.js ``seconds``)."""
    if value is None:
        return "–"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def quality_shown(page) -> dict[str, str]:
    return {
        dd.get_attribute("data-quality"): dd.text_content() for dd in page.locator("[data-quality]").all()
    }


def test_the_quality_panel_shows_what_the_quality_api_says(context, server):
    page = context.new_page()
    open_dashboard(page, server)
    quality = server.api("/v1/usage/quality", start=START, end=END).json()
    total = quality["total"]
    assert total["requests"] == 300 and total["errors"] == {"engine_failed": 6, "kv_integrity_violation": 6}
    # 8 of 300 took 2.5 s (under 5%), the rest at most 150 ms: p95 lies in the bucket of 150 ms
    assert 0.03 <= total["ttft"]["p50_s"] <= total["ttft"]["p95_s"] < 0.22
    assert 0.004 < total["tpot"]["p50_s"] < 0.009  # 6 ms per token, within its bucket
    assert quality_shown(page) == {
        "ttft_p50": seconds(total["ttft"]["p50_s"]),
        "ttft_p95": seconds(total["ttft"]["p95_s"]),
        "tpot_p50": seconds(total["tpot"]["p50_s"]),
        "tpot_p95": seconds(total["tpot"]["p95_s"]),
        "errors": "12",
        "rejected": f"{total['rejected']:,}",
    }
    assert quality_shown(page)["ttft_p50"].endswith(" ms")
    assert sorted(table(page, "errors")) == [["engine_failed", "6"], ["kv_integrity_violation", "6"]]
    per_day = table(page, "quality-by-day")
    assert [r[0] for r in per_day] == [d["day"] for d in quality["data"]] and len(per_day) == 14
    assert [r[1:4] for r in per_day] == [
        [f"{d['requests']:,}", seconds(d["ttft"]["p50_s"]), seconds(d["ttft"]["p95_s"])]
        for d in quality["data"]
    ]
    assert [r[4:6] for r in per_day] == [
        [seconds(d["tpot"]["p50_s"]), seconds(d["tpot"]["p95_s"])] for d in quality["data"]
    ]
    shot(page, "dashboard-quality")


def test_a_429_from_the_gateway_shows_on_the_dashboard_by_its_limit(context, server):
    with server.sessions() as session:
        key, raw = tenancy.create_key(session, "acme", name="limited")
        quota_config.set_limits(session, "acme", Limits(rpm=1), key_prefix=key.prefix)
    time.sleep(quota_config.CACHE_TTL_S + 0.2)  # the API's limits cache
    body = {"model": server.deployment, "prompt": [1, 2, 3], "max_tokens": 2}
    codes = []
    for _ in range(2):  # the minute's one request is admitted (then finds no worker), the next is refused
        response = httpx.post(
            f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {raw}"}, timeout=30
        )
        codes.append((response.status_code, response.json()["error"]["code"]))
    assert codes[1] == (429, "rate_limit_exceeded"), codes
    today = datetime.now(timezone.utc).date().isoformat()
    deadline = time.monotonic() + 30
    while not server.api("/v1/usage/quality", start=today, end=today).json()["total"]["rejected"]:
        assert time.monotonic() < deadline, "the 429 was never counted"
        time.sleep(0.2)  # the API's billing consumer moves the counters every second
    page = context.new_page()
    open_dashboard(page, server)
    page.goto(f"/dashboard?start={START}&end={today}")
    wait_ready(page)
    quality = server.api("/v1/usage/quality", start=START, end=today).json()
    assert quality["total"]["rejected_by_limit"] == {"rpm": 1}
    assert table(page, "rejections") == [["rpm", "1"]]
    assert quality_shown(page)["rejected"] == "1"
    assert table(page, "quality-by-day")[-1][0] == today and table(page, "quality-by-day")[-1][7] == "1"
    shot(page, "dashboard-429")


def test_the_csv_download_equals_the_api(context, server):
    page = context.new_page()
    open_dashboard(page, server)
    with page.expect_download() as download:
        page.get_by_role("link", name="Export CSV").click()
    got = Path(download.value.path()).read_bytes()
    want = server.api("/v1/usage", start=START, end=END, group_by="day", limit=366, format="csv").content
    assert got == want and got.count(b"\n") == 15  # header + 14 days
    # The CSV's money is the invoice's: every seeded request is in November 2026.
    rows = list(csv.DictReader(io.StringIO(got.decode())))
    invoice = server.api("/v1/invoices/2026-11").json()
    assert sum(int(r["cost"]) for r in rows) == invoice["subtotal"] == invoice["total"] > 0
    page.get_by_role("button", name="Invoice 2026-11").click()
    page.locator("#invoice").wait_for(state="visible")
    assert page.locator("#invoice-total").text_content() == invoice["total_usd"]
    lines = table(page, "invoice-lines")
    assert [line[6] for line in lines] == [line["amount_usd"] for line in invoice["lines"]]
    shot(page, "dashboard-invoice")


def test_an_admin_switches_integrity_off_with_a_diff_and_the_api_and_audit_agree(context, server):
    page = context.new_page()
    sign_in(page, server.keys["admin"], "/signin?next=/admin")
    page.wait_for_url("**/admin")
    wait_ready(page)
    shot(page, "admin")
    edit = page.get_by_role("button", name=f"Edit {server.deployment}")
    box = edit.bounding_box()
    assert box["x"] + box["width"] <= 1366  # in view at 1366x768, not scrolled out of its table
    edit.click()
    checkbox = page.get_by_label("Integrity check")
    assert checkbox.is_checked()
    checkbox.uncheck()
    page.get_by_role("button", name="Review changes").click()
    dialog = page.locator("dialog#confirm")
    dialog.wait_for(state="visible")
    assert [row for row in table(page, "diff")] == [["integrity_check", "true", "false"]]
    shot(page, "admin-diff")
    dialog.get_by_role("button", name="Save").click()
    page.wait_for_selector("#deployment-audit tbody tr:has-text('integrity_check: true → false')")
    deployment = server.api(f"/admin/deployments/{server.deployment}", key="admin").json()
    assert deployment["integrity_check"] is False
    audit = server.api(f"/admin/deployments/{server.deployment}/audit", key="admin").json()["data"]
    newest = audit[0]
    assert newest["action"] == "update" and newest["changes"] == {"integrity_check": [True, False]}
    admin_prefix = server.keys["admin"].split("_")[1]
    assert newest["actor"] == f"key:{admin_prefix}"
    assert (
        page.locator("#deployments tbody tr", has_text=server.deployment).locator("td").nth(6).text_content()
        == "off"
    )


def test_an_invalid_deployment_change_shows_the_apis_message(context, server):
    page = context.new_page()
    sign_in(page, server.keys["admin"], "/signin?next=/admin")
    wait_ready(page)
    page.get_by_role("button", name=f"Edit {server.deployment}").click()
    page.get_by_label("Page size (tokens)").fill("48")
    page.get_by_role("button", name="Review changes").click()
    page.locator("dialog#confirm").get_by_role("button", name="Save").click()
    error = page.locator("#deployment-error")
    error.wait_for(state="visible")
    assert "power of two" in error.text_content()
    assert server.api(f"/admin/deployments/{server.deployment}", key="admin").json()["page_size"] != 48


def test_an_admin_creates_a_key_sees_the_secret_once_and_revokes_it(context, server):
    page = context.new_page()
    sign_in(page, server.keys["admin"], "/signin?next=/admin")
    wait_ready(page)
    page.get_by_role("button", name="Manage globex").click()
    page.get_by_label("Name", exact=True).fill("from-the-console")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#secret-value")
    secret.wait_for(state="visible")
    raw = secret.text_content()
    assert raw.startswith("tsk_")
    assert httpx.get(f"{server.url}/v1/usage", headers={"Authorization": f"Bearer {raw}"}).status_code == 200
    page.get_by_role("button", name="I have copied it").click()
    assert raw not in page.content()  # shown once: gone from the page
    prefix = "tsk_" + raw.split("_")[1]
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name=f"Revoke {prefix}").click()
    page.get_by_role("button", name=f"Revoke {prefix}").wait_for(state="detached")
    assert httpx.get(f"{server.url}/v1/usage", headers={"Authorization": f"Bearer {raw}"}).status_code == 401
    # The audit log on the page shows both changes, by this admin's key, as GET /admin/audit does.
    bare = raw.split("_")[1]
    actor = f"key:{server.keys['admin'].split('_')[1]}"
    page.wait_for_function(
        """(target) => [...document.querySelectorAll("#audit tbody tr")].some(
            (r) => r.cells[3].textContent === target && r.cells[2].textContent === "revoke")""",
        arg=f"key {bare}",
    )
    shown = [r for r in table(page, "audit") if r[3] == f"key {bare}"]
    assert [(r[1], r[2]) for r in shown] == [(actor, "revoke"), (actor, "create")]
    events = server.api("/admin/audit", key="admin", target_type="key").json()["data"]
    assert [(e["actor"], e["action"]) for e in events if e["target"] == bare] == [
        (actor, "revoke"),
        (actor, "create"),
    ]
    assert raw not in page.content()  # the audit entry never holds the secret


def test_an_admin_suspends_and_restores_a_tenant_and_its_key_follows(context, server):
    page = context.new_page()
    sign_in(page, server.keys["admin"], "/signin?next=/admin")
    wait_ready(page)
    globex = {"Authorization": f"Bearer {server.keys['globex']}"}

    def usage() -> int:
        return httpx.get(f"{server.url}/v1/usage", headers=globex).status_code

    assert usage() == 200
    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Suspend globex").click()
    page.get_by_role("button", name="Restore globex").wait_for()
    assert table(page, "tenants")[[r[0] for r in table(page, "tenants")].index("globex")][1] == "suspended"
    assert usage() == 401
    page.get_by_role("button", name="Restore globex").click()
    page.get_by_role("button", name="Suspend globex").wait_for()
    assert usage() == 200


def test_an_admin_sets_a_tenants_quotas_and_the_api_reflects_them(context, server):
    page = context.new_page()
    sign_in(page, server.keys["admin"], "/signin?next=/admin")
    wait_ready(page)
    page.get_by_role("button", name="Manage acme").click()
    form = page.locator("#quotas-form")
    form.get_by_label("Requests per sliding minute").fill("600")
    form.get_by_label("Tokens per UTC day").fill("2000000")
    form.get_by_role("button", name="Save quotas").click()
    page.get_by_role("status").filter(has_text="Saved the quotas of acme").wait_for()
    quotas = server.api("/admin/tenants/acme/quotas", key="admin").json()
    assert quotas["rpm"] == 600 and quotas["daily_tokens"] == 2_000_000 and quotas["tpm"] is None
    form.get_by_label("Requests per sliding minute").fill("-1")
    form.get_by_role("button", name="Save quotas").click()
    assert page.evaluate("document.getElementById('q-rpm').validity.valid") is False  # the form says so first
    assert server.api("/admin/tenants/acme/quotas", key="admin").json()["rpm"] == 600


def test_an_admin_overrides_one_keys_quota_and_the_tenants_limit_shows_through(context, server):
    page = context.new_page()
    sign_in(page, server.keys["admin"], "/signin?next=/admin")
    wait_ready(page)
    page.get_by_role("button", name="Manage acme").click()
    prefix = "tsk_" + server.keys["acme"].split("_")[1]
    page.get_by_role("button", name=f"Quotas of {prefix}").click()
    form = page.locator("#key-quotas-form")
    form.wait_for(state="visible")
    form.get_by_label("Requests in flight").fill("3")
    form.get_by_role("button", name="Save key quotas").click()
    page.get_by_role("status").filter(has_text=f"Saved the quotas of {prefix}").wait_for()
    quota = server.api(f"/admin/keys/{prefix.removeprefix('tsk_')}/quotas", key="admin").json()
    assert quota["override"]["concurrency"] == 3 and quota["effective"]["concurrency"] == 3
    tenant_rpm = server.api("/admin/tenants/acme/quotas", key="admin").json()["rpm"]
    assert quota["override"]["rpm"] is None and quota["effective"]["rpm"] == tenant_rpm
    expected = "unlimited" if tenant_rpm is None else str(tenant_rpm)
    assert form.get_by_label("Requests per sliding minute").get_attribute("placeholder") == expected


def test_sign_in_works_from_the_keyboard_alone(context, server):
    page = context.new_page()
    page.goto("/signin")
    page.keyboard.press("Tab")  # the skip link
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "api_key"
    page.keyboard.type(server.keys["acme"])
    page.keyboard.press("Enter")
    page.wait_for_url("**/dashboard")
    wait_ready(page)


def test_the_sign_in_page_loads_without_a_failed_request_or_console_error(context, server):
    page = context.new_page()
    failed: list[str] = []
    page.on("console", lambda m: m.type == "error" and failed.append(m.text))
    page.on("response", lambda r: r.status >= 400 and failed.append(f"{r.status} {r.url}"))
    page.on("requestfailed", lambda r: failed.append(f"failed {r.url}"))
    page.goto("/signin")
    page.wait_for_load_state("networkidle")
    assert page.get_by_label("API key").is_visible()
    assert failed == [], failed


def test_pool_status_refreshes_without_a_reload(context, server):
    page = context.new_page()
    sign_in(page, server.keys["admin"], "/signin?next=/admin")
    wait_ready(page)
    page.evaluate("window.__sameDocument = true")
    info = WorkerInfo(
        worker_id="web-dc-1",
        deployment=server.deployment,
        pool="decode",
        queue=worker_queue("web-dc-1"),
        host="test",
        pid=1,
        last_seen=time.time() + 60,  # stays live for the whole test
        kv_pages_total=200,
        kv_pages_used=50,
        kv_format="fp8_e4m3",
        integrity_mismatches=3,
    )
    redis.Redis.from_url(REDIS_URL).hset(
        workers_key(server.deployment, "decode"), info.worker_id, info.to_json()
    )
    row = page.locator("#pools tbody tr", has_text=server.deployment).filter(has_text="decode")
    row.filter(has_text="25.0%").wait_for()
    cells = row.locator("td").all_text_contents()
    assert cells[2] == "1" and cells[4] == "25.0%" and cells[5] == "fp8_e4m3" and cells[7] == "3"
    assert page.evaluate("window.__sameDocument") is True  # the same document: no reload happened


def test_a_tenant_key_cannot_open_the_admin_console(context, server):
    page = context.new_page()
    sign_in(page, server.keys["acme"])
    page.wait_for_url("**/dashboard")
    response = page.goto("/admin")
    assert response.status == 403
    assert "Admin keys only" in page.locator("h1").text_content()
    assert page.get_by_role("link", name="Admin").count() == 0
    shot(page, "admin-forbidden")


def test_a_bad_key_shows_a_clear_message(context, server):
    page = context.new_page()
    sign_in(page, "tsk_notakey_" + "x" * 40)
    alert = page.get_by_role("alert")
    alert.wait_for()
    assert "not accepted" in alert.text_content() and "tsk_" in alert.text_content()
    assert page.url.endswith("/signin")
    assert not [c for c in page.context.cookies() if c["name"] == "tessera_session"]
    shot(page, "signin-bad-key")


def test_sign_out_returns_to_the_sign_in_page_and_the_dashboard_needs_signing_in_again(context, server):
    page = context.new_page()
    open_dashboard(page, server)
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url("**/signin")
    page.goto("/dashboard")
    assert page.url.endswith("/signin?next=/dashboard")


def test_the_session_cookie_is_httponly_and_invisible_to_page_script(context, server):
    page = context.new_page()
    open_dashboard(page, server)
    cookie = next(c for c in context.cookies() if c["name"] == "tessera_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert "tessera_session" not in page.evaluate("document.cookie")
    stored = page.evaluate("JSON.stringify({...localStorage}) + JSON.stringify({...sessionStorage})")
    assert server.keys["acme"] not in stored and server.keys["acme"] not in page.content()


@pytest.mark.parametrize("path", ["/dashboard", "/admin"])
def test_a_phone_screen_holds_without_horizontal_overflow(browser, server, path):
    context = browser.new_context(base_url=server.url, viewport={"width": 390, "height": 844}, is_mobile=True)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    sign_in(page, server.keys["admin"], f"/signin?next={path}")
    page.wait_for_url(f"**{path}")
    if path == "/dashboard":
        page.goto(f"/dashboard?start={START}&end={END}")
    wait_ready(page)
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 0, f"{path} is {overflow}px wider than a 390px screen"
    shot(page, f"phone{path.replace('/', '-')}")
    context.close()


@pytest.mark.parametrize("path", ["/signin", "/dashboard", "/admin"])
def test_axe_finds_no_serious_or_critical_violations(browser, server, path):
    # axe is injected as a script of the test, which our own CSP would refuse: this context bypasses it.
    context = browser.new_context(base_url=server.url, bypass_csp=True)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    if path == "/signin":
        page.goto(path)
    else:
        sign_in(page, server.keys["admin"], f"/signin?next={path}")
        page.wait_for_url(f"**{path}")
        wait_ready(page)
    page.add_script_tag(path=str(REPO / "web" / "static" / "vendor" / "axe-core" / "axe.min.js"))
    result = page.evaluate("axe.run(document, {resultTypes: ['violations']})")
    bad = [
        (v["id"], v["impact"], [n["target"] for n in v["nodes"]][:3])
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]
    assert bad == [], bad
    context.close()
