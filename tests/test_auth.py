"""API keys: shown once, stored as salted hashes, verified in constant time, cached briefly, revocable at once."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import redis
from api_processes import api_processes as replica_processes
from api_processes import free_port
from sqlalchemy import event, select
from tessera import auth, db, tenancy
from tessera.errors import InvalidConfig, NotFound
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE, ApiKey
from tessera.settings import RUNNING_REDIS_FILE

REPO = Path(__file__).resolve().parents[1]
KEY_RE = re.compile(r"^tsk_[a-z0-9]{8}_[A-Za-z0-9_-]{32,}$")


@pytest.fixture
def engine(tmp_path):
    url = f"sqlite:///{tmp_path / 'tessera.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    yield engine
    engine.dispose()


@pytest.fixture
def session(engine):
    auth.key_cache.clear()
    with db.session_factory(engine)() as session:
        yield session
    auth.key_cache.clear()


@pytest.fixture
def acme_key(session) -> tuple[ApiKey, str]:
    tenancy.create_tenant(session, "acme")
    return tenancy.create_key(session, "acme", name="ci")


@pytest.fixture
def queries(engine) -> list[str]:
    """Every SQL statement the engine runs from now on."""
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda _c, _cur, statement, *_: seen.append(statement))
    return seen


def test_keys_look_like_tsk_prefix_secret(acme_key):
    key, raw = acme_key
    assert KEY_RE.match(raw)
    assert raw.startswith(f"tsk_{key.prefix}_")
    assert len(raw.split("_", 2)[2]) >= 32


def test_only_the_prefix_and_a_salted_hash_are_stored(session, acme_key):
    key, raw = acme_key
    secret = raw.split("_", 2)[2]
    row = session.execute(select(ApiKey.__table__)).one()
    stored = " ".join(str(v) for v in row)
    assert secret not in stored and raw not in stored
    assert key.hash == hashlib.sha256(bytes.fromhex(key.salt) + raw.encode()).hexdigest()
    assert key.hash != hashlib.sha256(raw.encode()).hexdigest()  # salted


def test_every_key_gets_its_own_salt_and_secret(session, acme_key):
    keys = [tenancy.create_key(session, "acme") for _ in range(5)] + [acme_key]
    assert len({k.salt for k, _ in keys}) == 6
    assert len({raw for _, raw in keys}) == 6
    assert len({k.prefix for k, _ in keys}) == 6


def test_a_valid_key_identifies_its_tenant_and_scopes(session, acme_key):
    key, raw = acme_key
    verified = auth.verify_key(session, raw)
    assert verified is not None
    assert (verified.id, verified.tenant.name) == (key.id, "acme")
    assert verified.has_scope(SCOPE_INFERENCE) and not verified.has_scope(SCOPE_ADMIN)
    _, admin_raw = tenancy.create_key(session, "acme", scopes=[SCOPE_INFERENCE, SCOPE_ADMIN])
    assert auth.verify_key(session, admin_raw).has_scope(SCOPE_ADMIN)


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "",
        "tsk_",
        "Bearer tsk_abcdefgh_" + "a" * 43,
        "tsk_ABCDEFGH_" + "a" * 43,  # prefixes are lowercase
        "tsk_abcdefg_" + "a" * 43,  # prefix too short
        "tsk_abcdefgh_" + "a" * 31,  # secret too short
        "tsk_abcdefgh_" + "a" * 40 + "!",
        "sk-abcdefgh_" + "a" * 43,
        "tsk_abcdefgh_" + "a" * 43 + "\n",
    ],
)
def test_malformed_keys_are_refused_without_a_database_query(session, queries, raw):
    assert auth.verify_key(session, raw) is None
    assert queries == []


def test_unknown_and_wrong_keys_are_refused_alike(session, acme_key):
    key, raw = acme_key
    wrong_secret = f"tsk_{key.prefix}_" + "x" * 43
    unknown_prefix = "tsk_zzzzzzzz_" + raw.split("_", 2)[2]
    assert auth.verify_key(session, wrong_secret) is None
    assert auth.verify_key(session, unknown_prefix) is None
    assert auth.verify_key(session, raw[:-1] + ("A" if raw[-1] != "A" else "B")) is None


def test_an_unknown_prefix_still_compares_a_hash_in_constant_time(session, acme_key, monkeypatch):
    # Both failures run one hmac.compare_digest over a freshly computed hash, so timing can't reveal
    # whether the prefix exists.
    key, _ = acme_key
    calls: list[tuple[str, str]] = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    auth.verify_key(session, f"tsk_{key.prefix}_" + "x" * 43)
    auth.verify_key(session, "tsk_zzzzzzzz_" + "x" * 43)
    assert len(calls) == 2
    assert all(len(a) == len(b) == 64 for a, b in calls)


def test_a_revoked_key_stops_working_at_once_even_when_cached(session, acme_key):
    key, raw = acme_key
    assert auth.verify_key(session, raw) is not None  # now cached
    tenancy.revoke_key(session, f"tsk_{key.prefix}")
    assert auth.verify_key(session, raw) is None
    assert tenancy.get_key(session, key.prefix).revoked_at is not None


def test_revoking_accepts_the_bare_prefix_or_the_whole_key(session, acme_key):
    key, raw = acme_key
    assert tenancy.revoke_key(session, raw).id == key.id
    assert tenancy.revoke_key(session, key.prefix).revoked  # revoking twice is harmless
    with pytest.raises(NotFound, match="no API key with prefix 'zzzzzzzz'"):
        tenancy.revoke_key(session, "tsk_zzzzzzzz")


def test_keys_of_a_disabled_tenant_stop_working_until_it_is_enabled(session, acme_key):
    _, raw = acme_key
    assert auth.verify_key(session, raw) is not None
    tenancy.set_tenant_disabled(session, "acme", True)
    assert auth.verify_key(session, raw) is None
    tenancy.set_tenant_disabled(session, "acme", False)
    assert auth.verify_key(session, raw) is not None


def test_the_hot_path_reads_the_database_once_per_ttl(session, acme_key, queries):
    _, raw = acme_key
    for _ in range(20):
        assert auth.verify_key(session, raw) is not None
    assert len(queries) == 1


def test_cached_keys_expire_after_the_ttl(session, acme_key, queries, monkeypatch):
    _, raw = acme_key
    clock = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: clock[0])
    cache = auth.KeyCache(ttl_s=30)
    auth.verify_key(session, raw, cache=cache)
    clock[0] += 29
    auth.verify_key(session, raw, cache=cache)
    assert len(queries) == 1
    clock[0] += 2
    auth.verify_key(session, raw, cache=cache)
    assert len(queries) == 2


def test_the_cache_is_bounded(session, acme_key):
    cache = auth.KeyCache(max_entries=3)
    raws = [tenancy.create_key(session, "acme")[1] for _ in range(5)]
    for raw in raws:
        assert auth.verify_key(session, raw, cache=cache) is not None
    assert len(cache) == 3


def test_a_verified_key_stays_readable_after_its_session_closes(engine, acme_key):
    _, raw = acme_key
    with db.session_factory(engine)() as other:
        verified = auth.verify_key(other, raw)
    assert verified.tenant.name == "acme" and verified.scope_list == [SCOPE_INFERENCE]


def test_creating_keys_refuses_unknown_tenants_and_scopes(session, acme_key):
    with pytest.raises(NotFound, match="no tenant named 'nobody'"):
        tenancy.create_key(session, "nobody")
    with pytest.raises(InvalidConfig, match="invalid scopes.*choose from inference, admin"):
        tenancy.create_key(session, "acme", scopes=["root"])


def test_list_keys_shows_a_tenants_keys_in_creation_order(session, acme_key):
    tenancy.create_tenant(session, "other")
    tenancy.create_key(session, "other")
    second, _ = tenancy.create_key(session, "acme", name="second")
    assert [k.name for k in tenancy.list_keys(session, "acme")] == ["ci", "second"]
    assert [k.id for k in tenancy.list_keys(session, "acme", limit=1, offset=1)] == [second.id]


# --- every API process: revocation, disabling and expiry reach all of them within a second ------------------

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SECRET = "auth-test-server-secret-" + uuid.uuid4().hex
PROPAGATION_S = 1.0  # the promise: a revoked, disabled or expired key is refused everywhere within this


@pytest.fixture(scope="module")
def redis_client():
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    client.ping()  # CI runs Redis; a missing one is a broken environment, not a reason to skip
    yield client
    client.close()


@pytest.fixture
def key_version(redis_client):
    """A key-version counter of this test's own, so other tests' key changes can't disturb the counts."""
    name = f"tessera:test:key-version:{uuid.uuid4().hex}"
    yield auth.KeyVersion(redis_client, name)
    redis_client.delete(name)


