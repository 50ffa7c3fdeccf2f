"""Request bodies of the OpenAI-compatible endpoints, validated strictly (wrong types are 400s, not coerced).

Unknown top-level fields are ignored, as OpenAI's API does; parameters we know but cannot honour are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gpu_workers.protocol import MAX_TOP_LOGPROBS
from gpu_workers.tokenizer import check_text

MAX_STOP_SEQUENCES = 4
MAX_SEED = 2**63 - 1
MAX_TOOLS = 128  # as OpenAI's API
MAX_CHOICES = 8  # n: each choice is a generation of its own (tessera.choices)
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
# OpenAI parameters this gateway cannot honour: refused rather than silently ignored.
UNSUPPORTED = (
    "functions",
    "logit_bias",
    "echo",
    "suffix",
)


def _valid_unicode(value: Any) -> Any:
    # Before pydantic's own checks, which reject a lone surrogate with a message that hides the cause.
    return check_text(value) if isinstance(value, str) else value


# Text the tokenizer, the database and the task queue can all hold: valid Unicode (no lone surrogates).
Text = Annotated[str, BeforeValidator(_valid_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Text = Field(pattern=TOOL_NAME)
    arguments: Text  # a JSON object's text, as the model wrote it


class ToolCall(_Strict):
    """A call an assistant message made (sent back in the conversation)."""

    id: Text = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # validate_default: a missing content is checked like an explicit null.
    content: Text | list[TextPart] | None = Field(None, validate_default=True)
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: Text | None = None  # tool messages: the call this is the result of

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, value: Any, info: ValidationInfo) -> Any:
        # OpenAI allows null content only on assistant messages (those that carried tool calls).
        role = info.data.get("role")
        if value is None and role is not None and role != "assistant":
            raise ValueError(
                f"a {role} message needs content (a string or a list of text parts); "
                "only assistant messages may have null content"
            )
        return value

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: plain-text content; ``developer`` is OpenAI's new
        name for ``system``, which is what checkpoints' templates know."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text}


class GenerationRequest(_Strict):
    """What both endpoints share. ``None`` means the default, as in OpenAI's API."""

    unsupported: ClassVar[tuple[str, ...]] = UNSUPPORTED

    model: Text = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[Text] | None = None  # a single string is taken as a list of one
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Choices to generate for the prompt (its KV prefilled once, shared through the prefix cache).
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    user: Text | None = None
    # An extension (as vLLM's): generate exactly max_tokens, past end-of-sequence; benchmarks need fixed lengths.
    ignore_eos: bool = False
    # Repetition guards: OpenAI's two (over the tokens generated so far, 0 = off) and, as vLLM's
    # extension, HF's repetition_penalty (over prompt and output, 1 = off, > 1 discourages repeats).
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in cls.unsupported:
                if data.get(name) not in (None, False, [], {}, 0):
                    raise ValueError(f"'{name}' is not supported by this API; remove it from the request")
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _valid_stop(cls, value: list[str] | None) -> list[str] | None:
        stops = value or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_asked(self) -> int | None:
        """How many alternatives each token's logprob comes with; None when logprobs were not asked for."""
        return None


class JsonSchemaFormat(_Strict):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Text | None = None
    # The JSON Schema the answer must match (the subset README "Structured outputs" lists).
    schema_: dict[str, Any] = Field(alias="schema")
    # OpenAI's strict mode; the schema is always enforced here (grammar-constrained), so both are accepted.
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema; both JSON kinds
    are enforced by a grammar on the model's tokens, never by asking nicely."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(
                "response_format of type 'json_schema' needs a 'json_schema' object with a 'schema'"
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format of type {self.type!r} takes no 'json_schema'")
        return self


class FunctionDefinition(_Strict):
    name: Text = Field(pattern=TOOL_NAME)
    description: Text | None = None
    # The arguments' JSON Schema (an object); checked and enforced as response_format's schemas are.
    parameters: dict[str, Any] | None = None
    # Absent or true: the arguments are enforced (grammar-constrained); false: OpenAI's best effort, nothing
    # enforced under tool_choice auto, and a forced call's arguments only held to be a JSON object.
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: Text = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    # OpenAI's default: "auto" when there are tools, "none" otherwise.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Each output token's log-probability (the distribution it was sampled from: after penalties and the
    # grammar's mask, temperature 1 when greedy), with top_logprobs most likely alternatives.
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        seen: set[str] = set()
        for tool in value or []:
            if tool.function.name in seen:
                raise ValueError(f"two tools are named {tool.function.name!r}; tool names must be unique")
            seen.add(tool.function.name)
        return value

    def requested_max_tokens(self) -> int | None:
        # OpenAI's newer name wins when both are sent, as in OpenAI's API.
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(GenerationRequest):
    unsupported: ClassVar[tuple[str, ...]] = (*UNSUPPORTED, "top_logprobs")
    # Each output token's log-probability and this many most likely alternatives (OpenAI's legacy form).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    # OpenAI also takes a batch (a list of strings or of token-id lists); a batch of one is unwrapped
    # before validation, so errors name the one prompt's own problem.
    prompt: Text | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError(f"send one prompt per request, got {len(value)}")
            return value[0]
        return value
