"""A request's grammar as llguidance compiles it, and the check that it compiles: torch-free, so the gateway
refuses a bad grammar (400) with the same library and rules a worker uses (``engine.grammar``).

Kinds: ``json_schema`` (a JSON Schema, as a JSON string), ``json_object`` (any JSON object), ``regex``,
``lark`` (llguidance's Lark dialect). JSON is generated compact (no free whitespace between tokens), so a
model cannot pad an answer with blanks until its token budget runs out.
"""

from __future__ import annotations

import json

from gpu_workers.protocol import Grammar

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")
ANY_JSON_OBJECT = {"type": "object"}
_JSON_OPTIONS = {"whitespace_flexible": False}


class InvalidGrammar(ValueError):
    """A grammar that cannot be compiled: the message says why."""


def grammar_source(grammar: Grammar) -> str:
    """llguidance's serialised grammar for ``grammar``; raises InvalidGrammar for an unknown kind or a source
    its kind cannot read (whether it compiles for a vocabulary is ``check_grammar``'s)."""
    import llguidance

    builder = llguidance.LLMatcher
    try:
        if grammar.kind == "json_schema":
            return builder.grammar_from_json_schema(grammar.source, defaults=_JSON_OPTIONS)
        if grammar.kind == "json_object":
            return builder.grammar_from_json_schema(json.dumps(ANY_JSON_OBJECT), defaults=_JSON_OPTIONS)
        if grammar.kind == "regex":
            return builder.grammar_from_regex(grammar.source)
        if grammar.kind == "lark":
            return builder.grammar_from_lark(grammar.source)
    except ValueError as e:
        raise InvalidGrammar(f"the {grammar.kind} grammar is not valid: {e}") from None
    raise InvalidGrammar(
        f"grammar kind {grammar.kind!r} is unknown; expected one of {', '.join(GRAMMAR_KINDS)}"
    )


def check_grammar(grammar: Grammar, lltokenizer=None) -> str:
    """``grammar`` compiled (llguidance's serialised form), checked against ``lltokenizer``'s vocabulary when
    given; raises InvalidGrammar with llguidance's reason otherwise."""
    import llguidance

    source = grammar_source(grammar)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, lltokenizer)
    if is_error:
        raise InvalidGrammar(f"the {grammar.kind} grammar cannot be used: {messages[0]}")
    return source
