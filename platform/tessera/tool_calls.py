"""Tool calls in generated text: the call format the prompt teaches and the grammar enforces, and the parser
that turns a generation into content and calls, streamed or whole (``api/tools.py`` is the request side).

A call is ``<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>``; parallel calls follow each
other on new lines. ``ToolCallParser`` reads text in pieces of any size and gives the same deltas, joined,
however the text was cut: a non-streamed answer is the streamed one's deltas folded together, so the two
are the same answer by construction.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"


def call_header(name: str) -> str:
    """What a call to ``name`` starts with after ``CALL_OPEN``; its arguments (a JSON object) follow."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


CALL_END = "}" + CALL_CLOSE  # closes the call's object, after its arguments


def format_call(name: str, arguments: str) -> str:
    """A call as the model writes it (``arguments``: a JSON object's text)."""
    return CALL_OPEN + call_header(name) + arguments + CALL_END


@dataclass
class Delta:
    """One piece of the answer: content text, or a call's start (``name`` and ``id`` set) or arguments."""

    content: str = ""
    index: int | None = None  # the call this piece belongs to
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that could be the start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallParser:
    """Splits generated text into content and tool calls to ``names``, incrementally."""

    names: tuple[str, ...]
    _state: str = "text"  # text | header | arguments | end | after
    _buffer: str = ""
    _calls: int = 0
    _depth: int = 0  # of the arguments' braces and brackets
    _in_string: bool = False
    _escaped: bool = False
    _headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._headers = {call_header(name): name for name in self.names}

    @property
    def calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        """What the buffer still holds, once the generation has ended: unfinished markup becomes content,
        a cut call's arguments stay its (partial) arguments."""
        out: list[Delta] = []
        rest, self._buffer = self._buffer, ""
        if self._state == "text" and rest:
            out.append(Delta(content=rest))
        elif self._state == "header":
            out.append(Delta(content=CALL_OPEN + rest))
        elif self._state == "arguments" and rest:
            out.append(Delta(index=self._calls - 1, arguments=rest))
        elif self._state in ("end", "after") and rest.strip():
            out.append(Delta(content=rest))
        self._state = "text"
        return out

    def _step(self, out: list[Delta]) -> bool:
        """Advance over the buffer as far as it can be decided; whether to go on."""
        buf = self._buffer
        if self._state in ("text", "after"):
            start = buf.find(CALL_OPEN)
            if start >= 0:
                before = buf[:start]
                if before.strip():
                    out.append(Delta(content=before.rstrip()))
                self._buffer, self._state = buf[start + len(CALL_OPEN) :], "header"
                return True
            if self._state == "after" and not buf.strip():
                return False  # blanks between calls are no content unless text follows
            # Trailing blanks wait: before a call they are dropped, at the end they are content.
            held = _held_prefix(buf, CALL_OPEN)
            held += len(buf) - held - len(buf[: len(buf) - held].rstrip())
            if len(buf) > held:
                out.append(Delta(content=buf[: len(buf) - held]))
                self._buffer, self._state = buf[len(buf) - held :], "text"
            return False
        if self._state == "header":
            for header, name in self._headers.items():
                if buf.startswith(header):
                    out.append(Delta(index=self._calls, id=f"call_{uuid.uuid4().hex[:24]}", name=name))
                    self._calls += 1
                    self._buffer, self._state = buf[len(header) :], "arguments"
                    self._depth, self._in_string, self._escaped = 0, False, False
                    return True
            if any(header.startswith(buf) for header in self._headers):
                return False
            # Not a call to a known tool (only an unconstrained generation writes that): plain text.
            out.append(Delta(content=CALL_OPEN))
            self._state = "text"
            return True
        if self._state == "arguments":
            end = self._arguments_end(buf)
            taken = len(buf) if end is None else end
            if taken:
                out.append(Delta(index=self._calls - 1, arguments=buf[:taken]))
            self._buffer = buf[taken:]
            if end is None:
                return False
            self._state = "end"
            return True
        # "end": the call's closing markup
        if buf.startswith(CALL_END):
            self._buffer, self._state = buf[len(CALL_END) :], "after"
            return True
        if CALL_END.startswith(buf):
            return False
        self._state = "after"
        return True

    def _arguments_end(self, buf: str) -> int | None:
        """Where the arguments' JSON value ends in ``buf`` (None: not yet), tracking strings and nesting."""
        for i, c in enumerate(buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1
        return None


@dataclass
class Message:
    """A whole answer: its content (None when it is only calls) and its calls, OpenAI's way."""

    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        if delta.content:
            self.content = (self.content or "") + delta.content
        if delta.index is None:
            return
        if delta.name is not None:
            self.tool_calls.append(
                {"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}}
            )
        self.tool_calls[delta.index]["function"]["arguments"] += delta.arguments


def parse_message(text: str, names: tuple[str, ...]) -> Message:
    """``text`` as content and calls: the streamed deltas of the same text, folded."""
    parser = ToolCallParser(names)
    message = Message()
    for delta in [*parser.feed(text), *parser.finish()]:
        message.add(delta)
    return message
