"""Grammar-constrained decoding in the engine, on the real default model (SmolLM2-135M-Instruct): every answer
that stops is JSON matching its schema, a cut one says ``length``, unconstrained rows in the same batch are
untouched, and a request continued elsewhere (prefill → decode) keeps its grammar's state."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tessera import installed_smollm2

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.grammars import InvalidGrammar, check_grammar
from gpu_workers.protocol import Grammar

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["n"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "number"}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}}, "required": ["name"]},
    {"type": "object", "properties": {"x": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, "required": ["x"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}}, "required": ["title", "year"], "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"], "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}}},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}, "required": ["name", "arguments"]},
    {"type": "integer", "minimum": 1, "maximum": 9},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["id", "qty"]}, "maxItems": 2}}, "required": ["items"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}, "required": ["email"]},
    {"type": "object", "properties": {"opt": {"type": "string", "maxLength": 10}, "req": {"type": "integer"}}, "required": ["req"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "maxItems": 2}}, "required": ["matrix"]},
    {"type": "object", "properties": {"v": {"type": "number", "exclusiveMinimum": 0}}, "required": ["v"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "at": {"type": "string", "maxLength": 10}}, "required": ["kind", "at"]},
]  # fmt: skip


def closed(schema):
    """``schema`` with every object closed (``additionalProperties: false``, as OpenAI's strict mode asks):
    a small model otherwise invents properties until its token budget runs out."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(installed_smollm2(), EngineConfig())


def chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_every_stopped_answer_matches_its_schema(engine):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        prompts.append(chat(engine, f"Answer in JSON. Example {i}: describe something."))
        grammar = Grammar("json_schema", json.dumps(closed(schema)))
        params.append(SamplingParams(max_tokens=64, temperature=0.7, seed=i, grammar=grammar))
    outputs = engine.generate(prompts, params)
    stopped = 0
    for out, p in zip(outputs, params, strict=True):
        assert out.error is None, out.error
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), json.loads(p.grammar.source))
            stopped += 1
        else:  # cut by max_tokens: never reported as a finished answer
            assert out.finish_reason == "length"
    assert stopped >= len(outputs) // 2, [o.text for o in outputs]


def test_a_cut_answer_finishes_with_length_not_stop(engine):
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    grammar = Grammar("json_schema", json.dumps(schema))
    out = engine.generate(
        chat(engine, "Tell a long story."), SamplingParams(max_tokens=6, temperature=0, grammar=grammar)
    )[0]
    assert out.finish_reason == "length" and out.text.startswith('{"story":"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_unconstrained_rows_are_untouched_by_constrained_ones_in_their_batch(engine):
    plain = chat(engine, "Name three primary colours.")
    greedy = SamplingParams(max_tokens=24, temperature=0)
    alone = engine.generate(plain, greedy)[0].token_ids
    constrained = SamplingParams(max_tokens=24, temperature=0, grammar=Grammar("json_object"))
    together = engine.generate([plain, plain, plain], [constrained, greedy, constrained])
    assert together[1].token_ids == alone
    assert together[0].token_ids != alone and together[0].text.startswith("{")


def test_a_continued_request_keeps_its_grammar_state(engine):
    # Prefill generates the first tokens, decode continues with them as the prompt's streamed output:
    # the grammar is replayed over them, so the continuation is the one a single engine would produce.
    grammar = Grammar("json_schema", json.dumps(SCHEMAS[12]))
    prompt = chat(engine, "Call get_weather for Paris in celsius, as JSON.")
    whole = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0, grammar=grammar))[0]
    k = 5
    events = []
    params = SamplingParams(max_tokens=40 - k, temperature=0, grammar=grammar)
    engine.add_request(prompt + whole.token_ids[:k], params, on_event=events.append, streamed_output=k)
    while not events or events[-1].finish_reason is None:
        engine.step()
    assert [t for e in events for t in e.token_ids] == whole.token_ids[k:]
    assert events[-1].finish_reason == whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.text), SCHEMAS[12])


def test_a_bad_grammar_is_refused_with_its_reason(engine):
    out = engine.generate(
        chat(engine, "hi"), SamplingParams(grammar=Grammar("json_schema", '{"type": "strin"}'))
    )[0]
    assert (
        out.finish_reason == "error" and out.error.code == "invalid_grammar" and "strin" in out.error.message
    )
    with pytest.raises(InvalidGrammar, match="Unimplemented keys"):
        check_grammar(Grammar("json_schema", json.dumps({"type": "array", "uniqueItems": True})))
    with pytest.raises(InvalidGrammar, match="unknown"):
        check_grammar(Grammar("yaml", "a: b"))
