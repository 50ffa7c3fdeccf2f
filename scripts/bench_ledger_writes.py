"""CPU per request of the two database writes every request makes after it ends: its record
(``tessera.records.settle_records``, the gateway's record writer) and its ledger row with the sums it adds to
(``billing.ledger.record_events``, the billing consumer), in batches of 1, 8 and 32 as the writers drain them.

    python scripts/bench_ledger_writes.py [sqlite | postgresql]            # this tree
    PYTHONPATH=/tmp/base:/tmp/base/platform python scripts/bench_ledger_writes.py ...   # another tree

SQLite: a migrated scratch file; PostgreSQL: a scratch database on the local server (postgres@127.0.0.1,
dropped afterwards). Median of 3 rounds of the process's CPU time.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone

from tessera import db
from tessera.models import Tenant
from tessera.records import settle_records

from billing.ledger import UsageEvent, record_events

PG_ADMIN = "postgresql://postgres@127.0.0.1/postgres"


def records(n: int) -> list[dict]:
    now = datetime.now(timezone.utc)
    common = {"tenant_id": "t1", "deployment": "@tessera/pycode-tiny", "model": "@tessera/pycode-tiny"}
    return [
        {"request_id": f"req_{uuid.uuid4().hex}", "status": "completed", "prompt_tokens": 9, "completion_tokens": 64,
         "ttft_s": 0.1, "duration_s": 1.0, "created_at": now, "finished_at": now, **common}
        for _ in range(n)
    ]  # fmt: skip


def events(n: int) -> list[UsageEvent]:
    now = datetime.now(timezone.utc)
    return [
        UsageEvent(request_id=f"req_{uuid.uuid4().hex}", tenant_id="t1", deployment="@tessera/pycode-tiny",
                   model="@tessera/pycode-tiny", status="completed", prompt_tokens=9, output_tokens=64,
                   started_at=now - timedelta(seconds=1), first_token_at=now - timedelta(seconds=0.9),
                   finished_at=now)
        for _ in range(n)
    ]  # fmt: skip


def measure(sessions, write, make, batch: int) -> float:
    """Median CPU microseconds per request of ``write(session, make(batch))``."""
    calls = max(20, 320 // batch)
    for _ in range(5):
        with sessions() as session:
            write(session, make(batch))
    rounds = []
    for _ in range(3):
        start = time.process_time()
        for _ in range(calls):
            with sessions() as session:
                write(session, make(batch))
        rounds.append((time.process_time() - start) / (calls * batch) * 1e6)
    return statistics.median(rounds)


def run(url: str) -> None:
    db.upgrade(url)
    engine = db.make_engine(url)
    sessions = db.session_factory(engine)
    with sessions() as session:
        session.add(Tenant(id="t1", name="t1"))
        session.commit()
    for name, write, make in (
        ("settle_records", settle_records, records),
        ("record_events", record_events, events),
    ):
        per = [measure(sessions, write, make, batch) for batch in (1, 8, 32)]
        print(
            f"{engine.dialect.name:10} {name:15} us CPU per request at batch 1, 8, 32: {per[0]:.0f}, {per[1]:.0f}, {per[2]:.0f}"
        )
    engine.dispose()


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "sqlite"
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            run(f"sqlite:///{tmp}/bench.db")
        return
    import psycopg

    name = f"tessera_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            run(f"postgresql+psycopg://postgres@127.0.0.1/{name}")
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
