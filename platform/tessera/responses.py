"""The answers of a generation request in its API's dialect: OpenAI's objects (chat.completion,
text_completion and their stream chunks) or Workers AI's envelope and ``{"response"}`` events, the SSE
stream that carries either, and the error tables both map a worker's error code through (HTTP status,
Workers AI's numeric code).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpu_workers.protocol import Event, TokenLogprob
from tessera.errors import APIError
from tessera.tool_calls import Delta, ToolCallParser, parse_message
from tessera.tool_calls import Message as ToolMessage

# Worker error codes that mean the request itself can never be served; every other code is a server fault.
CLIENT_ERROR_CODES = frozenset(
    {
        "context_length_exceeded",
        "kv_budget_exceeded",
        "empty_prompt",
        "invalid_prompt",
        "invalid_max_tokens",
        "invalid_stop",
        "invalid_temperature",
        "invalid_top_k",
        "invalid_top_p",
        "no_tokenizer",
    }
)
_SERVER_ERROR_STATUS = {
    "timeout": 504,
    "deadline_exceeded": 504,
    "worker_lost": 503,
    "stream_unavailable": 503,
}
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}


def error_status(code: str) -> int:
    if code in CLIENT_ERROR_CODES:
        return 400
    return _SERVER_ERROR_STATUS.get(code, 500)


def event_error(event: Event) -> APIError:
    error = event.error or {}
    code = error.get("code", "internal_error")
    return APIError(error_status(code), error.get("message", "the worker failed the request"), code)


# A request's price: its usage -> the fields it adds to the usage body (``cost`` in USD and its details).
Pricing = Callable[[dict[str, int]], dict[str, Any]]


def usage_body(usage: dict[str, int] | None, cost: Pricing | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with ``cost``, also what the request costs (as the ledger records it)."""
    usage = usage or {}
    prompt = usage.get("prompt_tokens", 0)
    completion = usage.get("completion_tokens", 0)
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
    }
    if cost is not None:
        body.update(cost(usage))
    return body


@dataclass
class Result:
    """A finished request, accumulated from its events."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    error: Event | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asked

    def add(self, event: Event) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs or ())
        if event.usage is not None:  # final events carry usage, and so may error events
            self.usage = event.usage
        if event.kind == "final":
            self.finish_reason = event.finish_reason
        elif event.kind == "error":
            self.error = event

    def usage_or_count(self, prompt_tokens: int) -> dict[str, int]:
        """The worker's usage, or what the gateway saw (prompt length, tokens streamed) when there is none."""
        if self.usage is not None:
            return self.usage
        return {"prompt_tokens": prompt_tokens, "cached_tokens": 0, "completion_tokens": len(self.token_ids)}


@dataclass
class StreamedLogprobs:
    """Token logprobs in OpenAI's two forms: chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``
    and completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``; a stream's offsets run on from
    chunk to chunk. A token's text is its bytes as UTF-8, a partial character written as ``\\xNN``."""

    kind: str
    token_bytes: Callable[[int], bytes]
    pending: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0  # characters of the completion before the next token (completions' text_offset)

    def take(self, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any] | None:
        """``logprobs`` (default: those pending, which are then cleared) in this kind's form; None if none."""
        if logprobs is None:
            logprobs, self.pending = self.pending, []
        if not logprobs:
            return None
        if self.kind == "chat":
            return {"content": [self._entry(lp) for lp in logprobs], "refusal": None}
        tokens, offsets = [], []
        for lp in logprobs:
            tokens.append(self._text(lp.token))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def _text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="backslashreplace")

    def _entry(self, lp: TokenLogprob) -> dict[str, Any]:
        def one(token: int, logprob: float) -> dict[str, Any]:
            raw = self.token_bytes(token)
            return {
                "token": raw.decode("utf-8", errors="backslashreplace"),
                "logprob": logprob,
                "bytes": list(raw),
            }

        return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


