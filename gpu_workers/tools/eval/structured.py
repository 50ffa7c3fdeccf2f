"""``tessera eval structured``: constrained answers through a running API. Twenty JSON Schemas (nested objects,
arrays of objects, enums, patterns, numeric ranges, optional fields), each asked of a model with a number of
prompts under ``response_format: json_schema`` (strict) through the OpenAI SDK; every answer parsed and
validated with jsonschema. Strings and arrays are bounded in the schemas, so an answer that fits its schema
fits the token budget too; an answer cut by ``max_tokens`` anyway is counted apart."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpu_workers.tools.eval.tool_calls import wilson

TEXT = {"type": "string", "maxLength": 40}
SHORT = {"type": "string", "maxLength": 16}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _list(items: dict[str, Any], most: int = 4) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": ("a person", _object({"name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    "address": ("a postal address", _object({"street": TEXT, "city": SHORT, "zip": {"type": "string", "pattern": r"^\d{5}$"}})),
    "product": ("a product", _object({"name": TEXT, "price": {"type": "number", "minimum": 0, "maximum": 10000}, "in_stock": {"type": "boolean"}})),
    "event": ("an event", _object({"title": TEXT, "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}, "attendees": _list(SHORT)})),
    "weather": ("a weather report", _object({"city": SHORT, "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60}, "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}})),
    "recipe": ("a recipe", _object({"dish": TEXT, "ingredients": _list(SHORT, 5), "minutes": {"type": "integer", "minimum": 1, "maximum": 600}})),
    "book": ("a book", _object({"title": TEXT, "author": TEXT, "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}, ["title", "author"])),
    "review": ("a movie review", _object({"movie": TEXT, "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "verdict": {"enum": ["watch", "skip"]}})),
    "todo": ("a to-do list", _object({"items": _list(_object({"task": TEXT, "done": {"type": "boolean"}}), 3)})),
    "invoice": ("an invoice", _object({"number": SHORT, "lines": _list(_object({"item": SHORT, "quantity": {"type": "integer", "minimum": 1, "maximum": 99}}), 3)})),
    "color": ("a color", _object({"name": SHORT, "hex": {"type": "string", "pattern": r"^#[0-9a-f]{6}$"}})),
    "place": ("a place on the map", _object({"name": SHORT, "latitude": {"type": "number", "minimum": -90, "maximum": 90}, "longitude": {"type": "number", "minimum": -180, "maximum": 180}})),
    "sentiment": ("the sentiment of a sentence", _object({"sentence": TEXT, "label": {"enum": ["positive", "negative", "neutral"]}})),
    "translation": ("a translation", _object({"source": TEXT, "language": {"enum": ["French", "German", "Spanish"]}, "target": TEXT})),
    "labels": ("a classification", _object({"text": TEXT, "labels": _list({"enum": ["news", "sports", "tech", "art"]}, 2)})),
    "flight": ("a flight", _object({"from": {"type": "string", "pattern": r"^[A-Z]{3}$"}, "to": {"type": "string", "pattern": r"^[A-Z]{3}$"}, "seats": {"type": "integer", "minimum": 1, "maximum": 9}})),
    "settings": ("an app's settings", _object({"dark_mode": {"type": "boolean"}, "font_size": {"type": "integer", "minimum": 8, "maximum": 32}, "language": {"enum": ["en", "fr", "de"]}})),
    "contact": ("a contact card", _object({"name": TEXT, "phones": _list({"type": "string", "pattern": r"^\+?[0-9]{6,12}$"}, 2), "company": TEXT}, ["name", "phones"])),
    "team": ("a team", _object({"team": SHORT, "members": _list(_object({"name": SHORT, "role": {"enum": ["lead", "dev", "qa"]}}), 3)})),
    "config": ("a server config", _object({"server": _object({"host": SHORT, "port": {"type": "integer", "minimum": 1, "maximum": 65535}}), "debug": {"type": "boolean"}})),
}  # fmt: skip
SUBJECTS = [
    "a bakery in Lyon", "a space mission", "a jazz festival", "a small startup", "a school trip", "a hospital",
    "a football club", "a mountain village", "a bookshop", "a chess tournament", "a rainy Monday", "a robot",
    "a summer holiday", "a science museum", "a coffee farm", "a city marathon", "a video game", "a lighthouse",
    "a wedding", "a train station", "a fishing boat", "a zoo", "a music school", "a cloud provider", "a garden",
]  # fmt: skip


def ask(client, model: str, name: str, subject: str, seed: int, **sampling: Any) -> tuple[str, str | None]:
    what, schema = SCHEMAS[name]
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Describe {what} related to {subject}, as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
        seed=seed,
        **sampling,
    )
    choice = response.choices[0]
    return choice.message.content or "", choice.finish_reason


def valid(name: str, text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name][1])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_structured_eval(
    api_url: str,
    api_key: str,
    model: str,
    per_schema: int = 25,
    concurrency: int = 16,
    max_tokens: int = 256,
    temperature: float = 1.0,
    seed: int = 0,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """``per_schema`` answers for each of the 20 schemas (prompt i names subject i), at ``concurrency``."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{api_url.rstrip('/')}/v1", api_key=api_key, max_retries=0, timeout=600)
    runs = [(name, i) for name in SCHEMAS for i in range(per_schema)]
    sampling = {"max_tokens": max_tokens, "temperature": temperature}
    start = time.perf_counter()

    def one(run: tuple[str, int]) -> tuple[str, str | None]:
        name, i = run
        return ask(client, model, name, SUBJECTS[i % len(SUBJECTS)], seed + i, **sampling)

    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, runs))
    finished = [(run, text) for run, (text, finish) in zip(runs, answers, strict=True) if finish == "stop"]
    good = sum(valid(name, text) for (name, _), text in finished)
    failures = [
        {"schema": name, "prompt": i, "answer": text, "finish_reason": finish}
        for (name, i), (text, finish) in zip(runs, answers, strict=True)
        if finish != "stop" or not valid(name, text)
    ]
    result = {
        "model": model, "schemas": len(SCHEMAS), "answers": len(runs), "finished": len(finished),
        "valid_of_finished": good, "valid_pct": round(100 * good / len(runs), 2),
        "valid_ci": wilson(good, len(runs)), "max_tokens": max_tokens, "temperature": temperature,
        "concurrency": concurrency, "seconds": round(time.perf_counter() - start, 1), "failures": failures,
    }  # fmt: skip
    progress(
        f"{model}: {good}/{len(runs)} answers parse and validate ({result['valid_pct']}% "
        f"[{result['valid_ci'][0]}, {result['valid_ci'][1]}]); {len(runs) - len(finished)} cut by max_tokens"
    )
    return result
