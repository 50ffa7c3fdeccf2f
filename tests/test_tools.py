"""Tool calling: the call parser (any cut of the text gives the same answer), then the OpenAI SDK, unmodified,
against a real ``tessera up`` (SmolLM2-135M-Instruct): forced, named and free calls whose arguments validate,
a second turn with the tool's result, 400s for bad tools with no worker touched, streamed == non-streamed
for seeded requests (one at a time; sixteen at once on a batch-invariant deployment), and Workers AI's flat
tools.
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from tessera import db, installed_smollm2, tenancy
from tessera.api import tools
from tessera.api.schemas import ChatCompletionRequest
from tessera.launcher import DEFAULT_MODEL
from tessera.settings import Settings
from tessera.tool_calls import Message, ToolCallParser, format_call, parse_message
from test_launcher import assert_all_stopped, start_up, stop_up

from gpu_workers.grammars import check_grammar
from gpu_workers.tokenizer import Tokenizer, gguf_tokenizer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 24}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The current time in a timezone", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def folded(text: str, cuts: list[int]) -> Message:
    parser, message = ToolCallParser(("get_weather", "get_time")), Message()
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for delta in [d for piece in pieces for d in parser.feed(piece)] + parser.finish():
        message.add(delta)
    return message


def calls_of(message: Message) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.tool_calls]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text, no call.  \n", "Just text, no call.  \n", []),
        (
            "Let me look. " + format_call("get_weather", '{"city": "P}\\"aris", "n": [1, {"a": 2}]}'),
            "Let me look.",
            [("get_weather", '{"city": "P}\\"aris", "n": [1, {"a": 2}]}')],
        ),
        (
            format_call("get_weather", "{}") + "\n" + format_call("get_time", '{"timezone": "UTC"}'),
            None,
            [("get_weather", "{}"), ("get_time", '{"timezone": "UTC"}')],
        ),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', None, [("get_weather", '{"city": "Pa')]),
        ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
        ("a <tool_c", "a <tool_c", []),
    ],
    ids=["text", "text-then-call", "parallel", "cut-call", "unknown-tool", "cut-marker"],
)  # fmt: skip
def test_any_cut_of_the_text_parses_to_the_same_answer(text, content, calls):
    whole = parse_message(text, ("get_weather", "get_time"))
    assert (whole.content, calls_of(whole)) == (content, calls)
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        message = folded(text, cuts)
        assert (message.content, calls_of(message)) == (content, calls), cuts


def test_auto_grammar_lets_text_run_and_constrains_a_call_once_it_starts():
    import llguidance

    tokenizer = gguf_tokenizer(installed_smollm2())
    lltokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": TOOLS})
    grammar = tools.plan(body, tokenizer).grammar
    source = check_grammar(grammar, lltokenizer)

    def accepts(text: str) -> tuple[bool, bool]:
        matcher = llguidance.LLMatcher(lltokenizer, source, log_level=0)
        ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        return ok, ok and matcher.is_accepting()

    call = format_call("get_weather", '{"city": "Paris", "unit": "celsius"}')
    assert accepts("It is sunny, with <b>no</b> clouds.") == (True, True)
    assert accepts("Let me check. " + call) == (True, True)
    assert accepts(call + "\n" + format_call("get_time", '{"timezone": "CET"}')) == (True, True)
    assert accepts("<tool_call>") == (True, False)  # a call started must be finished
    assert not accepts('<tool_call>{"name": "get_stock", ')[0]
    assert not accepts(format_call("get_weather", '{"city": "Paris", "unit": "kelvin"}'))[0]
    assert not accepts(format_call("get_weather", '{"city": "Paris"}'))[0]  # unit is required
    assert not accepts(call + " and more text")[0]


def test_strict_false_tools_are_best_effort_not_enforced():
    import llguidance

    tokenizer = gguf_tokenizer(installed_smollm2())
    lltokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size)
    loose = [{**t, "function": {**t["function"], "strict": False}} for t in TOOLS]

    def plan(**kwargs):
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **kwargs})
        return tools.plan(body, tokenizer)

    # auto with every tool loose: nothing constrained, the calls still parsed out of the text.
    unconstrained = plan(tools=loose)
    assert unconstrained.grammar is None and unconstrained.names == ("get_weather", "get_time")
    # A forced call to a loose tool: the call's shape holds, its arguments need only be a JSON object.
    source = check_grammar(plan(tools=loose, tool_choice="required").grammar, lltokenizer)
    strict_source = check_grammar(plan(tools=TOOLS, tool_choice="required").grammar, lltokenizer)
    off_schema = format_call("get_weather", '{"town": 5}')
    for grammar, accepted in ((source, True), (strict_source, False)):
        matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        assert matcher.consume_tokens(tokenizer.encode(off_schema, add_special_tokens=False)) == accepted
    matcher = llguidance.LLMatcher(lltokenizer, source, log_level=0)
    assert not matcher.consume_tokens(tokenizer.encode("Sunny.", add_special_tokens=False))


# A Qwen2.5-style template, reduced: it renders the tools it is given, past calls and tool results itself.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t.function | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
    "{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_renders_tools_gets_them_and_the_conversation_in_its_own_fields():
    smollm2 = gguf_tokenizer(installed_smollm2())
    assert not smollm2.renders_tools
    tokenizer = Tokenizer(smollm2.backend, eos_token="<|im_end|>", chat_template=TOOLS_TEMPLATE)
    assert tokenizer.renders_tools
    arguments = '{"city": "Paris", "unit": "celsius"}'
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]  # fmt: skip
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": turn, "tools": TOOLS})
    plan = tools.plan(body, tokenizer)
    prompt = tokenizer.apply_chat_template(plan.messages, tools=plan.template_tools)
    assert (
        json.dumps(TOOLS[0]["function"]) in prompt and "<tool_call>" not in prompt
    )  # no system prompt of ours
    assert f"<call>get_weather {arguments}</call>" in prompt and "18 C [call_1]" in prompt
    assert plan.grammar is not None and plan.names == ("get_weather", "get_time")
    # Without tools rendered by the template, ours lists them in the system message.
    ours = tools.plan(body, smollm2)
    assert ours.template_tools is None and '"name": "get_weather"' in ours.messages[0]["content"]
    assert "<tool_response>\n18 C\n</tool_response>" in smollm2.apply_chat_template(ours.messages)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    up = start_up(tmp_path_factory.mktemp("tools"))
    yield up
    assert stop_up(up, signal.SIGTERM) == 0, up.output
    assert_all_stopped(up)


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=f"{up.url}/v1", api_key=up.key, max_retries=0, timeout=120)


def assert_valid_calls(message, names=tuple(SCHEMAS)) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
def test_required_tool_choice_forces_a_call_whose_arguments_validate(client):
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=64, temperature=0,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message)


@pytest.mark.slow
def test_a_named_tool_choice_calls_that_tool(client):
    for name in SCHEMAS:
        answer = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
            tool_choice={"type": "function", "function": {"name": name}},
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert {c.function.name for c in choice.message.tool_calls} == {name}
        assert_valid_calls(choice.message)


@pytest.mark.slow
def test_auto_answers_text_or_a_valid_call(client):
    seen = set()

    def ask(seed: int):
        return client.chat.completions.create(
            model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=64, seed=seed,
            temperature=1.0,
        )  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    for answer in answers:
        choice = answer.choices[0]
        if choice.finish_reason == "tool_calls":
            assert_valid_calls(choice.message)
            seen.add("call")
        elif choice.finish_reason == "stop":
            assert not choice.message.tool_calls and choice.message.content
            assert "<tool_call>" not in choice.message.content
            seen.add("text")
    assert seen, "no answer finished"


@pytest.mark.slow
def test_a_second_turn_carrying_the_tool_result_is_answered_in_text(client):
    first = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=64, temperature=0,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'},
    ]
    second = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=48, temperature=0
    )
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert not choice.message.tool_calls
    # The call and its result reached the prompt (tool_choice none: the tools themselves do not).
    bare = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tool_choice="none", max_tokens=1)
    assert second.usage.prompt_tokens > bare.usage.prompt_tokens + 30


def _bad(client, **kwargs):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, max_tokens=8, **kwargs)
    return caught.value.body


@pytest.mark.slow
def test_bad_tools_are_400_naming_what_to_fix_and_leave_the_workers_serving(client):
    nameless = [{"type": "function", "function": {"description": "x", "parameters": WEATHER}}]
    assert _bad(client, tools=nameless)["param"] == "tools"
    assert "tools[0].function.name" in _bad(client, tools=nameless)["message"]
    body = _bad(client, tools=[TOOLS[0], TOOLS[0]])
    assert body["param"] == "tools" and "get_weather" in body["message"]
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    assert _bad(client, tools=many)["param"] == "tools"
    invalid = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
    ]
    body = _bad(client, tools=invalid)
    assert body["code"] == "invalid_json_schema" and body["param"] == "tools[0].function.parameters"
    not_object = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    assert _bad(client, tools=not_object)["param"] == "tools[0].function.parameters"
    body = _bad(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_stock"}})
    assert body["param"] == "tool_choice" and "get_stock" in body["message"]
    assert _bad(client, tool_choice="required")["param"] == "tool_choice"
    # Still serving.
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=64, temperature=0,
    )  # fmt: skip
    assert_valid_calls(answer.choices[0].message)


def _answer(client, seed: int, stream: bool) -> tuple:
    """(content, calls, finish reason, the generated tokens' bytes): the tokens come from logprobs, so a pair
    of answers that differ can be told apart: other tokens, or the same tokens rendered otherwise."""
    # Odd seeds must call (several calls, the last often cut by max_tokens), even ones may answer in text.
    choice = "required" if seed % 2 else "auto"
    kwargs = dict(
        model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=48, seed=seed,
        temperature=1.0, logprobs=True,
    )  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.id[:5], c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        tokens = tuple(bytes(t.bytes) for t in choice.logprobs.content)
        return choice.message.content, calls, choice.finish_reason, tokens
    content, calls, finish, tokens = None, {}, None, []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            if choice.logprobs is not None:
                tokens += [bytes(t.bytes) for t in choice.logprobs.content]
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.id is not None:  # a call's first delta: id, type and name, once
                    assert call.index not in calls and call.type == "function" and call.function.name
                    calls[call.index] = [call.id[:5], call.function.name, ""]
                calls[call.index][2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish, tuple(tokens)


def _pairs(client, concurrency: int) -> list[tuple[tuple, tuple]]:
    """Seeded and sampled (temperature 1) tool-call requests, (non-streamed, streamed) answer pairs: the
    non-streamed answers all sent together, then the streamed ones, so each pair ran in different batches
    (the second from the prefix cache)."""
    seeds = list(range(100 * concurrency, 100 * concurrency + max(4, concurrency)))
    answers = {}
    for stream in (False, True):
        with ThreadPoolExecutor(concurrency) as pool:
            answers[stream] = list(pool.map(lambda seed, stream=stream: _answer(client, seed, stream), seeds))
    pairs = list(zip(answers[False], answers[True], strict=True))
    assert any(calls for (_, calls, _, _), _ in pairs), "no answer made a call: the pairs prove nothing"
    assert all(len(whole[3]) > 0 for whole, _ in pairs)
    return pairs


# One at a time, every pair is the same answer on the default deployment.
@pytest.mark.slow
def test_streamed_tool_calls_equal_the_non_streamed_answer(client):
    for whole, streamed in _pairs(client, 1):
        assert streamed == whole


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_workers_ai_flat_tools_answer_tool_calls_in_the_envelope(up, stream):
    account = re.search(r"tenant '([\w-]+)' created", up.output).group(1)
    engine = db.make_engine(Settings(data_dir=up.data_dir).database_url)
    with db.session_factory(engine)() as session:
        tenant_id = tenancy.get_tenant(session, account).id
    engine.dispose()
    flat = [tool["function"] for tool in TOOLS]  # Workers AI's {"name", "description", "parameters"}
    body = {"messages": ASK, "tools": flat, "tool_choice": NAMED, "max_tokens": 64, "temperature": 0}
    url = f"{up.url}/accounts/{tenant_id}/ai/run/{DEFAULT_MODEL}"
    headers = {"Authorization": f"Bearer {up.key}"}
    if not stream:
        reply = httpx.post(url, json=body, headers=headers, timeout=60).json()
        assert reply["success"], reply
        calls = reply["result"]["tool_calls"]
    else:
        events = []
        with httpx.stream(
            "POST", url, json={**body, "stream": True}, headers=headers, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        calls = [call for event in events for call in event.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather", reply if not stream else events
    for call in calls:
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])


def _serving(up) -> set[tuple[int, bool]]:
    """(config version, draining) of every live worker of the default deployment."""
    headers = {"Authorization": f"Bearer {up.key}"}
    response = httpx.get(f"{up.url}/admin/pools", headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    pools = [p for p in response.json()["data"] if p["deployment"] == DEFAULT_MODEL]
    return {(w["config_version"], w["draining"]) for p in pools for w in p["workers"]}


# Sixteen at a time, the default engine may generate a pair differently (a batch of a few rows rounds
# otherwise than one of many; a prefix-cache hit cuts the prefill elsewhere: BENCHMARKS.md, "Stream ==
# non-stream"); a batch-invariant deployment may not. Last in the module: it reloads the workers.
@pytest.mark.slow
def test_a_batch_invariant_deployment_streams_the_non_streamed_answer_at_16_concurrent(up, client):
    (before, _), *_ = _serving(up)
    headers = {"Authorization": f"Bearer {up.key}"}
    url = f"{up.url}/admin/deployments/{DEFAULT_MODEL}"
    changed = httpx.patch(url, json={"batch_invariant": True}, headers=headers, timeout=60)
    assert changed.status_code == 200 and changed.json()["batch_invariant"] is True, changed.text
    deadline = time.monotonic() + 180
    while _serving(up) != {(before + 1, False)}:
        assert time.monotonic() < deadline, f"workers not reloaded: {_serving(up)}\n{up.output}"
        time.sleep(0.5)
    pairs = _pairs(client, 16)
    assert [streamed for _, streamed in pairs] == [whole for whole, _ in pairs]
