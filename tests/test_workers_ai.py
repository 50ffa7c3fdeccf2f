"""Workers-AI REST (``/accounts/{id}/ai/run/{model}``) against the real app, Redis and SQLite, with
test_gateway's scripted worker pools: the envelope, SSE, numeric error codes, account isolation."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from tessera import quota_config, tenancy
from tessera.limits import Limits

# test_gateway's app fixture and the Redis it runs on; `name as name` re-exports them to pytest.
from tessera.models import RequestRecord
from test_gateway import fail, reply, sse_payloads, wait_for
from test_gateway import gw as gw
from test_gateway import redis_url as redis_url
from test_gateway import served as served
from test_gateway import stack as stack

from gpu_workers.protocol import worker_queue, workers_key

PREFIXES = ("", "/client/v4")


@pytest.fixture
def account(gw) -> str:
    with gw.sessions() as session:
        return tenancy.get_tenant(session, "acme").id


def run(gw, account: str, body: dict, model: str | None = None, prefix: str = "", key: str | None = None):
    path = f"{prefix}/accounts/{account}/ai/run/{model or gw.model}"
    return gw.client.post(path, headers=gw.auth(key), json=body)


def assert_envelope_error(response: httpx.Response, status: int, code: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["success"] is False and body["result"] is None and body["messages"] == []
    [error] = body["errors"]
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize(
    "body",
    [{"prompt": "Tell me a story"}, {"messages": [{"role": "user", "content": "Hi"}]}],
    ids=["prompt", "messages"],
)
def test_prompt_and_messages_answer_in_the_envelope(gw, account, prefix, body):
    gw.pools.script = reply(("Hello", ",", " world"), cached=2)
    response = run(gw, account, {**body, "max_tokens": 8, "temperature": 0.5, "seed": 7}, prefix=prefix)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"].startswith("req_")
    out = response.json()
    assert out["success"] is True and out["errors"] == [] and out["messages"] == []
    assert out["result"]["response"] == "Hello, world"
    [sent] = gw.pools.sent
    usage = out["result"]["usage"]
    tokens = {k: v for k, v in usage.items() if not k.startswith("cost")}  # cost: tested with billing
    assert tokens == {
        "prompt_tokens": len(sent.task.prompt_ids),
        "completion_tokens": 3,
        "total_tokens": len(sent.task.prompt_ids) + 3,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    # The sampling options reached the worker as on the OpenAI routes.
    assert sent.task.sampling.max_tokens == 8
    assert sent.task.sampling.temperature == 0.5
    assert sent.task.sampling.seed == 7
    assert sent.task.tenant == account


def test_messages_use_the_chat_template_like_v1(gw, account):
    run(gw, account, {"messages": [{"role": "user", "content": "Hi"}]})
    gw.chat("Hi")
    workers_ai, openai = gw.pools.sent
    assert workers_ai.task.prompt_ids == openai.task.prompt_ids


def test_stream_sends_response_events_then_done(gw, account):
    gw.pools.script = reply(("Hel", "lo"), cached=1)
    with gw.client.stream(
        "POST",
        f"/accounts/{account}/ai/run/{gw.model}",
        headers=gw.auth(),
        json={"prompt": "Hi", "stream": True},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    payloads = sse_payloads(text)
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    # Tokens that reach the gateway together go out as one event: the text is what must arrive, in order.
    texts = [e["response"] for e in events]
    assert "".join(texts[:-1]) == "Hello" and all(texts[:-1]) and texts[-1] == ""
    assert all(set(e) == {"response"} for e in events[:-1])
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 2 and usage["prompt_tokens_details"] == {"cached_tokens": 1}


def test_a_worker_error_mid_stream_is_an_envelope_event(gw, account):
    gw.pools.script = fail("worker_lost", "gone", after=("a",))
    with gw.client.stream(
        "POST",
        f"/accounts/{account}/ai/run/{gw.model}",
        headers=gw.auth(),
        json={"prompt": "Hi", "stream": True},
    ) as response:
        text = response.read().decode()
    payloads = sse_payloads(text)
    assert json.loads(payloads[0]) == {"response": "a"}
    error = json.loads(payloads[1])
    assert error["success"] is False and error["errors"][0]["code"] == 3040
    assert payloads[-1] == "[DONE]"


@pytest.mark.parametrize("prefix", PREFIXES)
def test_another_account_is_a_404_that_says_nothing_more(gw, account, prefix):
    with gw.sessions() as session:
        other = tenancy.get_tenant(session, "globex").id
    real = assert_envelope_error(run(gw, other, {"prompt": "Hi"}, prefix=prefix), 404, 7003)
    made_up = assert_envelope_error(run(gw, "f" * 32, {"prompt": "Hi"}, prefix=prefix), 404, 7003)
    assert real["message"].replace(other, "X") == made_up["message"].replace("f" * 32, "X")
    assert gw.pools.sent == []


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]},
        {"prompt": 5},
        {"prompt": "Hi", "temperature": "hot"},
        {"prompt": "Hi", "max_tokens": 0},
        {"messages": [{"role": "wizard", "content": "Hi"}]},
    ],
    ids=["empty", "both", "prompt-not-text", "temperature-not-number", "max-tokens-0", "bad-role"],
)
def test_bad_bodies_are_400_with_5007(gw, account, body):
    assert_envelope_error(run(gw, account, body), 400, 5007)
    assert gw.pools.sent == []


@pytest.mark.parametrize(
    ("name", "value"),
    [("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0)],
)
def test_penalties_out_of_range_are_400_naming_the_parameter(gw, account, name, value):
    error = assert_envelope_error(run(gw, account, {"prompt": "Hi", name: value}), 400, 5007)
    assert name in error["message"]
    assert gw.pools.sent == []


@pytest.mark.parametrize(
    "body",
    [{"prompt": "Tell me a story"}, {"messages": [{"role": "user", "content": "Hi"}]}],
    ids=["prompt", "messages"],
)
def test_penalties_reach_the_worker(gw, account, body):
    gw.pools.script = reply(("Hello",))
    penalties = {"frequency_penalty": 0.7, "presence_penalty": 1.25, "repetition_penalty": 1.1}
    response = run(gw, account, {**body, **penalties})
    assert response.status_code == 200, response.text
    s = gw.pools.sent[-1].task.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.7, 1.25, 1.1)


def test_invalid_json_is_400_with_5007(gw, account):
    response = gw.client.post(
        f"/accounts/{account}/ai/run/{gw.model}",
        headers={**gw.auth(), "content-type": "application/json"},
        content=b"{not json",
    )
    assert_envelope_error(response, 400, 5007)


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain", None], ids=["curl-d", "text", "none"]
)
def test_a_json_body_runs_whatever_its_content_type(gw, account, content_type):
    """curl -d (README's example) declares form encoding: Workers AI reads the body as JSON regardless."""
    gw.pools.script = reply(("Hello",))
    headers = {**gw.auth(), **({"content-type": content_type} if content_type else {})}
    response = gw.client.post(
        f"/accounts/{account}/ai/run/{gw.model}", headers=headers, content=json.dumps({"prompt": "Hi"})
    )
    assert response.status_code == 200, response.text
    assert response.json()["result"]["response"] == "Hello"


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-www-form-urlencoded", b"prompt=Hi"),
        ("application/json", b'{"prompt": "\xff"}'),
        ("text/plain", b"{not json"),
    ],
    ids=["form-fields", "not-utf8", "text-not-json"],
)
def test_a_body_that_does_not_parse_is_400_in_the_envelope(gw, account, content_type, body):
    response = gw.client.post(
        f"/accounts/{account}/ai/run/{gw.model}",
        headers={**gw.auth(), "content-type": content_type},
        content=body,
    )
    error = assert_envelope_error(response, 400, 5007)
    assert "JSON" in error["message"], error
    assert gw.pools.sent == []


