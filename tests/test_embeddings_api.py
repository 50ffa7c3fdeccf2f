"""Embeddings through the gateway: OpenAI's /v1/embeddings and Workers AI's {"text"}, against real Redis and
SQLite, the real embedding worker code (EmbedRunner on all-MiniLM-L6-v2, in process) behind a fake Celery;
chat requests of the same tenants go to a scripted fake worker. Bad input, quotas, ledger, usage and meters."""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import pytest
import redis
from embedding_models import minilm_dir
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from tessera import auth, db, deployments, quota_config, records, tenancy
from tessera.app import create_app
from tessera.limits import Limits
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE
from tessera.settings import Settings

from billing.schema import LedgerEvent
from gpu_workers.encoder_checkpoint import EncoderTokenizer
from gpu_workers.engine.embedder import Embedder, EmbedderConfig
from gpu_workers.pools.embed import EmbedRunner
from gpu_workers.protocol import (
    STREAM_FIELD,
    TASK_EMBED,
    Event,
    GenerateTask,
    WorkerInfo,
    stream_key,
    worker_queue,
    workers_key,
)

REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@dataclass
class Pools:
    """Celery, faked: an embed task runs on the real EmbedRunner, a chat task gets three scripted tokens."""

    client: redis.Redis
    runner: EmbedRunner

    def send_task(self, name, args=None, queue=None, expires=None, **_):
        payload = args[0]
        target = self.runner.run if name == TASK_EMBED else self.chat
        threading.Thread(target=target, args=(payload,), daemon=True).start()

    def chat(self, payload: str) -> None:
        task = GenerateTask.from_json(payload)
        usage = {"prompt_tokens": len(task.prompt_ids), "cached_tokens": 0, "completion_tokens": 3}
        for event in (
            Event(kind="token", token_ids=[5, 6, 7], text="abc", worker_id="w"),
            Event(kind="final", finish_reason="length", usage=usage, worker_id="w"),
        ):
            self.client.xadd(stream_key(task.request_id), {STREAM_FIELD: event.to_json()})
        self.client.expire(stream_key(task.request_id), 60)

    def close(self) -> None:
        pass


@dataclass
class Stack:
    client: TestClient
    sessions: object
    settings: Settings
    embed: str
    chat: str
    keys: dict[str, str]  # tenant name -> raw key
    tenant_ids: dict[str, str]
    admin_key: str
    tokenizer: EncoderTokenizer
    offline: Embedder

    def auth(self, tenant: str = "acme") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def embeddings(self, tenant: str = "acme", **body):
        return self.client.post(
            "/v1/embeddings", headers=self.auth(tenant), json={"model": self.embed, **body}
        )

    def run(self, model: str, body: dict, tenant: str = "acme"):
        path = f"/accounts/{self.tenant_ids[tenant]}/ai/run/{model}"
        return self.client.post(path, headers=self.auth(tenant), json=body)


def heartbeat(client: redis.Redis, deployment: str, worker_id: str) -> None:
    info = WorkerInfo(worker_id, deployment, "serve", worker_queue(worker_id), "test", 0, time.time())
    client.hset(workers_key(deployment, "serve"), worker_id, info.to_json())


