"""One finished request's outcome: what the records writer stores and what billing will charge for."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, computed_field, model_validator

from gpu_workers.protocol import Event
from tessera import responses, streaming
from tessera.models import utcnow

log = logging.getLogger(__name__)


class RequestOutcome(BaseModel):
    """The stream entry's JSON. Token counts are the worker's (the gateway's own count when it sent none);
    times are the gateway's. Unknown fields are ignored, so readers keep working as fields are added."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # Lengths as in request_records, so an entry that fits here fits there.
    request_id: str = Field(min_length=1, max_length=64)
    tenant_id: str = Field(max_length=32)
    key_id: str | None = Field(max_length=32)
    deployment: str = Field(max_length=200)  # the deployment that served it
    model: str = Field(max_length=200)  # the model id the client asked for (today: the deployment's name)
    status: Literal["completed", "failed", "cancelled"]
    error_code: str | None = Field(None, max_length=64)
    prompt_tokens: int = Field(ge=0)
    cached_tokens: int = Field(ge=0)  # prompt tokens served from the prefix cache
    output_tokens: int = Field(ge=0)
    started_at: AwareDatetime
    first_token_at: AwareDatetime | None = None
    finished_at: AwareDatetime

    @model_validator(mode="after")
    def _consistent(self) -> RequestOutcome:
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})"
            )
        return self

    @computed_field
    @property
    def fresh_tokens(self) -> int:
        """Prompt tokens computed anew (billed at the full input price)."""
        return self.prompt_tokens - self.cached_tokens

    @computed_field
    @property
    def ttft_s(self) -> float | None:
        if self.first_token_at is None:
            return None
        return (self.first_token_at - self.started_at).total_seconds()

    @computed_field
    @property
    def duration_s(self) -> float:
        return (self.finished_at - self.started_at).total_seconds()

    def record(self) -> dict[str, Any]:
        """This outcome as a ``RequestRecord`` row (for ``records.settle_records``)."""
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "key_id": self.key_id,
            "deployment": self.deployment,
            "model": self.model,
            "status": self.status,
            "error_code": self.error_code,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.output_tokens,
            "ttft_s": self.ttft_s,
            "duration_s": self.duration_s,
            "created_at": self.started_at,
            "finished_at": self.finished_at,
        }


@dataclass
class TimedReader(streaming.StreamReader):
    """A request's stream reader that also notes when the request started and when its first token came."""

    started_at: datetime | None = None  # None: when the reader was made
    first_token_at: datetime | None = None

    def __post_init__(self) -> None:
        self.started_at = self.started_at or utcnow()

    async def events(self) -> AsyncIterator[Event]:
        async with aclosing(super().events()) as events:
            async for event in events:
                if self.first_token_at is None and event.kind == "token":
                    self.first_token_at = utcnow()
                yield event


def outcome_of(
    result: responses.Result,
    reader: TimedReader,
    *,
    tenant_id: str,
    key_id: str | None,
    model: str,
    prompt_tokens: int,
) -> RequestOutcome:
    """The outcome of the request ``reader`` read, from its accumulated result."""
    usage = result.usage_or_count(prompt_tokens)
    if result.error is not None:
        status, code = "failed", str((result.error.error or {}).get("code", "internal_error"))[:64]
    elif result.finish_reason in (None, "abort"):
        status, code = "cancelled", None  # the client left before the end
    else:
        status, code = "completed", None
    prompt = usage.get("prompt_tokens", prompt_tokens)
    cached = usage.get("cached_tokens", 0)
    if cached > prompt:  # a worker bug; keep the record, and never bill negative fresh tokens
        log.warning(
            "request %s: the worker reported %d cached of %d prompt tokens", reader.request_id, cached, prompt
        )
        cached = prompt
    return RequestOutcome(
        request_id=reader.request_id,
        tenant_id=tenant_id,
        key_id=key_id,
        deployment=reader.deployment,
        model=model,
        status=status,
        error_code=code,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=usage.get("completion_tokens", 0),
        started_at=reader.started_at,
        first_token_at=reader.first_token_at,
        finished_at=utcnow(),
    )
