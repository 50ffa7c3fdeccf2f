"""Tool calling, the request side: a chat request's ``tools`` and ``tool_choice`` as the prompt's messages
and the grammar its answer is decoded under (``tessera.tool_calls`` reads the calls back out).

The tools reach the model through its chat template when the template renders ``tools`` (passed as
transformers passes them); otherwise a system message lists them and the call format. Either way, past
calls and tool results are written into the conversation in the call format the grammar enforces.
``required`` or a named function forces a call whose arguments match the tool's parameters; ``auto``
lets the model write text or start a call, whose arguments are constrained once it starts; ``none``
renders no tools and constrains nothing. A tool sent with ``strict: false`` asks for OpenAI's best effort:
its arguments are held to be a JSON object only, and under ``auto`` with every tool so, nothing is
constrained (the calls are parsed from what the model writes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from gpu_workers.grammars import InvalidGrammar, check_grammar
from gpu_workers.protocol import Grammar
from gpu_workers.tokenizer import Tokenizer
from tessera.api.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from tessera.api.structured import schema_grammar
from tessera.errors import APIError
from tessera.tool_calls import CALL_END, CALL_OPEN, CALL_SEPARATOR, call_header, format_call

NO_PARAMETERS = {"type": "object", "properties": {}}
ANY_OBJECT = {"type": "object"}
# The arguments as json.dumps writes them (and as the prompt shows them): no free whitespace, so a model
# cannot pad a call with blanks until its token budget runs out.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOLS_PROMPT = (
    "You can call the following tools. Each is a JSON object with the tool's name, what it does and its "
    "parameters (a JSON Schema):\n{tools}\n\n"
    "To call a tool, answer with exactly this and nothing after it:\n{call}\n{parallel}"
    "Otherwise answer in plain text."
)
CALL_SHAPE = format_call("<the tool's name>", "<a JSON object matching its parameters>")
PARALLEL_PROMPT = "To call several tools at once, write one call per line.\n"


@dataclass
class ToolPlan:
    """What a chat request's tools make of it: the messages and tools for the chat template, the grammar
    (None: unconstrained) and the tool names the answer's calls are parsed against (empty: no parsing)."""

    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None = None
    grammar: Grammar | None = None
    names: tuple[str, ...] = field(default_factory=tuple)


def plan(body: ChatCompletionRequest, tokenizer: Tokenizer) -> ToolPlan:
    """The prompt and grammar for ``body``'s tools; raises APIError 400 naming a bad tool or tool_choice."""
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise APIError(
            400,
            f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
            f"({', '.join(t.function.name for t in tools) or 'none were sent'}); name one of them",
            "invalid_tool_choice",
            param="tool_choice",
        )
    if choice != "none" and not tools:
        raise APIError(
            400, "tool_choice needs tools: send the tools the model may call", "invalid_tool_choice",
            param="tool_choice",
        )  # fmt: skip
    in_template = tokenizer.renders_tools
    messages = [_message(m, in_template) for m in body.messages]
    if choice == "none":
        return ToolPlan(messages)
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(
            400,
            "response_format and tools cannot be combined here; send tool_choice 'none' or drop response_format",
            "invalid_request",
            param="response_format",
        )
    parallel = body.parallel_tool_calls is not False
    if in_template:
        template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    else:
        template_tools = None
        messages = _with_tools_prompt(messages, tools, parallel)
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    names = tuple(t.function.name for t in tools)
    if choice == "auto" and all(t.function.strict is False for t in tools):
        return ToolPlan(messages, template_tools, None, names)
    signature = json.dumps(
        [[t.function.name, t.function.parameters, t.function.strict is not False] for t in tools],
        sort_keys=True,
    )
    # One call to a named function, as OpenAI's API makes.
    grammar = _calls_grammar(signature, named, required=choice != "auto", parallel=parallel and not named)
    return ToolPlan(messages, template_tools, grammar, names)


