"""Prometheus meters: ``GET /metrics`` on the gateway parses with prometheus_client's own parser and its usage
counters equal the ledger (a redelivered event moves nothing); admin keys only; several processes sum under
PROMETHEUS_MULTIPROC_DIR; a worker's exporter reports its engine and its queue."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections import defaultdict
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select, text
from test_budgets import REDIS_URL, auth, full_output
from test_budgets import gw as gw
from test_budgets import stack as stack
from test_gateway import reply, wait_for

import billing
from billing import BillingConsumer, LedgerEvent, UsageEvent
from gpu_workers.pools.metrics import EngineCollector, Exporter


def scrape(base: str, key: str) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics``: (sample name, sorted labels) -> value."""
    response = httpx.get(f"{base}/metrics", headers=auth(key))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def ledger_of(gw, model: str) -> list[LedgerEvent]:
    with gw.sessions() as session:
        return list(session.scalars(select(LedgerEvent).where(LedgerEvent.model == model)))


def settled(gw) -> bool:
    """The app's billing consumer has charged and acknowledged everything on the stream."""
    client = redis.Redis.from_url(REDIS_URL)
    groups = {g["name"].decode(): g for g in client.xinfo_groups(gw.settings.records_stream)}
    group = groups.get("tessera-billing")
    return group is not None and group["pending"] == 0 and group["lag"] == 0


def test_metrics_parse_and_the_usage_counters_equal_the_ledger_even_after_a_redelivery(gw):
    tenants = [gw.tenant() for _ in range(2)]
    for i, (_, _, raw) in enumerate(tenants):
        for cached in (0, 2, 4):
            gw.pools.script = reply(("a",) * (i + 2), cached=cached)
            body = gw.body(
                stream=bool(cached % 4), stream_options={"include_usage": True} if cached else None
            )
            body = {k: v for k, v in body.items() if v is not None}
            assert httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=body).status_code == 200
    wait_for(lambda: len(ledger_of(gw, gw.model)) >= 6 and settled(gw), timeout_s=30)

    def check() -> None:
        samples = scrape(gw.base, gw.admin_key)
        rows = ledger_of(gw, gw.model)
        for _, tenant_id, _ in tenants:
            mine = [r for r in rows if r.tenant_id == tenant_id]
            assert len(mine) == 3
            for kind, column in (
                ("cached", "cached_input_tokens"),
                ("fresh", "fresh_input_tokens"),
                ("output", "output_tokens"),
            ):
                expected = sum(getattr(r, column) for r in mine)
                got = value(samples, "tessera_tokens_total", tenant=tenant_id, model=gw.model, kind=kind)
                assert got == expected, (kind, got, expected)
            cost = value(samples, "tessera_cost_usd_total", tenant=tenant_id, model=gw.model)
            assert cost == pytest.approx(sum(r.cost for r in mine) / 1e6, abs=1e-12)
        by_status = defaultdict(int)
        for r in rows:
            by_status[r.status] += 1
        for status, n in by_status.items():
            assert value(samples, "tessera_requests_total", model=gw.model, status=status) == n
        count = value(samples, "tessera_request_duration_seconds_count", model=gw.model)
        assert count == len(rows)
        assert value(samples, "tessera_time_to_first_token_seconds_count", model=gw.model) == sum(
            r.ttft_s is not None for r in rows
        )

    check()
    rows_before = ledger_of(gw, gw.model)
    # Every outcome delivered again (a gateway that emitted twice, a consumer that died before its XACK):
    # the ledger inserts nothing, so no meter moves.
    client = redis.Redis.from_url(REDIS_URL)
    for _, fields in client.xrange(gw.settings.records_stream):
        client.xadd(gw.settings.records_stream, fields)
    # The app's consumer takes the copies (its group's lag reaches 0); a consumer in a group of its own reads
    # every entry again, deterministically, and charges none of them either.
    wait_for(lambda: settled(gw), timeout_s=30)
    assert len(ledger_of(gw, gw.model)) == len(rows_before)
    group = f"test-redelivery-{uuid.uuid4().hex[:8]}"
    again = BillingConsumer(client, gw.sessions, gw.settings.records_stream, group=group)
    try:
        assert again.drain() >= 2 * len(rows_before) and again.charged == 0
    finally:
        client.xgroup_destroy(gw.settings.records_stream, group)
    check()