@dataclass(frozen=True)
class OpenAIShape:
    """Builds one request's OpenAI objects: ``chat`` (chat.completion) or ``text`` (text_completion). With
    ``tool_names``, a chat answer's tool calls (``tessera.tool_calls``) become ``tool_calls``, streamed as
    OpenAI streams them: per call a first delta with its index, id, type and name, then its arguments."""

    kind: str
    response_id: str
    model: str
    created: int
    cost: Pricing | None = None
    tool_names: tuple[str, ...] = ()
    # With logprobs asked: a token id's bytes (the model's tokenizer), to write each token's text.
    token_bytes: Callable[[int], bytes] | None = None
    _parser: ToolCallParser | None = field(default=None, init=False, repr=False, compare=False)
    _logprobs: StreamedLogprobs | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A stream's state, fresh for each copy (``dataclasses.replace`` makes one per request).
        if self.tool_names:
            object.__setattr__(self, "_parser", ToolCallParser(self.tool_names))
        if self.token_bytes is not None:
            object.__setattr__(self, "_logprobs", StreamedLogprobs(self.kind, self.token_bytes))

    def response(self, result: Result, prompt_tokens: int) -> dict[str, Any]:
        finish = FINISH_REASONS.get(result.finish_reason or "stop", "stop")
        logprobs = None
        if self.token_bytes is not None:
            logprobs = StreamedLogprobs(self.kind, self.token_bytes).take(result.logprobs)
        if self.kind == "chat" and self.tool_names:
            message = parse_message(result.text, self.tool_names)
            body: dict[str, Any] = {"role": "assistant", "content": message.content}
            if message.tool_calls:
                body["tool_calls"] = message.tool_calls
                finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": 0, "message": body, "finish_reason": finish, "logprobs": logprobs}
            obj = "chat.completion"
        elif self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": finish,
                "logprobs": logprobs,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": finish, "logprobs": logprobs}
            obj = "text_completion"
        return {
            **self._head(obj),
            "choices": [choice],
            "usage": usage_body(result.usage_or_count(prompt_tokens), self.cost),
        }

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any] | None:
        """A chunk for ``text`` (and its tokens' ``logprobs``); None when there is nothing to send yet: a
        tool call's markup not decided, or logprobs alone while tool calls are parsed (they go with the next
        chunk sent, the last one at the latest)."""
        finish = FINISH_REASONS.get(finish_reason, "stop") if finish_reason else None
        if self._logprobs is not None and logprobs:
            self._logprobs.pending.extend(logprobs)
        if self.kind == "chat" and self._parser is not None and not first:
            deltas = self._parser.feed(text)
            if finish_reason:
                deltas += self._parser.finish()
                if self._parser.calls and finish == "stop":
                    finish = "tool_calls"
            delta = _openai_delta(deltas)
            if not delta and finish is None:
                return None
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": self._pending()}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text or first else {}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": self._pending()}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": self._pending()}
        return {**self._head("text_completion"), "choices": [choice]}

    def _pending(self) -> dict[str, Any] | None:
        return None if self._logprobs is None else self._logprobs.take()

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_body(usage, self.cost)}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    def error_chunk(self, error: APIError) -> dict[str, Any]:
        return error.body()


def _openai_delta(deltas: list[Delta]) -> dict[str, Any]:
    """One chunk's delta from the parser's pieces: their content joined, and per call touched one
    ``tool_calls`` entry (its first carries id, type and name; arguments joined)."""
    delta: dict[str, Any] = {}
    content = "".join(d.content for d in deltas)
    if content:
        delta["content"] = content
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.index is None:
            continue
        entry = calls.setdefault(d.index, {"index": d.index, "function": {"arguments": ""}})
        if d.name is not None:
            entry.update(id=d.id, type="function")
            entry["function"] = {"name": d.name, "arguments": entry["function"]["arguments"]}
        entry["function"]["arguments"] += d.arguments
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta


class Shape(Protocol):
    """How one request's answer is written: the whole body, stream chunks, the usage chunk, a mid-stream error.
    ``kind == "chat"`` opens a stream with a role chunk; a ``chunk`` of ``None`` is not sent. A dataclass: the
    gateway sets ``cost`` (``dataclasses.replace``) to the request's pricing."""

    kind: str
    cost: Pricing | None

    def response(self, result: Result, prompt_tokens: int) -> dict[str, Any]: ...

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any] | None: ...

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]: ...

    def error_chunk(self, error: APIError) -> dict[str, Any]: ...


# Workers AI's numeric error codes, by our error code; anything else is 5007 (bad input) when it is the
# caller's fault and 3043 (internal error) when it is ours.
WORKERS_AI_CODES = {
    "invalid_api_key": 10000,
    "permission_denied": 10000,
    "rate_limit_exceeded": 3036,
    "quota_exceeded": 3036,
    "spend_budget_exceeded": 3036,
    "no_live_worker": 3040,
    "out_of_capacity": 3040,
    "queue_full": 3040,
    "worker_lost": 3040,
    "queue_unavailable": 3040,
    "quota_unavailable": 3040,
    "model_unavailable": 3040,
    "context_length_exceeded": 3006,
    "max_tokens_too_large": 3006,
    "kv_budget_exceeded": 3006,
    "request_too_large": 3006,
    "timeout": 3007,
    "deadline_exceeded": 3007,
    "model_not_found": 5018,
    "account_not_found": 7003,
}


def workers_ai_code(error: APIError) -> int:
    code = WORKERS_AI_CODES.get(error.code)
    if code is not None:
        return code
    return 3043 if error.status >= 500 else 5007


def workers_ai_envelope(result: Any) -> dict[str, Any]:
    return {"result": result, "success": True, "errors": [], "messages": []}


def workers_ai_error(error: APIError) -> dict[str, Any]:
    """Workers AI's error envelope: ``success: false`` and ``errors: [{"code": <int>, "message"}]``."""
    return {
        "result": None,
        "success": False,
        "errors": [{"code": workers_ai_code(error), "message": error.message}],
        "messages": [],
    }