def test_unknown_model_is_5018(gw, account):
    assert_envelope_error(run(gw, account, {"prompt": "Hi"}, model="@cf/meta/nope"), 404, 5018)


def test_bad_key_is_401_with_10000(gw, account):
    assert_envelope_error(run(gw, account, {"prompt": "Hi"}, key="not-a-key"), 401, 10000)


def test_too_long_for_the_context_is_3006(gw, account):
    assert_envelope_error(run(gw, account, {"prompt": "word " * 300}), 400, 3006)


def test_no_live_worker_is_503_with_3040(gw, account):
    gw.pools.redis.delete(workers_key(gw.model, "prefill"), workers_key(gw.model, "decode"))
    response = run(gw, account, {"prompt": "Hi"})
    assert_envelope_error(response, 503, 3040)
    assert response.headers["retry-after"]


def test_requests_are_recorded_like_v1(gw, account):
    response = run(gw, account, {"prompt": "Hi"})
    assert response.status_code == 200
    rid = response.headers["x-request-id"]

    def record():
        with gw.sessions() as session:
            return session.get(RequestRecord, rid)

    row = wait_for(record, 10)
    assert row.tenant_id == account


def test_schema_lists_the_routes_and_models(gw):
    schema = gw.client.get("/openapi.json").json()
    assert "/client/v4/accounts/{account_id}/ai/run/{model}" in schema["paths"]
    assert "/accounts/{account_id}/ai/run/{model}" in schema["paths"]
    assert {"RunRequest", "RunEnvelope"} <= set(schema["components"]["schemas"])