def test_metrics_need_an_admin_key(gw):
    _, _, raw = gw.tenant()
    assert httpx.get(f"{gw.base}/metrics").status_code == 401
    assert httpx.get(f"{gw.base}/metrics", headers=auth(raw)).status_code == 403


def test_each_429_counts_once_under_the_limit_that_refused_it(gw):
    before = scrape(gw.base, gw.admin_key)
    _, _, raw = gw.tenant(rpm=1)
    _, _, poor = gw.tenant(monthly_spend=1)
    gw.pools.script = full_output()
    codes = [
        httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body()).status_code
        for _ in range(3)
    ]
    assert codes == [200, 429, 429]
    assert httpx.post(f"{gw.base}/v1/completions", headers=auth(poor), json=gw.body()).status_code == 429
    after = scrape(gw.base, gw.admin_key)
    for limit, n in (("rpm", 2), ("monthly_spend", 1)):
        delta = value(after, "tessera_rate_limited_total", limit=limit) - value(
            before, "tessera_rate_limited_total", limit=limit
        )
        assert delta == n, limit


def test_no_label_names_a_request(gw):
    _, _, raw = gw.tenant()
    response = httpx.post(f"{gw.base}/v1/completions", headers=auth(raw), json=gw.body())
    request_id = response.headers["x-request-id"]
    wait_for(lambda: settled(gw), timeout_s=30)
    text = httpx.get(f"{gw.base}/metrics", headers=auth(gw.admin_key)).text
    assert request_id not in text and request_id.removeprefix("req_") not in text


def test_the_usage_counters_count_rows_committed_by_a_process_that_died_before_moving_any_meter(gw):
    """A billing consumer killed right after its commit never ran the code after it; the rows are in the
    ledger, so the counters have them: what committed them here is ``record_events`` alone, the consumer's
    own write, with nothing after it."""
    model = f"@died/m-{uuid.uuid4().hex[:8]}"
    _, tenant_id, _ = gw.tenant()
    started = datetime.now(timezone.utc)
    events = [
        UsageEvent(
            request_id=f"req_died_{uuid.uuid4().hex[:12]}",
            tenant_id=tenant_id,
            deployment=model,
            model=model,
            status=status,
            prompt_tokens=40 + i,
            cached_tokens=16,
            output_tokens=3 * i,
            started_at=started,
            first_token_at=started + timedelta(milliseconds=30),
            finished_at=started + timedelta(milliseconds=200),
        )
        for i, status in enumerate(("completed", "completed", "cancelled"))
    ]
    with gw.sessions() as session:
        rows = billing.record_events(session, events)
    assert len(rows) == 3
    samples = scrape(gw.base, gw.admin_key)
    assert value(samples, "tessera_tokens_total", tenant=tenant_id, model=model, kind="cached") == 48
    assert value(samples, "tessera_tokens_total", tenant=tenant_id, model=model, kind="fresh") == 24 * 3 + 3
    assert value(samples, "tessera_tokens_total", tenant=tenant_id, model=model, kind="output") == 9
    assert value(samples, "tessera_cost_usd_total", tenant=tenant_id, model=model) == pytest.approx(
        sum(r["cost"] for r in rows) / 1e6, abs=1e-12
    )
    assert value(samples, "tessera_requests_total", model=model, status="completed") == 2
    assert value(samples, "tessera_requests_total", model=model, status="cancelled") == 1
    # Only the consumer that inserted a row observes its timings: these rows moved no histogram.
    assert value(samples, "tessera_request_duration_seconds_count", model=model) == 0