@pytest.fixture(scope="module")
def stack(tmp_path_factory, demo_model_dir):
    data = tmp_path_factory.mktemp("embeddings-api")
    checkpoint = minilm_dir(data / "models")
    settings = Settings(
        data_dir=data,
        redis_url=REDIS_URL,
        secret_key="embeddings-test-secret-" * 3,
        records_stream=f"tessera:test:embeddings:{uuid.uuid4().hex}",
    )
    db.upgrade(settings.database_url)
    sessions = db.session_factory(db.make_engine(settings.database_url))
    suffix = uuid.uuid4().hex[:8]
    embed, chat = f"@test/minilm-{suffix}", f"@test/chat-{suffix}"
    keys, tenant_ids = {}, {}
    with sessions() as session:
        deployments.create_deployment(
            session,
            {"name": embed, "checkpoint": str(checkpoint), "mode": "colocated", "max_num_seqs": 32},
            actor="t",
        )
        deployments.create_deployment(
            session,
            {
                "name": chat,
                "checkpoint": str(demo_model_dir),
                "mode": "colocated",
                "max_model_len": 128,
                "max_tokens_limit": 32,
            },
            actor="t",
        )
        for name in ("acme", "globex"):
            tenant_ids[name] = tenancy.create_tenant(session, name).id
            keys[name] = tenancy.create_key(session, name)[1]
        tenancy.create_tenant(session, "ops")
        admin_key = tenancy.create_key(session, "ops", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))[1]
    auth.key_cache.clear()
    client = redis.Redis.from_url(REDIS_URL)
    embedder = Embedder.from_pretrained(checkpoint, EmbedderConfig(dtype="float32", max_batch_inputs=32))
    embedder.start()
    workers = {embed: f"embed-{suffix}", chat: f"chat-{suffix}"}
    runner = EmbedRunner(embedder, client, None, worker_id=workers[embed])  # type: ignore[arg-type]
    app = create_app(settings)
    app.state.gateway.celery = Pools(client, runner)
    try:
        with TestClient(app) as test_client:
            for deployment, worker_id in workers.items():
                heartbeat(client, deployment, worker_id)
            yield Stack(
                test_client,
                sessions,
                settings,
                embed,
                chat,
                keys,
                tenant_ids,
                admin_key,
                EncoderTokenizer(checkpoint, 256),
                Embedder.from_pretrained(checkpoint, EmbedderConfig(dtype="float32")),
            )
    finally:
        embedder.stop()
        for deployment in workers:
            client.delete(workers_key(deployment, "serve"))
        client.delete(settings.records_stream, records.dead_letters(settings.records_stream))


@pytest.fixture
def gw(stack):
    for deployment, worker_id in (
        (stack.embed, f"embed-{stack.embed[-8:]}"),
        (stack.chat, f"chat-{stack.chat[-8:]}"),
    ):
        heartbeat(redis.Redis.from_url(REDIS_URL), deployment, worker_id)
    return stack


def expected(stack: Stack, texts: list[str]) -> np.ndarray:
    return stack.offline.embed([e.ids for e in stack.tokenizer.encode_batch(texts)]).numpy()


def assert_error(response, status: int, code: str, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    for word in words:
        assert word in error["message"], error["message"]
    return error


def test_the_openai_sdk_gets_each_inputs_vector_and_the_prompt_tokens(gw):
    from openai import OpenAI

    sdk = OpenAI(api_key=gw.keys["acme"], base_url="http://testserver/v1", http_client=gw.client)
    texts = ["A cat sat on the mat.", "Zürich → Genève ✈", "ok"]
    answer = sdk.embeddings.create(model=gw.embed, input=texts)  # the SDK asks for base64 and decodes it
    got = np.array([d.embedding for d in answer.data])
    assert [d.index for d in answer.data] == [0, 1, 2] and got.shape == (3, 384)
    assert np.allclose(got, expected(gw, texts), atol=1e-5)
    assert (
        answer.usage.prompt_tokens
        == answer.usage.total_tokens
        == sum(len(e.ids) for e in gw.tokenizer.encode_batch(texts))
    )
    one = sdk.embeddings.create(model=gw.embed, input="A cat sat on the mat.", encoding_format="float")
    assert np.allclose(one.data[0].embedding, got[0], atol=1e-6)
    assert answer.model == gw.embed


def test_token_id_inputs_are_embedded_as_given_and_the_usage_counts_them(gw):
    ids = [e.ids for e in gw.tokenizer.encode_batch(["hello world", "good morning to you"])]
    both = gw.embeddings(input=ids, encoding_format="float").json()
    single = gw.embeddings(input=ids[0], encoding_format="float").json()
    assert np.allclose([d["embedding"] for d in both["data"]], gw.offline.embed(ids).numpy(), atol=1e-5)
    assert np.allclose(single["data"][0]["embedding"], both["data"][0]["embedding"], atol=1e-6)
    assert both["usage"]["prompt_tokens"] == sum(map(len, ids)) and single["usage"]["prompt_tokens"] == len(
        ids[0]
    )
    assert both["usage"]["cost_details"]["output"] == 0.0


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ({"input": []}, "invalid_request", ("'input' is an empty list",)),
        ({"input": ["x"] * 2049}, "invalid_request", ("2049 items", "at most 2048")),
        ({"input": ["a", 3]}, "invalid_request", ("input[1] is a number", "strings only")),
        ({"input": ["a", ""]}, "invalid_request", ("input[1] is empty",)),
        ({"input": "x", "dimensions": 128}, "invalid_dimensions", ("384 dimensions", "omit 'dimensions'")),
        ({"input": "x", "encoding_format": "int8"}, "invalid_request", ("encoding_format",)),
        ({"input": [[1, 2], [40000]]}, "invalid_input", ("input[1]", "outside [0, 30522)")),
    ],
)
def test_bad_embedding_bodies_are_400_naming_what_to_fix(gw, body, code, words):
    assert_error(gw.embeddings(**body), 400, code, *words)