def test_a_cloudflare_style_client_works_on_client_v4(stack, served):
    """A plain httpx client over real HTTP, written as Cloudflare's REST docs show the API: base URL
    ``.../client/v4/accounts/{account_id}/ai/run/``, a Bearer token, prompt, messages and stream."""
    base, pools = served
    pools.script = reply(("Hi", " there"))
    with stack.sessions() as session:
        account_id = tenancy.get_tenant(session, "acme").id
    api = httpx.Client(
        base_url=f"{base}/client/v4/accounts/{account_id}/ai/run/",
        headers={"Authorization": f"Bearer {stack.key}"},
    )
    with api:
        chat = {
            "messages": [
                {"role": "system", "content": "You are a friendly assistant"},
                {"role": "user", "content": "Why is pizza so good"},
            ]
        }
        for body in (chat, {"prompt": "Tell me a joke about Cloudflare"}):
            response = api.post(stack.model, json=body)
            assert response.status_code == 200, response.text
            out = response.json()
            assert out["success"] is True and out["errors"] == []
            assert out["result"]["response"] == "Hi there"
            assert out["result"]["usage"]["total_tokens"] > 0
        text = ""
        with api.stream("POST", stack.model, json={**chat, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[len("data: ") :])["response"]
                elif line == "data: [DONE]":
                    break
        assert text == "Hi there"


def test_quotas_apply_as_on_v1_and_a_rejection_is_429_with_3036(gw):
    name = f"wai-{uuid.uuid4().hex[:8]}"  # a fresh tenant: its quota counters start empty
    with gw.sessions() as session:
        tenant_id = tenancy.create_tenant(session, name).id
        _, key = tenancy.create_key(session, name)
        quota_config.set_limits(session, name, Limits(rpm=1))
    first = run(gw, tenant_id, {"prompt": "Hi"}, key=key)
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-requests"] == "1"
    assert first.headers["x-ratelimit-remaining-requests"] == "0"
    second = run(gw, tenant_id, {"prompt": "Hi"}, key=key)
    assert_envelope_error(second, 429, 3036)
    assert int(second.headers["retry-after"]) >= 1
    assert len(gw.pools.sent) == 1


def test_reject_if_busy_in_options_is_429_with_3040_when_the_queue_is_full(gw, account):
    queue = worker_queue(gw.worker("prefill"))
    gw.pools.redis.delete(queue)
    gw.pools.redis.rpush(queue, *["waiting"] * gw.settings.max_queue_depth)
    try:
        busy = run(gw, account, {"prompt": "Hi", "options": {"rejectIfBusy": True}})
        waited = run(gw, account, {"prompt": "Hi"})
    finally:
        gw.pools.redis.delete(queue)
    assert_envelope_error(busy, 429, 3040)
    assert_envelope_error(waited, 503, 3040)
