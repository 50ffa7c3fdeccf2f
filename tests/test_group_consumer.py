"""billing.streams.GroupConsumer's failure paths on real Redis: an entry ``write`` cannot store is moved to
the dead-letter stream while the rest of its batch is stored; a failure of every row is retried, never
dead-lettered; a transient database error leaves the batch pending; a dead letter's reason is cut at a
character boundary."""

from __future__ import annotations

import os
import uuid

import pytest
import redis
from sqlalchemy.exc import OperationalError

from billing.streams import REASON_BYTES, GroupConsumer

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


class Recorder(GroupConsumer[str]):
    """Stores payloads in a list; ``refuse`` says which payloads ``write`` raises for, and with what."""

    label = "test consumer"

    def __init__(self, *args, refuse=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.stored: list[str] = []
        self.refuse = refuse or (lambda item: None)

    def parse(self, raw: bytes) -> str:
        return raw.decode()

    def write(self, items: list[str]) -> None:
        for item in items:
            error = self.refuse(item)
            if error is not None:
                raise error
        self.stored += items


@pytest.fixture
def client():
    c = redis.Redis.from_url(REDIS_URL)
    c.ping()
    return c


@pytest.fixture
def streams(client):
    name = f"test-group-{uuid.uuid4().hex[:8]}"
    yield name, f"{name}:dead"
    client.delete(name, f"{name}:dead")


def consumer(client, streams, refuse=None, **kw) -> Recorder:
    stream, dead = streams
    return Recorder(client, None, stream, group="g", dead_stream=dead, maxlen=1000, refuse=refuse, **kw)


def publish(client, stream: str, payloads: list[str]) -> None:
    for payload in payloads:
        client.xadd(stream, {b"outcome": payload.encode()})


def test_an_entry_write_refuses_is_dead_lettered_and_the_rest_of_its_batch_stored(client, streams):
    stream, dead = streams
    publish(client, stream, ["a", "poison", "b", "c"])
    reader = consumer(client, streams, refuse=lambda item: KeyError("no price") if item == "poison" else None)
    assert reader.drain() == 4
    assert reader.stored == ["a", "b", "c"]
    letters = client.xrange(dead)
    assert [fields[b"outcome"] for _, fields in letters] == [b"poison"]
    assert b"KeyError" in letters[0][1][b"reason"] and b"no price" in letters[0][1][b"reason"]
    assert client.xpending(stream, "g")["pending"] == 0


def test_when_every_row_fails_the_batch_stays_pending_and_is_stored_once_the_cause_is_fixed(client, streams):
    stream, dead = streams
    publish(client, stream, ["a", "b"])
    broken = consumer(client, streams, refuse=lambda item: RuntimeError("relation does not exist"))
    with pytest.raises(RuntimeError):
        broken.drain()
    assert client.xlen(dead) == 0 and client.xpending(stream, "g")["pending"] == 2
    fixed = consumer(client, streams)
    fixed.consumer = broken.consumer  # the same process after the fix: its own pending entries come first
    assert fixed.drain() == 2 and fixed.stored == ["a", "b"]
    assert client.xlen(dead) == 0 and client.xpending(stream, "g")["pending"] == 0


def test_a_lone_entry_that_always_fails_is_moved_aside_after_its_last_delivery(client, streams):
    stream, dead = streams
    publish(client, stream, ["poison"])
    reader = consumer(client, streams, refuse=lambda item: KeyError("no price"), max_deliveries=3)
    for _ in range(2):  # alone in its batch it could be the database's fault: retried
        with pytest.raises(KeyError):
            reader.drain()
        assert client.xlen(dead) == 0 and client.xpending(stream, "g")["pending"] == 1
    reader.drain()  # the third delivery fails too: it goes aside, and the consumer reads on
    ((_, fields),) = client.xrange(dead)
    assert fields[b"outcome"] == b"poison" and b"3 deliveries" in fields[b"reason"]
    assert client.xpending(stream, "g")["pending"] == 0
    publish(client, stream, ["next"])
    reader.refuse = lambda item: None
    assert reader.drain() == 1 and reader.stored == ["next"]


def test_a_transient_database_error_is_retried_not_dead_lettered(client, streams):
    stream, dead = streams
    publish(client, stream, ["a", "b"])
    away = OperationalError("INSERT", {}, ConnectionRefusedError("database is away"))
    reader = consumer(client, streams, refuse=lambda item: away if item == "b" else None, max_deliveries=1)
    for _ in range(3):  # however often: the database is away, the rows are not wrong
        with pytest.raises(OperationalError):
            reader.drain()
    assert reader.stored == [] and client.xlen(dead) == 0
    assert client.xpending(stream, "g")["pending"] == 2


class SQLState(Exception):
    def __init__(self, sqlstate: str):
        super().__init__(f"SQLSTATE {sqlstate}")
        self.sqlstate = sqlstate


def test_transience_follows_the_sqlstate_class_not_the_exception_class():
    from billing.streams import transient

    assert transient(OperationalError("INSERT", {}, SQLState("08006")))  # connection failure
    assert transient(OperationalError("INSERT", {}, SQLState("40P01")))  # deadlock detected
    assert not transient(OperationalError("INSERT", {}, SQLState("54000")))  # program limit: the row
    assert transient(OperationalError("INSERT", {}, Exception("database is locked")))  # SQLite: no code
    assert not transient(KeyError("no price"))


def test_a_dead_letters_reason_is_cut_at_a_character_boundary(client, streams):
    stream, dead = streams
    publish(client, stream, ["ok", "bad"])
    long = "é" * REASON_BYTES  # two bytes each: a byte cut would end inside one
    reader = consumer(client, streams, refuse=lambda item: ValueError(long) if item == "bad" else None)
    reader.drain()
    ((_, fields),) = client.xrange(dead)
    reason = fields[b"reason"]
    assert len(reason) <= REASON_BYTES
    assert reason.decode("utf-8").endswith("é")  # decodes: no half character at the end