@dataclass(frozen=True)
class WorkersAIShape:
    """Workers AI's ``/ai/run`` answers: ``{"result": {"response", "usage"}, "success", ...}``, or SSE
    ``{"response": "..."}`` events, the last one with ``usage``, then ``[DONE]``."""

    kind: str = "workers_ai"
    cost: Pricing | None = None
    json_mode: bool = False  # response_format asked for JSON: a complete answer is returned parsed
    # With tools: calls come back as ``tool_calls`` ([{"name", "arguments": {...}}]) beside ``response``
    # (the text before them); streamed, the calls come with the last event.
    tool_names: tuple[str, ...] = ()
    _parser: ToolCallParser | None = field(default=None, init=False, repr=False, compare=False)
    _message: ToolMessage | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tool_names:
            object.__setattr__(self, "_parser", ToolCallParser(self.tool_names))
            object.__setattr__(self, "_message", ToolMessage())

    def response(self, result: Result, prompt_tokens: int) -> dict[str, Any]:
        usage = usage_body(result.usage_or_count(prompt_tokens), self.cost)
        answer: Any = result.text
        if self.tool_names:
            message = parse_message(result.text, self.tool_names)
            body = {"response": message.content or ""}
            if message.tool_calls:
                body["tool_calls"] = _workers_ai_calls(message)
            return workers_ai_envelope({**body, "usage": usage})
        if self.json_mode and result.finish_reason == "stop":
            # Grammar-constrained, so a stopped answer parses; one cut by max_tokens stays text.
            with contextlib.suppress(ValueError):
                answer = json.loads(result.text)
        return workers_ai_envelope({"response": answer, "usage": usage})

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any] | None:
        # Workers AI's run route has no logprobs: its requests never ask for them.
        if self._parser is None:
            return {"response": text} if text else None
        deltas = self._parser.feed(text) + (self._parser.finish() if finish_reason else [])
        for delta in deltas:
            self._message.add(delta)
        content = "".join(d.content for d in deltas)
        if finish_reason and self._message.tool_calls:
            return {"response": content, "tool_calls": _workers_ai_calls(self._message)}
        return {"response": content} if content else None

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"response": "", "usage": usage_body(usage, self.cost)}

    def error_chunk(self, error: APIError) -> dict[str, Any]:
        return workers_ai_error(error)


def _workers_ai_calls(message: ToolMessage) -> list[dict[str, Any]]:
    """Workers AI's calls: the name and the arguments parsed (their text when a cut call's do not parse)."""
    calls = []
    for call in message.tool_calls:
        arguments: Any = call["function"]["arguments"]
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
        calls.append({"name": call["function"]["name"], "arguments": arguments})
    return calls


async def sse(
    events: AsyncIterator[tuple[int, Event]],
    shapes: list[Shape],
    prompt_tokens: int,
    include_usage: bool,
    on_finish: Callable[[list[Result]], None],
    usage_of: Callable[[list[Result]], dict[str, int]] | None = None,
) -> AsyncIterator[str]:
    """SSE ``data:`` payloads of a request's choices (``events``: (choice index, event), ``shapes``: one per
    choice): a role chunk per choice, content chunks as they come, each choice's finish chunk, usage if
    asked (``usage_of`` the results, default the one choice's), ``[DONE]``.

    A worker error after the stream began becomes an OpenAI error chunk (the status is already 200) and
    ends the stream. ``on_finish`` gets the accumulated results, however the stream ended.
    """
    results = [Result() for _ in shapes]
    many = len(shapes) > 1
    try:
        for index, shape in enumerate(shapes):
            if shape.kind == "chat":
                yield _dump(_indexed(shape.chunk("", None, first=True), index, many))
        async with aclosing(events) as tagged:
            async for index, event in tagged:
                results[index].add(event)
                if event.kind == "error":
                    yield _dump(shapes[index].error_chunk(event_error(event)))
                    break
                finish = event.finish_reason if event.kind == "final" else None
                if event.text or finish or event.logprobs:
                    chunk = shapes[index].chunk(event.text, finish, logprobs=event.logprobs)
                    if chunk is not None:
                        yield _dump(_indexed(chunk, index, many))
        if include_usage and all(r.error is None for r in results):
            usage = usage_of(results) if usage_of else results[0].usage_or_count(prompt_tokens)
            yield _dump(shapes[0].usage_chunk(usage))
        yield "[DONE]"
    finally:
        on_finish(results)


def _indexed(obj: dict[str, Any] | None, index: int, many: bool) -> dict[str, Any] | None:
    if many and obj is not None:
        for choice in obj.get("choices", ()):
            choice["index"] = index
    return obj


# Characters str.splitlines (and so httpx's ``iter_lines`` and many SSE clients) splits a line at, which
# json.dumps leaves raw with ensure_ascii=False; SSE itself ends lines only at CR/LF. Escaped, the data line
# stays one line for every client and decodes to the same text.
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def _dump(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
