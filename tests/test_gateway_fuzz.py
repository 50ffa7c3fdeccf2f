"""Property: whatever JSON strings a client puts in any text field, the gateway answers 2xx or 4xx, never 5xx.

Runs against the real app (real Redis, SQLite, tokenizer and chat template) with test_gateway's scripted
worker pools, so requests that pass validation go all the way through routing, the queue and the stream.
"""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# test_gateway's app fixture and the Redis it runs on; `name as name` re-exports them to pytest.
from test_gateway import redis_url as redis_url
from test_gateway import reply
from test_gateway import stack as stack

# Any JSON string: every code point, lone surrogates included (JSON's \ud800 escapes), plus text that
# means something to a template, a tokenizer or a database. Valid Unicode is drawn more often, so that
# requests with several text fields still often pass validation.
UNICODE = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", "\x00", "{{ 7 * 7 }}", "{% raise %}", "<s>", "</s>", "<|assistant|>", "\U0001f600"]),
    st.just("word " * 200),  # over the test deployments' context
)
SURROGATES = st.one_of(
    st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), min_size=1, max_size=24),
    st.sampled_from(["\ud800", "a\udfffb", "\ud83d"]),
)


def mostly(valid: st.SearchStrategy, other: st.SearchStrategy) -> st.SearchStrategy:
    # 3 to 1 for a value that can pass validation, so many examples reach the worker and back.
    return st.sampled_from([True, True, True, False]).flatmap(lambda ok: valid if ok else other)


TEXT = mostly(UNICODE, SURROGATES)

ROLES = mostly(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), TEXT)
PART = st.fixed_dictionaries({"type": mostly(st.just("text"), TEXT), "text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES, "content": mostly(TEXT, st.one_of(st.lists(PART, max_size=3), st.none()))},
    optional={"name": TEXT},
)
SHARED = {
    "stop": mostly(st.lists(UNICODE, max_size=4), st.one_of(TEXT, st.lists(TEXT, max_size=5))),
    "user": TEXT,
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 40),
}
EXAMPLES = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def model_ids(stack) -> st.SearchStrategy[str]:
    return mostly(st.sampled_from([stack.model, stack.colocated]), TEXT)


def unknown_fields() -> st.SearchStrategy[dict]:
    return st.dictionaries(TEXT, TEXT, max_size=2)


def post(stack, path: str, body: dict) -> httpx.Response:
    stack.live()
    stack.pools.script = reply()
    # json.dumps escapes lone surrogates as \udXXX, as a JSON client may; httpx's json= cannot encode them.
    headers = {**stack.auth(), "Content-Type": "application/json"}
    return stack.client.post(path, headers=headers, content=json.dumps(body).encode())


def assert_never_a_server_error(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error" and error["code"]
    elif response.headers["content-type"].startswith("application/json"):
        assert response.json()["choices"]
    else:
        assert "data: [DONE]" in response.text


def test_any_text_in_a_chat_request_is_answered_without_a_server_error(stack):
    @EXAMPLES
    @given(
        st.fixed_dictionaries(
            {"model": model_ids(stack), "messages": st.lists(MESSAGE, min_size=1, max_size=2)},
            optional=SHARED,
        ),
        unknown_fields(),
    )
    def check(body, extra):
        assert_never_a_server_error(post(stack, "/v1/chat/completions", {**extra, **body}))

    check()


def test_any_text_in_a_completion_request_is_answered_without_a_server_error(stack):
    prompt = mostly(TEXT, st.lists(TEXT, min_size=1, max_size=2))

    @EXAMPLES
    @given(
        st.fixed_dictionaries({"model": model_ids(stack), "prompt": prompt}, optional=SHARED),
        unknown_fields(),
    )
    def check(body, extra):
        assert_never_a_server_error(post(stack, "/v1/completions", {**extra, **body}))

    check()
