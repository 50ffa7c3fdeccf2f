"""The API server's limits against a real ``tessera api`` process (uvicorn on h11, tessera.server), as a
hostile client meets them: a header block over the cap, a body that never arrives, headers that never end,
idle connections past the connection limit, a client that leaves mid-body."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import time
import uuid

import httpx
import pytest
import redis
from api_processes import api_processes
from tessera import db, deployments, tenancy

from gpu_workers.protocol import STREAM_FIELD, Event, WorkerInfo, stream_key, worker_queue, workers_key

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
MAX_HEADER_BYTES = 16_384
TIMEOUT_S = 1.0  # the headers' and the body's deadlines, and keep-alive, in this process
MAX_CONNECTIONS = 8


class Api:
    def __init__(self, url: str, log: str, key: str):
        self.url, self.log_path, self.key = url, log, key
        self.port = int(url.rsplit(":", 1)[1])

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    data = tmp_path_factory.mktemp("limits")
    database_url = f"sqlite:///{data / 'tessera.db'}"
    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    with db.session_factory(engine)() as session:
        tenancy.create_tenant(session, "acme")
        _, key = tenancy.create_key(session, "acme")
    engine.dispose()
    env = {
        **os.environ,
        "TESSERA_DATA_DIR": str(data),
        "TESSERA_DATABASE_URL": database_url,
        "TESSERA_REDIS_URL": REDIS_URL,
        "TESSERA_SECRET_KEY": "limits-test-secret-" + uuid.uuid4().hex,
        "TESSERA_RECORDS_STREAM": f"tessera:test:records:{uuid.uuid4().hex}",
        "TESSERA_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
        "TESSERA_HEADER_TIMEOUT_S": str(TIMEOUT_S),
        "TESSERA_BODY_TIMEOUT_S": str(TIMEOUT_S),
        "TESSERA_KEEP_ALIVE_S": str(TIMEOUT_S),
        "TESSERA_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    }
    with api_processes(env, data, count=1) as replicas:
        yield Api(replicas.urls[0], str(replicas.logs[0]), key)


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """What the server sent until it closed the connection, and when (seconds); fails if it held it."""
    start, got = time.monotonic(), b""
    sock.settimeout(0.1)
    while time.monotonic() - start < limit_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got, time.monotonic() - start
        if not chunk:
            return got, time.monotonic() - start
        got += chunk
    raise AssertionError(f"the server still held the connection after {limit_s}s; it sent {got[:200]!r}")


def test_a_header_block_over_the_cap_is_refused_and_the_connection_closed(api):
    sock = api.connect()
    start = time.monotonic()
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (32 * MAX_HEADER_BYTES) + b"\r\n\r\n"
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed while we sent: refused early
        sock.sendall(big)
    got, _ = read_until_closed(sock, 5)
    assert got == b"" or got.startswith(b"HTTP/1.1 400 "), got[:200]
    assert time.monotonic() - start < 5
    # Headers under the cap still pass.
    ok = httpx.get(f"{api.url}/healthz", headers={"X-Fine": "a" * (MAX_HEADER_BYTES // 2)})
    assert ok.status_code == 200


def test_a_body_that_never_arrives_is_answered_408_and_the_connection_closed(api):
    sock = api.connect()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + api.key.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    got, held_s = read_until_closed(sock, 10 * TIMEOUT_S)
    assert got.startswith(b"HTTP/1.1 408 "), got[:300]
    assert b'"code":"request_timeout"' in got and b"x-request-id: req_" in got
    assert held_s < 10 * TIMEOUT_S


def test_headers_that_never_end_and_idle_connections_are_closed(api):
    silent, partial = api.connect(), api.connect()
    partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    for sock in (silent, partial):
        _, held_s = read_until_closed(sock, 10 * TIMEOUT_S)
        assert held_s < 10 * TIMEOUT_S
    kept = api.connect()  # a keep-alive connection after its response
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    got, held_s = read_until_closed(kept, 10 * TIMEOUT_S)
    assert got.startswith(b"HTTP/1.1 200 ") and held_s < 10 * TIMEOUT_S


def test_connections_beyond_the_limit_get_503_until_they_close(api):
    held = [api.connect() for _ in range(MAX_CONNECTIONS)]
    try:
        # The server holds them until their headers' deadline: meanwhile a new request is refused.
        assert httpx.get(f"{api.url}/healthz").status_code == 503
        for sock in held:
            read_until_closed(sock, 10 * TIMEOUT_S)
        assert httpx.get(f"{api.url}/healthz").status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_a_client_leaving_mid_body_is_not_logged_as_a_server_error(api):
    sock = api.connect()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + api.key.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    sock.close()
    deadline = time.monotonic() + 10
    while "the client left before sending its whole body" not in (log := api.log()):
        assert "Traceback" not in log, log[-3000:]
        assert time.monotonic() < deadline, f"the API never noticed the client leave:\n{log[-3000:]}"
        time.sleep(0.05)
    assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]


def test_sigterm_lets_a_stream_run_through_the_grace_period_then_ends_it_with_an_error_event(
    tmp_path, demo_model_dir
):
    """A `tessera api` of its own (SIGTERM ends it), with one live worker faked in Redis: the stream keeps
    flowing during the grace period, then ends with an error event and [DONE], never a silent cut; a request
    that has not answered yet gets 503."""
    grace_s = 1.5
    database_url = f"sqlite:///{tmp_path / 'tessera.db'}"
    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    model = f"@test/drain-{uuid.uuid4().hex[:8]}"
    with db.session_factory(engine)() as session:
        config = {
            "name": model,
            "checkpoint": str(demo_model_dir),
            "mode": "colocated",
            "max_model_len": 128,
            "max_tokens_limit": 32,
        }
        deployments.create_deployment(session, config, actor="test")
        tenancy.create_tenant(session, "acme")
        _, key = tenancy.create_key(session, "acme")
    engine.dispose()
    client = redis.Redis.from_url(REDIS_URL)
    worker = f"drain-{uuid.uuid4().hex[:8]}"
    info = WorkerInfo(worker, model, "serve", worker_queue(worker), "test", 0, time.time())
    client.hset(workers_key(model, "serve"), worker, info.to_json())
    env = {
        **os.environ,
        "TESSERA_DATA_DIR": str(tmp_path),
        "TESSERA_DATABASE_URL": database_url,
        "TESSERA_REDIS_URL": REDIS_URL,
        "TESSERA_SECRET_KEY": "drain-test-secret-" + uuid.uuid4().hex,
        "TESSERA_RECORDS_STREAM": f"tessera:test:records:{uuid.uuid4().hex}",
        "TESSERA_SHUTDOWN_GRACE_S": str(grace_s),
    }
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    try:
        with api_processes(env, tmp_path, count=1) as replicas:
            url, (process_log,) = replicas.urls[0], replicas.logs
            pending = concurrent.futures.ThreadPoolExecutor(1).submit(
                httpx.post, f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30
            )
            with httpx.stream(
                "POST",
                f"{url}/v1/chat/completions",
                json={**body, "stream": True},
                headers=headers,
                timeout=30,
            ) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # the role chunk
                pid = int(re.search(r"Started server process \[(\d+)\]", process_log.read_text()).group(1))
                signalled = time.monotonic()
                os.kill(pid, signal.SIGTERM)
                # During the grace period the stream still flows.
                token = Event(kind="token", token_ids=[100], text="Hello", worker_id=worker)
                client.xadd(stream_key(response.headers["x-request-id"]), {STREAM_FIELD: token.to_json()})
                payloads = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
                ended_s = time.monotonic() - signalled
        assert json.loads(payloads[0])["choices"][0]["delta"]["content"] == "Hello", payloads
        assert json.loads(payloads[1])["error"]["code"] == "server_shutting_down", payloads
        assert payloads[2:] == ["[DONE]"]
        assert grace_s <= ended_s < grace_s + 15  # ended by the drain, not by the test's own timeout
        refused = pending.result()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert refused.headers["retry-after"]
    finally:
        client.delete(workers_key(model, "serve"), env["TESSERA_RECORDS_STREAM"])
        client.close()
