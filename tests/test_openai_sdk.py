"""The official OpenAI Python SDK, unmodified, against a real ``tessera up`` (embedded Redis, SQLite, one
prefill and one decode worker): what a user of the platform does first.
"""

from __future__ import annotations

import json
import re
import signal
import time
from dataclasses import dataclass

import httpx
import openai
import pydantic
import pytest
import redis
from tessera import db, deployments, tenancy
from tessera.launcher import CHAT_MODEL, DEFAULT_MODEL
from tessera.settings import Settings
from test_launcher import assert_all_stopped, start_up, stop_up

from gpu_workers.protocol import WorkerInfo, cancel_key, stream_key, workers_key

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    up = start_up(tmp_path_factory.mktemp("sdk"))
    yield up
    assert stop_up(up, signal.SIGTERM) == 0, up.output
    assert_all_stopped(up)


@pytest.fixture(scope="module")
def client(up):
    # No retries: a 5xx must show up as one, not be hidden behind the SDK's backoff.
    return openai.OpenAI(base_url=f"{up.url}/v1", api_key=up.key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def spec(up):
    engine = db.make_engine(Settings(data_dir=up.data_dir).database_url)
    with db.session_factory(engine)() as session:
        spec = deployments.get_deployment(session, DEFAULT_MODEL).to_spec()
    engine.dispose()
    return spec


@dataclass
class Offline:
    """The offline engines in the two pools' configurations: the hand-off of ``tessera up`` in one process."""

    prefill: object
    decode: object
    decode_kv: str

    @property
    def tokenizer(self):
        return self.prefill.tokenizer

    def greedy(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str, str]:
        """(token ids, text, finish reason) as prefill (first token) then decode (the rest) produce them."""
        from gpu_workers import SamplingParams

        first = []
        self.prefill.add_request(
            prompt,
            SamplingParams(max_tokens=1, temperature=0),
            export_kv=self.decode_kv,
            on_event=first.append,
        )
        while self.prefill.has_unfinished():
            self.prefill.step()
        ids, text, finish = list(first[-1].token_ids), first[-1].text, first[-1].finish_reason
        if finish != "length" or max_tokens == 1:
            return ids, text, finish
        rest = []
        self.decode.add_request(
            prompt + ids,
            SamplingParams(max_tokens=max_tokens - 1, temperature=0),
            kv_import=first[-1].kv,
            on_event=rest.append,
        )
        while self.decode.has_unfinished():
            self.decode.step()
        ids += [t for e in rest for t in e.token_ids]
        return ids, text + "".join(e.text for e in rest), rest[-1].finish_reason


@pytest.fixture(scope="module")
def offline(spec, up):
    from gpu_workers import Engine
    from gpu_workers.pools.worker import engine_config

    secret = Settings(data_dir=up.data_dir).derive_key("prefix-cache")
    engines = (
        Engine.from_pretrained(spec.checkpoint, engine_config(spec, pool, secret))
        for pool in ("prefill", "decode")
    )
    return Offline(*engines, spec.decode_kv)


@pytest.fixture(scope="module")
def up_redis(up):
    return redis.Redis(unix_socket_path=up.redis_socket)


MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]
MAX_TOKENS = 1024  # the default deployment's max_tokens_limit: half the default model's 2,048-token context


def test_chat_completion_equals_the_offline_engine(client, offline):
    response = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=24, temperature=0
    )
    tokenizer = offline.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    ids, text, finish = offline.greedy(prompt, 24)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text
    assert choice.finish_reason == finish
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_chat_with_usage_equals_the_whole_response(client):
    whole = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=16, temperature=0
    )
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.completion_tokens == whole.usage.completion_tokens
    assert final.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_equals_the_offline_engine(client, offline):
    response = client.completions.create(
        model=DEFAULT_MODEL, prompt="def fib(n):", max_tokens=12, temperature=0
    )
    prompt = offline.tokenizer.encode("def fib(n):")  # text prompts get BOS, as in the offline engine
    ids, text, _ = offline.greedy(prompt, 12)
    assert response.choices[0].text == text
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), len(ids))
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_seeded_sampling_is_repeatable(client):
    def sample() -> str:
        response = client.completions.create(
            model=DEFAULT_MODEL, prompt="import os", max_tokens=12, temperature=1.0, seed=1234
        )
        return response.choices[0].text

    assert sample() == sample()