@dataclass
class ApiProcesses:
    database_url: str
    env: dict[str, str]
    urls: list[str]
    logs: list[Path]

    def status(self, url: str, raw: str) -> int:
        return httpx.get(
            f"{url}/v1/models", headers={"Authorization": f"Bearer {raw}"}, timeout=5
        ).status_code

    def refused_everywhere_within(self, raw: str, limit_s: float) -> list[float]:
        """Seconds until each process first answered 401 (polling until twice the limit)."""
        start = time.monotonic()
        seen: dict[str, float] = {}
        while len(seen) < len(self.urls) and time.monotonic() - start < 2 * limit_s:
            for url in self.urls:
                if url not in seen and self.status(url, raw) == 401:
                    seen[url] = time.monotonic() - start
            time.sleep(0.02)
        return [seen.get(url, float("inf")) for url in self.urls]


@pytest.fixture(scope="module")
def api_processes(tmp_path_factory, redis_client):
    """Two `tessera api` processes (replicas) sharing one Redis and one SQLite database."""
    data = tmp_path_factory.mktemp("replicas")
    database_url = f"sqlite:///{data / 'tessera.db'}"
    db.upgrade(database_url)
    env = {
        **os.environ,
        "TESSERA_DATA_DIR": str(data),
        "TESSERA_DATABASE_URL": database_url,
        "TESSERA_REDIS_URL": REDIS_URL,
        "TESSERA_SECRET_KEY": SECRET,
        "TESSERA_RECORDS_STREAM": f"tessera:test:records:{uuid.uuid4().hex}",
    }
    try:
        with replica_processes(env, data) as replicas:
            yield ApiProcesses(database_url, env, replicas.urls, replicas.logs)
    finally:
        redis_client.delete(env["TESSERA_RECORDS_STREAM"])