def test_an_over_long_input_is_refused_unless_truncate_and_then_cut_at_256_tokens(gw):
    long = " ".join(["word"] * 400)
    assert_error(
        gw.embeddings(input=["short", long]),
        400,
        "context_length_exceeded",
        "input[1]",
        "256 tokens",
        "'truncate': true",
    )
    cut = gw.embeddings(input=long, truncate=True, encoding_format="float").json()
    assert cut["usage"]["prompt_tokens"] == 256
    assert np.allclose(cut["data"][0]["embedding"], expected(gw, [long])[0], atol=1e-5)
    assert_error(gw.embeddings(input=[[101] * 300]), 400, "context_length_exceeded", "256")
    assert gw.embeddings(input=[[101] * 300], truncate=True).json()["usage"]["prompt_tokens"] == 256


def test_a_chat_model_asked_for_embeddings_and_an_embedding_model_asked_for_chat_are_400(gw):
    assert_error(
        gw.embeddings(model=gw.chat, input="x"), 400, "not_an_embedding_model", "does not serve embeddings"
    )
    chat = {"model": gw.embed, "messages": [{"role": "user", "content": "hi"}]}
    response = gw.client.post("/v1/chat/completions", headers=gw.auth(), json=chat)
    assert_error(response, 400, "embedding_model", "/v1/embeddings")
    run = gw.run(gw.embed, {"prompt": "hi"})
    assert run.status_code == 400 and "/v1/embeddings" in run.json()["errors"][0]["message"]


def test_workers_ai_text_gives_shape_and_data_in_its_envelope(gw):
    texts = ["first sentence", "second one, a little longer"]
    body = gw.run(gw.embed, {"text": texts}).json()
    assert body["success"] is True and body["errors"] == []
    result = body["result"]
    assert result["shape"] == [2, 384] and result["pooling"] == "mean"
    assert np.allclose(result["data"], expected(gw, texts), atol=1e-5)
    single = gw.run(gw.embed, {"text": "first sentence"}).json()["result"]
    assert single["shape"] == [1, 384] and np.allclose(single["data"][0], result["data"][0], atol=1e-6)
    empty = gw.run(gw.embed, {"text": []})
    assert empty.status_code == 400 and "'text' is an empty list" in empty.json()["errors"][0]["message"]
    long = gw.run(gw.embed, {"text": " ".join(["w"] * 300)})
    assert long.status_code == 400 and "truncate" in long.json()["errors"][0]["message"]
    assert gw.run(gw.embed, {"text": " ".join(["w"] * 300), "truncate_inputs": True}).status_code == 200


def test_the_embedding_model_is_listed_and_its_bodies_are_in_the_openapi_schema(gw):
    ids = [m["id"] for m in gw.client.get("/v1/models", headers=gw.auth()).json()["data"]]
    assert gw.embed in ids and gw.chat in ids
    schema = gw.client.get("/openapi.json").json()
    body = schema["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/EmbeddingRequest")
    assert {"EmbeddingRequest", "EmbeddingResponse", "TextEmbeddingRequest", "TextEmbeddingResult"} <= set(
        schema["components"]["schemas"]
    )