def test_shared_prefix_with_the_same_affinity_reports_cached_tokens(client, offline):
    from gpu_workers import SamplingParams

    prompts = ["import os\n" * 40 + "a = 1", "import os\n" * 40 + "b = 2"]
    headers = {"x-session-affinity": "sdk-session-1"}
    served = [
        client.completions.create(
            model=DEFAULT_MODEL, prompt=p, max_tokens=2, temperature=0, extra_headers=headers
        )
        for p in prompts
    ]
    # The prefill engine offline, on the same prompts in the same order, for one tenant.
    computed = [
        offline.prefill.generate([p], SamplingParams(max_tokens=1, temperature=0), tenant="sdk")[
            0
        ].cached_tokens
        for p in prompts
    ]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in served]
    assert cached[0] == 0 and cached[1] > 0
    assert cached == computed


def long_system_prompt(tokenizer, tokens: int) -> str:
    """A system message of about ``tokens`` tokens (a project's coding rules, as a long shared prompt is)."""
    rules = [
        "Write functions that do one thing and name them for what they return.",
        "Every public function has a docstring that says what it returns and what it raises.",
        "Prefer pathlib to os.path, f-strings to format(), and dataclasses to bare tuples.",
        "Raise ValueError with a message that says what to fix; never return None for an error.",
        "Keep modules under five hundred lines; split by responsibility, not by size.",
    ]
    lines: list[str] = []
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < tokens:
        lines.append(f"Rule {len(lines) + 1}: {rules[len(lines) % len(rules)]}")
    return "\n".join(lines)


def test_a_long_shared_system_prompt_is_served_from_the_prefix_cache(client, offline):
    """The prefix cache's reason to exist: a ~1,500-token system prompt shared by two chats of one tenant."""
    system = {"role": "system", "content": long_system_prompt(offline.tokenizer, 1500)}
    chats = [[system, {"role": "user", "content": head}] for head in ("def load(path):", "class Cache:")]
    headers = {"x-session-affinity": "sdk-long-system-prompt"}
    served = [
        client.chat.completions.create(
            model=DEFAULT_MODEL, messages=chat, max_tokens=8, temperature=0, extra_headers=headers
        )
        for chat in chats
    ]
    prompt_tokens = [r.usage.prompt_tokens for r in served]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in served]
    assert min(prompt_tokens) >= 1500, prompt_tokens
    assert cached[0] == 0
    assert cached[1] >= 1400, (cached, prompt_tokens)
    # Only the shared part can hit: full pages of the system prompt, never the second chat's own code.
    assert cached[1] <= prompt_tokens[1] - len(
        offline.tokenizer.encode("class Cache:", add_special_tokens=False)
    )


# -- bad input: 4xx OpenAI errors, never 5xx -----------------------------------------------------------------


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="@nobody/nothing", messages=MESSAGES)
    assert info.value.code == "model_not_found"


def test_max_tokens_over_the_limit_and_prompt_over_the_context_are_bad_requests(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=100_000)
    assert info.value.code == "max_tokens_too_large"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=DEFAULT_MODEL, prompt="word " * 10_000)  # past 8,192 tokens
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user"}], temperature="hot")


@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "@tessera/demo", "messages": [',
        b'{"model": "\xff"}',
        b"{}",
        b'{"model": 1, "messages": 2}',
    ],
    ids=["malformed-json", "invalid-utf8", "missing-fields", "wrong-types"],
)
def test_raw_bad_bodies_are_400(up, content):
    response = httpx.post(
        f"{up.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {up.key}", "Content-Type": "application/json"},
        content=content,
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_text_the_tokenizer_cannot_encode_is_400_on_the_real_platform(up, stream):
    # json.dumps escapes the lone surrogate as \ud800, as any JSON client may; httpx's json= cannot.
    body = json.dumps({"model": DEFAULT_MODEL, "prompt": "def f():\ud800", "stream": stream})
    response = httpx.post(
        f"{up.url}/v1/completions",
        headers={"Authorization": f"Bearer {up.key}", "Content-Type": "application/json"},
        content=body.encode(),
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "surrogate" in error["message"]


def test_penalties_reach_the_engine_through_both_pools_and_out_of_range_is_refused(client):
    # A prompt the model greedily loops on: without a penalty it repeats the line to the end, so a penalty
    # that reaches the decode pool's sampler must break the loop. (A prompt without a loop is no test: in
    # some compute dtypes the model's margins there are wider than any allowed penalty.)
    def greedy(**penalties) -> str:
        reply = client.completions.create(
            model=DEFAULT_MODEL, prompt="0, 0, 0, 0, 0, 0, 0, 0,", max_tokens=24,
            temperature=0, extra_body={"ignore_eos": True, **penalties},
        )  # fmt: skip
        assert reply.usage.completion_tokens == 24
        return reply.choices[0].text

    plain = greedy()
    assert greedy() == plain  # greedy is deterministic, so a difference below is the penalty's
    loops = plain.count("0,")
    assert loops >= 6, plain  # the loop the penalties must break
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.5}):
        assert greedy(**penalty).count("0,") < loops, penalty
    for name, value in (("presence_penalty", 2.5), ("frequency_penalty", -3)):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, **{name: value})
        assert info.value.param == name
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=DEFAULT_MODEL, messages=MESSAGES, extra_body={"repetition_penalty": 0}
        )
    assert info.value.param == "repetition_penalty"


