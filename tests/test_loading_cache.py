"""The gateway's database-backed caches load each entry once per expiry, however many requests find it
expired at the same moment: the deployments (Catalog), the price book (PriceCache) and, through the same
cache, the quota scopes (tests/test_budgets.py)."""

from __future__ import annotations

import shutil
import threading
import time
from datetime import datetime, timezone

import pytest
from sqlalchemy import event
from tessera import db, deployments
from tessera.api.catalog import Catalog
from tessera.errors import APIError
from tessera.loading_cache import LoadingCache
from tessera.pricing import PriceCache

import billing
from billing import PriceSpec

CONCURRENT = 8


def concurrently(call, n: int = CONCURRENT) -> list:
    """``call()`` from n threads released together; their results (or exceptions) in no particular order."""
    start = threading.Barrier(n)
    results = []

    def run():
        start.wait()
        try:
            results.append(call())
        except Exception as exc:  # the caller asserts on what came back
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_callers_of_a_missing_key_wait_for_one_load_and_a_failed_load_is_not_kept():
    cache: LoadingCache[str, int] = LoadingCache(ttl_s=60, max_entries=4)
    loads = []

    def slow_load():
        loads.append(1)
        time.sleep(0.2)  # every caller arrives while the first load runs
        return len(loads)

    assert concurrently(lambda: cache.get("a", slow_load)) == [1] * CONCURRENT
    assert len(loads) == 1 and cache.cached("a") == 1
    with pytest.raises(KeyError):
        cache.cached("b")

    def failing():
        loads.append(1)
        time.sleep(0.2)
        raise ConnectionError("database down")

    # The callers waiting for a load that fails get its exception; they do not each try again in turn.
    loads.clear()
    outcomes = concurrently(lambda: cache.get("b", failing))
    assert len(loads) == 1 and all(isinstance(o, ConnectionError) for o in outcomes)
    with pytest.raises(KeyError):
        cache.cached("b")  # nothing stored: the next caller loads again
    assert cache.get("b", lambda: 7) == 7


def test_an_entry_expires_and_the_least_recently_used_makes_room():
    now = [0.0]
    cache: LoadingCache[str, str] = LoadingCache(ttl_s=10, max_entries=2, timer=lambda: now[0])
    assert cache.get("a", lambda: "first") == "first"
    now[0] = 9.9
    assert cache.get("a", lambda: "second") == "first"  # fresh: no load
    now[0] = 10.0
    with pytest.raises(KeyError):
        cache.cached("a")
    assert cache.get("a", lambda: "second") == "second"  # expired: loaded again
    cache.get("b", lambda: "b")
    cache.get("a", lambda: "unused")  # a is used more recently than b
    cache.get("c", lambda: "c")
    with pytest.raises(KeyError):
        cache.cached("b")
    assert cache.cached("a") == "second" and cache.cached("c") == "c"


@pytest.fixture
def slow_database(tmp_path):
    """A migrated SQLite database whose reads of deployments and prices sleep 0.2 s each, counted."""
    url = f"sqlite:///{tmp_path / 'gateway.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    reads: dict[str, int] = {}

    @event.listens_for(engine, "before_cursor_execute")
    def slow(conn, cursor, statement, *args):
        for name, table in (("deployments", "deployments"), ("prices", "billing_prices")):
            if statement.lstrip().upper().startswith("SELECT") and f"FROM {table}" in statement:
                reads[name] = reads.get(name, 0) + 1
                time.sleep(0.2)

    return db.session_factory(engine), reads


def test_an_expired_deployment_is_read_once_by_concurrent_requests(slow_database, demo_model_dir):
    sessions, reads = slow_database
    with sessions() as session:
        deployments.create_deployment(
            session, {"name": "@acme/demo", "checkpoint": str(demo_model_dir)}, actor="t"
        )
    catalog = Catalog(sessions, ttl_s=1.0, max_absent=2)  # outlives a read (0.2 s here)
    reads.clear()
    first = catalog.get("@acme/demo")
    assert reads == {"deployments": 1}
    time.sleep(1.1)  # expired
    assert catalog.cached("@acme/demo") is None
    assert concurrently(lambda: catalog.get("@acme/demo")) == [first] * CONCURRENT
    assert reads == {"deployments": 2}
    # A name that is not deployed is remembered as such for the same time: one read, then 404s without.
    missing = concurrently(lambda: catalog.get("@acme/absent"))
    assert reads == {"deployments": 3}
    assert all(isinstance(e, APIError) and e.status == 404 for e in missing)
    with pytest.raises(APIError):
        catalog.cached("@acme/absent")
    # Names found absent are remembered apart: more of them than that cache holds leave the deployment in.
    catalog = Catalog(sessions, ttl_s=60, max_models=2, max_absent=2)
    first = catalog.get("@acme/demo")
    for n in range(4):
        with pytest.raises(APIError):
            catalog.get(f"@acme/made-up-{n}")
    reads.clear()
    assert catalog.cached("@acme/demo") == first and catalog.get("@acme/demo") == first and reads == {}


def test_an_expired_price_book_entry_is_read_once_by_concurrent_requests(slow_database):
    sessions, reads = slow_database
    when = datetime(2026, 6, 1, tzinfo=timezone.utc)
    with sessions() as session:
        billing.set_price(
            session,
            "@acme/demo",
            PriceSpec(1_000_000, 250_000, 2_000_000),
            effective_from=datetime(2026, 1, 1, tzinfo=timezone.utc),
        )
    prices = PriceCache(sessions, ttl_s=1.0)
    reads.clear()
    first = prices.at("@acme/demo", when)
    assert first is not None and first.output == 2_000_000 and reads == {"prices": 1}
    time.sleep(1.1)
    assert prices.cached_at("@acme/demo", when) is None
    assert concurrently(lambda: prices.at("@acme/demo", when)) == [first] * CONCURRENT
    assert reads == {"prices": 2}
    assert prices.cached_at("@acme/demo", when) == (first,)


def test_a_deployment_whose_checkpoint_cannot_be_read_is_a_503_until_it_can(
    slow_database, demo_model_dir, tmp_path
):
    sessions, reads = slow_database
    checkpoint = tmp_path / "not-yet"
    with sessions() as session:
        deployments.create_deployment(
            session,
            {"name": "@acme/later", "checkpoint": str(checkpoint)},
            actor="t",
            check_checkpoint_files=False,
        )
    catalog = Catalog(sessions, ttl_s=60)
    reads.clear()
    outcomes = concurrently(lambda: catalog.get("@acme/later"))
    assert reads == {"deployments": 1}  # the waiting requests share the one attempt
    assert all(
        isinstance(e, APIError) and e.status == 503 and e.code == "model_unavailable" for e in outcomes
    )
    assert "can't be read on the gateway" in str(outcomes[0])
    assert catalog.cached("@acme/later") is None  # not remembered: neither a model nor an absent name
    shutil.copytree(demo_model_dir, checkpoint)
    model = catalog.get("@acme/later")
    assert model.spec.name == "@acme/later" and model.tokenizer is not None and reads == {"deployments": 2}
