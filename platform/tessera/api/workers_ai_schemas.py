"""Workers AI's request and response bodies: a run (``prompt`` or ``messages`` and sampling options), a batch
(``{"requests": [...]}``) and its poll (``{"request_id"}``); the envelope, usage with cost, batch results.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessera.api.embeddings import TextEmbeddingResult
from tessera.api.schemas import MAX_SEED, ChatMessage, Text


class RunOptions(BaseModel):
    """Workers AI's per-request options; ``rejectIfBusy`` answers 429 at once when the model is busy."""

    model_config = ConfigDict(strict=True, extra="ignore")

    rejectIfBusy: bool = False  # noqa: N815 (Workers AI's spelling)


class RunResponseFormat(BaseModel):
    """Workers AI's JSON mode: ``json_object``, or ``json_schema`` with the JSON Schema itself as
    ``json_schema`` (OpenAI wraps it in ``{"name", "schema"}``; Workers AI does not)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_when_json_schema(self) -> RunResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "response_format needs 'json_schema' (a JSON Schema) exactly when its type is 'json_schema'"
            )
        return self

    def as_openai(self) -> dict[str, Any]:
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": "workers_ai", "schema": self.json_schema}}


class RunRequest(BaseModel):
    """A text-generation request as Workers AI takes it: ``prompt`` or ``messages``, not both."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    prompt: Text | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    stream: bool = False
    options: RunOptions | None = None
    response_format: RunResponseFormat | None = None
    # Workers AI's flat tools ({"name", "description", "parameters"}) or OpenAI's ({"type": "function",
    # "function": {...}}); tool_choice as OpenAI's (default "auto").
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> RunRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either 'prompt' or 'messages' (one of them, not both)")
        return self


class BatchRequest(BaseModel):
    """``?queueRequest=true``: run these requests later, at lower priority, and poll for the results."""

    model_config = ConfigDict(extra="forbid")

    requests: list[dict[str, Any]] = Field(
        min_length=1,
        description="each a run body (prompt or messages, sampling options) plus an optional "
        "external_reference returned with its result; validated one by one",
    )


class PollRequest(BaseModel):
    """Ask for a queued batch's status, or its results once every request has run."""

    model_config = ConfigDict(strict=True, extra="forbid")

    request_id: str = Field(min_length=1, max_length=64)


class BatchItemRequest(RunRequest):
    external_reference: str | None = Field(None, max_length=200)


class CostDetails(BaseModel):
    """What ``cost`` is made of, in USD; ``micro_usd`` is the exact total the ledger records."""

    currency: str = "USD"
    micro_usd: int
    cached_input: float
    fresh_input: float
    output: float
    cached_input_discount: float = Field(description="saved by the cached input, against the fresh price")
    price_version: int | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
    cost: float | None = Field(None, description="the request's cost in USD, as the ledger records it")
    cost_details: CostDetails | None = None


class RunToolCall(BaseModel):
    name: str
    arguments: dict[str, Any] | str  # parsed; the text of a call cut by max_tokens


class RunResult(BaseModel):
    response: str | dict[str, Any] | list[Any]  # JSON mode: the answer parsed
    tool_calls: list[RunToolCall] | None = None
    usage: Usage


class Message(BaseModel):
    code: int
    message: str


class BatchStatus(BaseModel):
    status: Literal["queued", "running"]
    request_id: str
    model: str


class BatchResponse(BaseModel):
    id: int = Field(description="the request's index in the batch")
    result: RunResult | None
    success: bool
    external_reference: str | None
    errors: list[Message] = Field(default_factory=list)


class BatchResults(BaseModel):
    responses: list[BatchResponse]
    usage: Usage = Field(description="the sum over the batch's requests")


class RunEnvelope(BaseModel):
    result: RunResult | TextEmbeddingResult | BatchStatus | BatchResults | None
    success: bool
    errors: list[Message]
    messages: list[Message]