def _parameters(name: str, schema: dict[str, Any] | None, index: int) -> dict[str, Any]:
    """A tool's parameters schema, checked as response_format's schemas are (400 naming the tool)."""
    schema = schema or NO_PARAMETERS
    param = f"tools[{index}].function.parameters"
    if schema.get("type", "object") != "object":
        raise APIError(
            400,
            f"{param} of tool {name!r} must be a JSON Schema of type 'object', got {schema.get('type')!r}: "
            "a call's arguments are a JSON object",
            "invalid_json_schema",
            param=param,
        )
    schema_grammar(schema, param)
    return schema


# Checking and compiling the tools costs ~1 ms a tool; agents send the same tools turn after turn.
@lru_cache(maxsize=256)
def _calls_grammar(signature: str, named: str | None, required: bool, parallel: bool) -> Grammar:
    """Lark for one call (or several, one a line) to one of the tools (``signature``: their names, parameters
    and whether they are strict, as JSON; ``named``: that one only), arguments validated by the schema of a
    strict tool and held to be a JSON object for the others; unless ``required``,
    free text instead, or text and then calls: a lazy lexeme ends the text at the first ``CALL_OPEN``,
    where the call's grammar takes over. Raises APIError 400 naming a tool whose parameters cannot be used."""
    tools = [
        (name, _parameters(name, schema, i) if strict else ANY_OBJECT)
        for i, (name, schema, strict) in enumerate(json.loads(signature))
    ]
    rules = []
    for i, (name, schema) in enumerate(t for t in tools if named in (None, t[0])):
        arguments = {**schema, "x-guidance": _JSON_STYLE}
        rules.append(
            f"call_{i}: {json.dumps(call_header(name))} %json {json.dumps(arguments)} {json.dumps(CALL_END)}"
        )
    more = f" ({json.dumps(CALL_SEPARATOR + CALL_OPEN)} call)*" if parallel else ""
    if required:
        start = [f"start: {json.dumps(CALL_OPEN)} call{more}"]
    else:
        start = [
            f"start: TEXT | text_then_call call{more}",
            f"text_then_call[lazy]: TEXT {json.dumps(CALL_OPEN)}",
            r"TEXT: /(.|\n)*/",
        ]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(rules)))
    lark = "\n".join(["%llguidance {}", *start, call, *rules])
    grammar = Grammar("lark", lark)
    try:
        check_grammar(grammar)
    except InvalidGrammar as e:
        raise APIError(
            400, f"the tools cannot be enforced: {e}", "unsupported_json_schema", param="tools"
        ) from None
    return grammar


def _with_tools_prompt(
    messages: list[dict[str, Any]], tools: list[Tool], parallel: bool
) -> list[dict[str, Any]]:
    """``messages`` with the tools' system prompt merged into the first system message (or before them)."""
    listed = "\n".join(json.dumps(tool.function.model_dump(exclude_none=True)) for tool in tools)
    prompt = TOOLS_PROMPT.format(tools=listed, call=CALL_SHAPE, parallel=PARALLEL_PROMPT if parallel else "")
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _message(message: ChatMessage, in_template: bool) -> dict[str, Any]:
    """A message for the template: past calls and tool results in the template's own fields when it renders
    tools, else written in the call format (results as user messages, which every template accepts)."""
    rendered = message.for_template()
    if in_template:
        if message.tool_calls:
            rendered["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _json(c)}}
                for c in message.tool_calls
            ]
        if message.role == "tool":
            rendered["tool_call_id"] = message.tool_call_id
        return rendered
    if message.tool_calls:
        calls = CALL_SEPARATOR.join(
            format_call(c.function.name, c.function.arguments) for c in message.tool_calls
        )
        rendered["content"] = (rendered["content"] + "\n" if rendered["content"] else "") + calls
    if message.role == "tool":
        rendered = {"role": "user", "content": f"<tool_response>\n{rendered['content']}\n</tool_response>"}
    return rendered


def _json(call: Any) -> Any:
    """A past call's arguments as the object templates expect (the text itself when it is not JSON)."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments
