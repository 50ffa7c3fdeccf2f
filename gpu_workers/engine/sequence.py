"""One request's state inside the engine: its tokens, page table, sampling state and text."""

from __future__ import annotations

import enum
import logging
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_workers.engine.detokenizer import IncrementalDetokenizer
from gpu_workers.engine.params import RequestError, RequestOutput, SamplingParams, StreamEvent
from gpu_workers.kv.manager import PageTable

log = logging.getLogger(__name__)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved from params and the context/KV limits
    arrival: int  # admission order; lower is older (FCFS)
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    on_event: object = None  # callable(StreamEvent) or None
    output_ids: list[int] = field(default_factory=list)
    table: PageTable = field(default_factory=PageTable)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: RequestError | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted: bool = False
    export_kv: str | None = None  # KV format to export the prompt's KV in when the request finishes
    kv_import: Any = None  # KVBlock to load into the first pages at admission, instead of computing
    kv: Any = None  # the exported KVBlock (as the cache stores it until the step converts it)
    # The prompt's last ids that are output an earlier phase generated (prefill's first token, handed to
    # decode): the penalties count them as output, so a disaggregated request samples as a colocated one.
    streamed_output: int = 0
    matcher: Any = None  # the grammar's llguidance matcher (engine.grammar), advanced by each output token
    # The token ids as int64 arrays for the sampler's penalties, extended by the tokens appended since
    # (output_ids only grow); None until a penalised step first asks.
    _history: tuple[array, array] | None = field(default=None, repr=False)

    @property
    def imported_tokens(self) -> int:
        return self.kv_import.num_tokens if self.kv_import is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, copying only that range (called every step)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def history(self) -> tuple[array, array]:
        """(prompt ids, output ids so far) as int64 arrays, for ``sampling.apply_penalties``: each step
        copies only the tokens generated since the last call."""
        if self._history is None:
            context = len(self.prompt_ids) - self.streamed_output
            self._history = (array("q", self.prompt_ids[:context]), array("q", self.prompt_ids[context:]))
        prompt, output = self._history
        output.extend(self.output_ids[len(output) - self.streamed_output :])
        return prompt, output

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            token_ids=list(self.output_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.cached_tokens,
            error=self.error,
            kv=self.kv,
        )

    def event(self, token_ids: list[int], text: str, logprobs: list | None = None) -> StreamEvent:
        return StreamEvent(
            self.request_id,
            token_ids,
            text,
            self.finish_reason,
            self.error,
            self.kv,
            len(self.prompt_ids),
            self.cached_tokens,
            logprobs,
        )

    def deliver(self, event: StreamEvent) -> StreamEvent:
        """Hand an event to the request's callback; a callback that raises is the caller's bug, not the
        engine's, so it is logged and the engine goes on."""
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                log.exception("the event callback of request %s failed", self.request_id)
        return event

    def emit(self, token_ids: list[int], text: str) -> StreamEvent:
        return self.deliver(self.event(token_ids, text))