def test_an_embedding_request_over_the_tenants_tpm_is_429(gw):
    name = f"q-{uuid.uuid4().hex[:8]}"
    with gw.sessions() as session:
        tenancy.create_tenant(session, name)
        raw = tenancy.create_key(session, name)[1]
        quota_config.set_limits(session, name, Limits(tpm=10))
    headers = {"Authorization": f"Bearer {raw}"}
    ok = gw.client.post("/v1/embeddings", headers=headers, json={"model": gw.embed, "input": "a b c"})
    assert ok.status_code == 200, ok.text
    over = gw.client.post(
        "/v1/embeddings", headers=headers, json={"model": gw.embed, "input": "a b c d e f g h"}
    )
    assert_error(over, 429, "rate_limit_exceeded", "tokens per minute")


def scrape(stack: Stack) -> dict[tuple[str, tuple], float]:
    response = stack.client.get("/metrics", headers={"Authorization": f"Bearer {stack.admin_key}"})
    assert response.status_code == 200, response.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_ledger_usage_and_metrics_equal_what_two_tenants_were_told_for_chat_and_embeddings(gw):
    told: dict[tuple[str, str], list[int]] = {}  # (tenant, model) -> [prompt, output] tokens the answers said
    tenants = [f"mix-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    with gw.sessions() as session:
        for tenant in tenants:
            gw.tenant_ids[tenant] = tenancy.create_tenant(session, tenant).id
            gw.keys[tenant] = tenancy.create_key(session, tenant)[1]
    for tenant in tenants:
        for n in range(3):
            texts = [f"request {n} of {tenant}"] * (n + 1)
            usage = gw.embeddings(tenant, input=texts).json()["usage"]
            told.setdefault((tenant, gw.embed), [0, 0])[0] += usage["prompt_tokens"]
            chat = {"model": gw.chat, "messages": [{"role": "user", "content": f"hi {n}"}], "max_tokens": 3}
            usage = gw.client.post("/v1/chat/completions", headers=gw.auth(tenant), json=chat).json()["usage"]
            total = told.setdefault((tenant, gw.chat), [0, 0])
            total[0] += usage["prompt_tokens"]
            total[1] += usage["completion_tokens"]

    def ledger() -> dict[tuple[str, str], list[int]]:
        with gw.sessions() as session:
            rows = session.scalars(select(LedgerEvent).where(LedgerEvent.model.in_([gw.embed, gw.chat])))
            sums: dict[tuple[str, str], list[int]] = {}
            for row in rows:
                tenant = next((name for name, tid in gw.tenant_ids.items() if tid == row.tenant_id), "")
                total = sums.setdefault((tenant, row.model), [0, 0, 0])
                total[0] += row.cached_input_tokens + row.fresh_input_tokens
                total[1] += row.output_tokens
                total[2] += 1
            return sums

    deadline = time.monotonic() + 30
    while (
        ledger().get((tenants[1], gw.chat), [0, 0, 0])[2] < 3
        or ledger().get((tenants[1], gw.embed), [0])[-1] < 3
    ):
        assert time.monotonic() < deadline, ledger()
        time.sleep(0.1)
    sums = ledger()
    assert {k: v[:2] for k, v in sums.items() if k[0] in tenants} == told
    samples = scrape(gw)
    for (tenant, model), (prompt, output) in told.items():
        labels = {"tenant": gw.tenant_ids[tenant], "model": model}
        fresh = samples.get(("tessera_tokens_total", tuple(sorted({**labels, "kind": "fresh"}.items()))))
        out = samples.get(("tessera_tokens_total", tuple(sorted({**labels, "kind": "output"}.items()))), 0.0)
        assert (fresh, out) == (prompt, output), (tenant, model)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    for tenant in tenants:
        usage = gw.client.get(
            "/v1/usage", params={"start": day, "end": day, "group_by": "model"}, headers=gw.auth(tenant)
        ).json()["data"]
        by_model = {row["model"]: row for row in usage}
        embed = by_model[gw.embed]
        assert (
            embed["requests"] == 3
            and embed["fresh_input_tokens"] + embed["cached_input_tokens"] == told[(tenant, gw.embed)][0]
        )
        assert embed["output_tokens"] == 0