@pytest.fixture
def replica_session(api_processes):
    engine = db.make_engine(api_processes.database_url)
    with db.session_factory(engine)() as session:
        yield session
    engine.dispose()


def _tenant_with_key(session, **key_options) -> tuple[str, ApiKey, str]:
    name = f"t-{uuid.uuid4().hex[:12]}"
    tenancy.create_tenant(session, name)
    key, raw = tenancy.create_key(session, name, **key_options)
    return name, key, raw


def test_a_key_revoked_with_the_cli_is_refused_by_every_api_process_within_a_second(
    api_processes, replica_session
):
    _, key, raw = _tenant_with_key(replica_session)
    assert [api_processes.status(url, raw) for url in api_processes.urls] == [200, 200]  # cached in both
    subprocess.run(
        [sys.executable, "-m", "tessera.cli", "keys", "revoke", key.prefix],
        env=api_processes.env,
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    assert max(api_processes.refused_everywhere_within(raw, PROPAGATION_S)) < PROPAGATION_S


def test_a_key_revoked_with_the_cli_under_tessera_up_reaches_its_redis_by_the_data_dir(
    api_processes, replica_session
):
    """`tessera up` passes its embedded Redis to its own processes only; the CLI, run beside it with just
    --data-dir, finds that Redis in the file the launcher writes there (here: the replicas' Redis)."""
    _, key, raw = _tenant_with_key(replica_session)
    assert [api_processes.status(url, raw) for url in api_processes.urls] == [200, 200]
    data_dir = Path(api_processes.env["TESSERA_DATA_DIR"])
    (data_dir / RUNNING_REDIS_FILE).write_text(REDIS_URL + "\n")
    env = {k: v for k, v in api_processes.env.items() if k != "TESSERA_REDIS_URL"}
    try:
        subprocess.run(
            [sys.executable, "-m", "tessera.cli", "keys", "revoke", key.prefix, "--data-dir", str(data_dir)],
            env=env,
            cwd=REPO,
            check=True,
            capture_output=True,
        )
    finally:
        (data_dir / RUNNING_REDIS_FILE).unlink()
    assert max(api_processes.refused_everywhere_within(raw, PROPAGATION_S)) < PROPAGATION_S


def test_a_disabled_tenants_keys_are_refused_by_every_api_process_within_a_second(
    api_processes, replica_session, redis_client
):
    name, _, raw = _tenant_with_key(replica_session)
    assert [api_processes.status(url, raw) for url in api_processes.urls] == [200, 200]
    tenancy.set_tenant_disabled(replica_session, name, True, version=auth.KeyVersion(redis_client))
    assert max(api_processes.refused_everywhere_within(raw, PROPAGATION_S)) < PROPAGATION_S
    tenancy.set_tenant_disabled(replica_session, name, False, version=auth.KeyVersion(redis_client))
    assert [api_processes.status(url, raw) for url in api_processes.urls] == [200, 200]


def test_an_expired_key_is_refused_by_every_api_process_within_a_second(api_processes, replica_session):
    expires_at = datetime.now(timezone.utc) + timedelta(seconds=1.5)
    _, _, raw = _tenant_with_key(replica_session, expires_at=expires_at)
    assert [api_processes.status(url, raw) for url in api_processes.urls] == [200, 200]
    time.sleep(max(0.0, (expires_at - datetime.now(timezone.utc)).total_seconds()))
    assert max(api_processes.refused_everywhere_within(raw, PROPAGATION_S)) < PROPAGATION_S


def test_the_api_processes_never_print_the_server_secret(api_processes, replica_session):
    _, _, raw = _tenant_with_key(replica_session)
    for url in api_processes.urls:
        assert api_processes.status(url, raw) == 200
        assert api_processes.status(url, "tsk_zzzzzzzz_" + "x" * 43) == 401
    for log in api_processes.logs:
        assert SECRET not in log.read_text()


# --- the key version: what a process checks on every request ---------------------------------------------


def test_a_key_change_in_another_process_drops_this_processs_cached_keys(
    session, acme_key, queries, key_version
):
    _, raw = acme_key
    cache = auth.KeyCache()
    assert auth.verify_key(session, raw, cache=cache, version=key_version) is not None
    assert auth.verify_key(session, raw, cache=cache, version=key_version) is not None
    assert len(queries) == 1  # the second call was served from the cache
    key_version.bump()  # what another process's revoke or disable does after its commit
    assert auth.verify_key(session, raw, cache=cache, version=key_version) is not None
    assert len(queries) == 2


def test_revoking_bumps_the_key_version_after_the_commit(session, acme_key, key_version):
    key, raw = acme_key
    before = key_version.current()
    cache = auth.KeyCache()
    assert auth.verify_key(session, raw, cache=cache, version=key_version) is not None
    tenancy.revoke_key(session, key.prefix, version=key_version)
    assert key_version.current() != before
    assert auth.verify_key(session, raw, cache=cache, version=key_version) is None


def test_an_unreachable_redis_bypasses_the_cache_instead_of_trusting_it(session, acme_key, queries):
    _, raw = acme_key
    down = auth.KeyVersion(redis.Redis(port=free_port(), socket_connect_timeout=0.5))
    cache = auth.KeyCache()
    for _ in range(3):  # nothing to compare cached keys against: every call reads the database
        assert auth.verify_key(session, raw, cache=cache, version=down) is not None
    assert len(queries) == 3
    assert len(cache) == 0


def test_an_expired_key_is_refused_even_from_the_cache(session, acme_key):
    tenancy.create_tenant(session, "soon")
    key, raw = tenancy.create_key(
        session, "soon", expires_at=datetime.now(timezone.utc) + timedelta(seconds=0.5)
    )
    cache = auth.KeyCache()
    assert auth.verify_key(session, raw, cache=cache) is not None
    assert len(cache) == 1
    time.sleep(max(0.0, (key.expires_at - datetime.now(timezone.utc)).total_seconds()) + 0.01)
    assert auth.verify_key(session, raw, cache=cache) is None


def test_a_key_cannot_be_created_already_expired(session, acme_key):
    with pytest.raises(InvalidConfig, match="expires_at .* is in the past"):
        tenancy.create_key(session, "acme", expires_at=datetime.now(timezone.utc) - timedelta(seconds=1))


async def read_bound(version: auth.KeyVersion) -> bytes | None:
    """``version.acurrent()`` on a loop ``version`` is bound to; its async client is closed after."""
    version.bind()
    try:
        return await version.acurrent()
    finally:
        await version.aredis.aclose()


def test_the_event_loop_reads_the_version_through_its_own_client_and_other_loops_through_a_thread(
    key_version,
):
    """``acurrent`` on the loop it was bound to uses the async client; anywhere else the sync one (in a
    thread), since an async connection belongs to the loop that opened it. Each client here sees a
    different Redis state, so the answer says which one was read."""
    import asyncio

    import redis.asyncio as aioredis

    key_version.bump()
    live = key_version.current()
    async_live = aioredis.Redis.from_url(REDIS_URL)
    sync_down = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    version = auth.KeyVersion(sync_down, key_version.name, aredis=async_live)

    assert asyncio.run(read_bound(version)) == live  # the async client, on its loop
    assert asyncio.run(version.acurrent()) is None  # another loop: the (unreachable) sync client


def test_the_cache_answers_without_the_database_only_under_the_version_it_was_filled_in(
    session, acme_key, key_version
):
    _, raw = acme_key
    cache = auth.KeyCache()
    current = key_version.current()
    assert auth.cached_key(raw, current, cache) is auth.MISS
    assert auth.verify_in_database(session, raw, current, cache) is not None
    assert auth.cached_key(raw, current, cache).prefix == acme_key[0].prefix
    assert auth.cached_key(raw, None, cache) is auth.MISS  # Redis could not say: ask the database
    key_version.bump()
    assert auth.cached_key(raw, key_version.current(), cache) is auth.MISS
    assert auth.cached_key("tsk_nope", current, cache) is None  # malformed: no database needed
    assert auth.cached_key(None, current, cache) is None


def test_an_unreachable_redis_on_the_bound_loop_reads_as_no_version(key_version):
    """The async read fails like the sync one: None, so the cache is not trusted and the database decides."""
    import asyncio

    import redis.asyncio as aioredis

    down = aioredis.Redis(port=free_port(), socket_connect_timeout=0.5)
    version = auth.KeyVersion(key_version.redis, key_version.name, aredis=down)

    assert asyncio.run(read_bound(version)) is None
    assert version.current() is not None  # the sync client (live) would have answered: the async one was read
