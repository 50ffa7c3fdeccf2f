"""Structured outputs: a request's ``response_format`` as the grammar its answer is decoded under.

The schema is checked here, before any quota or worker is touched: first as JSON Schema (``jsonschema``'s
metaschema check), then by the grammar library the workers compile it with (llguidance), so a keyword the
grammar cannot enforce is a 400 naming it rather than a constraint silently dropped.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from gpu_workers.grammars import InvalidGrammar, check_grammar
from gpu_workers.protocol import Grammar
from tessera.api.schemas import ResponseFormat
from tessera.errors import APIError

PARAM = "response_format"


def response_grammar(response_format: ResponseFormat | None) -> Grammar | None:
    """The grammar ``response_format`` asks for (None for free text); raises APIError 400 naming what to fix."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Grammar("json_object")
    return schema_grammar(response_format.json_schema.schema_, f"{PARAM}.json_schema.schema")


def schema_grammar(schema: dict[str, Any], param: str) -> Grammar:
    """A grammar for JSON matching ``schema``; raises APIError 400 for a schema that is not valid JSON Schema
    or uses what the grammar cannot enforce."""
    return _schema_grammar(json.dumps(schema, separators=(",", ":"), sort_keys=True), param)


# The checks cost a schema's compile (~1 ms, more for large ones) on the request path; clients send the same
# schema request after request. A refused schema is not cached (it raises), so it is checked again.
@lru_cache(maxsize=256)
def _schema_grammar(source: str, param: str) -> Grammar:
    schema = json.loads(source)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(map(str, e.absolute_path)) or "(the schema itself)"
        raise APIError(
            400,
            f"{param} is not a valid JSON Schema at {where}: {e.message}",
            "invalid_json_schema",
            param=param,
        ) from None
    grammar = Grammar("json_schema", source)
    try:
        check_grammar(grammar)
    except InvalidGrammar as e:
        raise APIError(
            400,
            f"{param} cannot be enforced: {e}; remove or rewrite it (README, 'Structured outputs', lists what "
            "is supported)",
            "unsupported_json_schema",
            param=param,
        ) from None
    return grammar
