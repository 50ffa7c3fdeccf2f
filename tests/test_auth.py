"""API keys: shown once, stored as salted hashes, verified in constant time, cached briefly, revocable at once."""

from __future__ import annotations

import hashlib
import re

import pytest
from sqlalchemy import event, select
from tessera import auth, db, tenancy
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE, ApiKey

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
    with pytest.raises(tenancy.NotFound, match="no API key with prefix 'zzzzzzzz'"):
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
    assert len(cache._entries) == 3


def test_a_verified_key_stays_readable_after_its_session_closes(engine, acme_key):
    _, raw = acme_key
    with db.session_factory(engine)() as other:
        verified = auth.verify_key(other, raw)
    assert verified.tenant.name == "acme" and verified.scope_list == [SCOPE_INFERENCE]


def test_creating_keys_refuses_unknown_tenants_and_scopes(session, acme_key):
    with pytest.raises(tenancy.NotFound, match="no tenant named 'nobody'"):
        tenancy.create_key(session, "nobody")
    with pytest.raises(tenancy.InvalidConfig, match="invalid scopes.*choose from inference, admin"):
        tenancy.create_key(session, "acme", scopes=["root"])


def test_list_keys_shows_a_tenants_keys_in_creation_order(session, acme_key):
    tenancy.create_tenant(session, "other")
    tenancy.create_key(session, "other")
    second, _ = tenancy.create_key(session, "acme", name="second")
    assert [k.name for k in tenancy.list_keys(session, "acme")] == ["ci", "second"]
    assert [k.id for k in tenancy.list_keys(session, "acme", limit=1, offset=1)] == [second.id]