def test_oversized_body_is_413(up):
    response = httpx.post(
        f"{up.url}/v1/completions",
        headers={"Authorization": f"Bearer {up.key}"},
        json={"model": DEFAULT_MODEL, "prompt": "x" * (2 * 2**20)},
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_bad_key_is_authentication_error(up):
    bad = openai.OpenAI(base_url=f"{up.url}/v1", api_key="tsk_nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_models_list(client):
    assert DEFAULT_MODEL in [m.id for m in client.models.list()]


def test_model_without_live_workers_is_503_fast(client, up, spec):
    engine = db.make_engine(Settings(data_dir=up.data_dir).database_url)
    with db.session_factory(engine)() as session:
        config = {"name": "@tessera/idle", "checkpoint": spec.checkpoint, "mode": "colocated"}
        deployments.create_deployment(session, config, actor="test")
    engine.dispose()
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="@tessera/idle", messages=MESSAGES)
    # Refused when routing finds no live worker, before anything is queued (the code says which refusal);
    # how fast is the machine's, not a thing a test on a shared machine holds.
    assert info.value.status_code == 503 and info.value.code == "no_live_worker"
    assert info.value.response.headers["Retry-After"] == "5"


# -- disconnects ------------------------------------------------------------------------------------------------


def test_client_disconnect_mid_stream_cancels_the_request_and_frees_its_pages(up, up_redis):
    # Greedy on this prompt loops without an end-of-text token, so only the disconnect can stop it early;
    # the default deployment's largest max_tokens, so that a fast machine cannot finish before the cancel.
    body = {
        "model": DEFAULT_MODEL,
        "prompt": "def main():",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{up.url}/v1/completions", headers={"Authorization": f"Bearer {up.key}"}, json=body
    ) as r:
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        for _ in range(8):
            next(lines)
    deadline = time.monotonic() + 5
    while not up_redis.exists(cancel_key(rid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert up_redis.exists(cancel_key(rid))

    def last_event() -> bytes:
        return up_redis.xrevrange(stream_key(rid), count=1)[0][1][b"event"]

    # The worker polls the cancel key between steps; on a loaded machine a step can take a while.
    deadline = time.monotonic() + 15
    while not re.search(rb'"finish_reason":"abort"|"kind":"error"', last_event()):
        assert time.monotonic() < deadline, f"no abort after the disconnect: {last_event()!r}"
        time.sleep(0.05)
    length = up_redis.xlen(stream_key(rid))
    time.sleep(0.5)
    assert up_redis.xlen(stream_key(rid)) == length < MAX_TOKENS  # the worker stopped generating

    def decode_pages() -> int:
        infos = [WorkerInfo.from_json(v) for v in up_redis.hvals(workers_key(DEFAULT_MODEL, "decode"))]
        return sum(i.kv_pages_used + i.running for i in infos if time.time() - i.last_seen < 10)

    deadline = time.monotonic() + 6  # the next heartbeats show the request gone
    while decode_pages() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert decode_pages() == 0


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)


def test_structured_output_parses_into_a_pydantic_model_streamed_and_not(client):
    # The SDK, unmodified: parse() sends a strict json_schema and parses the answer into the model.
    assert DEFAULT_MODEL == CHAT_MODEL, "the structured-output tests need the chat model's wheel"
    messages = [{"role": "user", "content": "Which city is the capital of France? Answer as JSON."}]
    parsed = client.chat.completions.parse(
        model=DEFAULT_MODEL, messages=messages, response_format=City, max_tokens=48, temperature=0
    )
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City), choice
    with client.chat.completions.stream(
        model=DEFAULT_MODEL, messages=messages, response_format=City, max_tokens=48, temperature=0
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == choice.message.parsed


def test_json_object_mode_answers_an_object_and_bad_schemas_are_400(client):
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "List two fruits as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut by max_tokens: reported as such, never as a finished object
        assert reply.choices[0].finish_reason == "length"
    bad = {
        "not a schema": ({"type": "strin"}, "invalid_json_schema"),
        "unenforceable": ({"type": "array", "uniqueItems": True}, "unsupported_json_schema"),
    }
    for schema, code in bad.values():
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=[{"role": "user", "content": "hi"}],
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            )
        assert caught.value.body["code"] == code and caught.value.body["param"].startswith("response_format")
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema"},
        )