def test_metrics_is_a_503_saying_why_while_the_usage_counters_cannot_be_read(gw):
    # The database refuses the query (its outcome counts table is gone for a moment): the scrape fails
    # with our error body instead of a 500 or a page without the usage counters.
    with gw.sessions() as session:
        session.execute(text("ALTER TABLE billing_outcomes RENAME TO billing_outcomes_away"))
        session.commit()
    try:
        response = httpx.get(f"{gw.base}/metrics", headers=auth(gw.admin_key))
    finally:
        with gw.sessions() as session:
            session.execute(text("ALTER TABLE billing_outcomes_away RENAME TO billing_outcomes"))
            session.commit()
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "database_unavailable" and "usage counters" in error["message"]
    assert response.headers["retry-after"] == "5"
    assert httpx.get(f"{gw.base}/metrics", headers=auth(gw.admin_key)).status_code == 200


_CHILD = textwrap.dedent(
    """
    import sys
    from billing import metrics
    row = dict(tenant_id="t1", model="m", status="completed", cached_input_tokens=1, fresh_input_tokens=2,
               output_tokens=int(sys.argv[1]), cost=7, ttft_s=0.1, duration_s=float(sys.argv[2]))
    metrics.observe_ledger_rows([row])
    """
)
_READER = textwrap.dedent(
    """
    from billing import metrics
    print(metrics.exposition()[0].decode())
    """
)


def test_under_prometheus_multiproc_dir_every_process_observes_into_one_exposition(tmp_path):
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for output, duration in ((3, 0.5), (5, 2.0)):  # two processes, each its own ledger row
        subprocess.run(
            [sys.executable, "-c", _CHILD, str(output), str(duration)], check=True, env=env, timeout=60
        )
    text = subprocess.run(
        [sys.executable, "-c", _READER], check=True, env=env, capture_output=True, text=True, timeout=60
    ).stdout
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert value(samples, "tessera_request_duration_seconds_count", model="m") == 2
    assert value(samples, "tessera_request_duration_seconds_sum", model="m") == pytest.approx(2.5)
    assert value(samples, "tessera_request_duration_seconds_bucket", model="m", le="1.0") == 1
    # tpot: (duration - ttft) / (output - 1) per row
    assert value(samples, "tessera_time_per_output_token_seconds_sum", model="m") == pytest.approx(
        0.2 + 0.475
    )


# -- the worker's exporter ------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_workers_exporter_reports_its_engine_and_its_queue(demo_model_dir):
    from gpu_workers import Engine, EngineConfig, SamplingParams

    engine = Engine.from_pretrained(demo_model_dir, EngineConfig(dtype="float32", page_size=4))
    prompt = list(range(1, 30))
    for _ in range(2):  # the second run finds the first's full pages in the prefix cache
        engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0), tenant="t")
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    client = redis.Redis.from_url(REDIS_URL)
    queue = f"tessera:test:queue:{uuid.uuid4().hex}"
    client.rpush(queue, b"a", b"b", b"c")
    port = _free_port()
    exporter = Exporter(
        EngineCollector("dep", "decode", engine.stats, lambda: client.llen(queue)), port, addr="127.0.0.1"
    )
    exporter.start()
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics")
    finally:
        exporter.stop()
        client.delete(queue)
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    labels = {"deployment": "dep", "pool": "decode"}
    assert value(samples, "tessera_queue_depth", **labels) == 3
    assert value(samples, "tessera_kv_pages_total", **labels) == stats["kv_pages_total"]
    assert value(samples, "tessera_kv_pages_used", **labels) == stats["kv_pages_used"]
    assert (
        value(samples, "tessera_prefix_cache_query_tokens_total", **labels)
        == stats["prefix_cache_query_tokens"]
    )
    assert (
        value(samples, "tessera_prefix_cache_hit_tokens_total", **labels) == stats["prefix_cache_hit_tokens"]
    )
    assert (
        value(samples, "tessera_kv_integrity_mismatches_total", deployment="dep")
        == stats["integrity_mismatches"]
    )


def test_an_exporter_on_port_0_serves_nothing():
    exporter = Exporter(EngineCollector("dep", "decode", dict, lambda: 0), 0)
    exporter.start()
    assert exporter._server is None
    exporter.stop()