def test_workers_ai_json_mode_returns_the_parsed_object(up):
    account = re.search(r"tenant '([\w-]+)' created", up.output).group(1)
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France? Answer as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": schema},
        "max_tokens": 32,
        "temperature": 0,
    }
    tenant_id = _tenant_id(up, account)
    reply = httpx.post(
        f"{up.url}/accounts/{tenant_id}/ai/run/{DEFAULT_MODEL}",
        json=body,
        headers={"Authorization": f"Bearer {up.key}"},
        timeout=60,
    ).json()
    assert reply["success"] and isinstance(reply["result"]["response"], dict), reply
    assert set(reply["result"]["response"]) == {"capital"}


def _tenant_id(up, name: str) -> str:
    engine = db.make_engine(Settings(data_dir=up.data_dir).database_url)
    with db.session_factory(engine)() as session:
        tenant = tenancy.get_tenant(session, name)
    engine.dispose()
    return tenant.id


def test_logprobs_streamed_equal_whole_and_spell_the_answer(client):
    kwargs = dict(
        model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    whole = client.chat.completions.create(**kwargs)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens
    spelled = b"".join(bytes(e.bytes) for e in entries).decode()
    assert spelled.startswith(whole.choices[0].message.content)  # an end-of-sequence token may follow it
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the most likely
        assert e.logprob == e.top_logprobs[0].logprob <= 0
        assert sum(2.718281828459045**t.logprob for t in e.top_logprobs) <= 1 + 1e-6
    streamed = [
        entry
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    # Without logprobs, none; top_logprobs alone or out of range is a 400 naming it.
    plain = client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None
    for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=2, **bad)


def test_completion_logprobs_in_the_legacy_form(client):
    response = client.completions.create(
        model=DEFAULT_MODEL, prompt="def fib(n):", max_tokens=8, temperature=0.8, seed=5, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == response.usage.completion_tokens == 8
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    assert all(
        len(top) <= 2 and max(top.values()) >= lp
        for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True)
    )
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=2, logprobs=21)


def test_n_choices_share_the_prompt_and_are_billed_as_the_sum_of_their_outputs(client, up_redis):
    from tessera.streaming import decode_entry

    prompt = "import os\n" * 30 + "def main():"
    kwargs = dict(model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=10, seed=7)
    kwargs.update(temperature=1.0, logprobs=True)
    whole = client.chat.completions.create(**kwargs, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    lengths = [len(c.logprobs.content) for c in whole.choices]
    assert whole.usage.completion_tokens == sum(lengths)
    one = client.chat.completions.create(**kwargs, max_completion_tokens=1)
    assert whole.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt billed once
    assert len({c.message.content for c in whole.choices}) > 1  # each choice draws with its own seed
    # Choices 1 and 2 ran after choice 0 had prefilled the prompt: all its full pages came from the cache.
    rid = whole.id.removeprefix("chatcmpl-")
    for i in (1, 2):
        final = decode_entry(up_redis.xrevrange(stream_key(f"{rid}-{i}"), count=1)[0][1])
        assert final.usage["cached_tokens"] >= whole.usage.prompt_tokens - 16
    # Streamed, the same choices, each under its index.
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kwargs, n=3, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [finishes[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
