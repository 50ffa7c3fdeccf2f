"""The engine's public data: its configuration, per-request sampling parameters, and outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_workers.engine.dtype import DTYPES, DtypeChoice, resolve_dtype
from gpu_workers.protocol import MAX_TOP_LOGPROBS, Grammar, TokenLogprob

# The error code of every request of an engine that stopped for good (``Engine.failed``): a device error, or
# steps that kept failing. A worker reports it as ``worker_lost`` and exits so that it is restarted.
ENGINE_FAILED = "engine_failed"


class InvalidRequest(ValueError):
    """A request the engine refuses before it runs; ``code`` is stable, the message says what to fix."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class EngineConfig:
    dtype: str = "auto"  # auto: bf16 on CUDA and on CPUs where bf16 is fast, else fp32 (engine.dtype)
    kv_budget_bytes: int = 256 * 2**20
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024  # per-step token budget; prefill is chunked to fit it
    max_model_len: int | None = None  # defaults to the model's context length
    device: str = "cpu"
    seed: int = 0
    # auto (= dtype, unquantised), bf16, int8 (8-bit codes, each entry with its own scale) or fp8_e4m3
    kv_cache_dtype: str = "auto"
    # auto (= whatever the checkpoint holds), bf16 (unquantised, in dtype), fp8 or int4 (an unquantised
    # checkpoint is quantised as it loads); independent of the KV format
    weights: str = "auto"
    kv_scales: str | None = None  # static FP8 KV scales (`tessera calibrate`); None: dynamic per sequence
    integrity_check: bool = True  # verify page generations before every step reads the cache
    prefix_cache: bool = True  # reuse full KV pages of a tenant's earlier prompts
    prefix_cache_secret: bytes | None = None  # keys tenant salts; None draws a random one per engine
    # Decode steps replayed from CUDA graphs, one per batch-size bucket (engine/graphs.py); one KV page is
    # kept aside for padded rows. Meant for CUDA; on a CPU the same static-buffer step runs eagerly.
    cuda_graphs: bool = False
    # A request's tokens do not depend on the rest of its batch (engine/invariance.py): linears padded to 16
    # rows, prefill cut into fixed chunks. Costs speed at small batches; for clients that need a seeded
    # answer reproduced exactly.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {['auto', *sorted(DTYPES)]}, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "bf16", "int8", "fp8_e4m3"):
            raise ValueError(
                f"kv_cache_dtype must be auto, bf16, int8 or fp8_e4m3, got {self.kv_cache_dtype!r}"
            )
        if self.weights not in ("auto", "bf16", "fp8", "int4"):
            raise ValueError(f"weights must be auto, bf16, fp8 or int4, got {self.weights!r}")
        if self.kv_scales is not None and self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError(
                f"kv_scales are FP8 KV scales; set kv_cache_dtype='fp8_e4m3' (it is {self.kv_cache_dtype!r})"
            )
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        for name in ("kv_budget_bytes", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.batch_invariant and self.max_num_batched_tokens < 2 * self.page_size:
            raise ValueError(
                "batch_invariant cuts prefill into whole pages of at most half the step's budget: "
                f"max_num_batched_tokens must be at least {2 * self.page_size}, got {self.max_num_batched_tokens}"
            )

    @property
    def compute_dtype(self) -> DtypeChoice:
        """The dtype the model computes in: ``dtype``, or what "auto" resolves to on ``device``."""
        return resolve_dtype(self.dtype, self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.compute_dtype.torch_dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's dtype for "auto", else the named format."""
        named = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
        return named.get(self.kv_cache_dtype, self.torch_dtype)


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; ``max_tokens`` None means up to the context limit."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Repetition guards, applied to the logits before temperature (engine.sampling.apply_penalties).
    # OpenAI's: subtract frequency_penalty * count + presence_penalty * (count > 0), counts over this
    # request's generated tokens; range -2..2, 0 = off.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # HF/vLLM's: tokens of the prompt or the output have positive logits divided by it and negative ones
    # multiplied; > 0, 1 = off, > 1 discourages repeats.
    repetition_penalty: float = 1.0
    # The output must match it (``gpu_workers.grammars``): its mask is applied before penalties and sampling,
    # and the request stops where the grammar is complete.
    grammar: Grammar | None = None
    # Each token's log-probability and that many most likely alternatives (0..20); None: none
    # (``sampling.token_logprobs`` says which distribution).
    logprobs: int | None = None

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise InvalidRequest naming the first bad field."""
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise InvalidRequest(
                "invalid_max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}"
            )
        if not self.temperature >= 0:
            raise InvalidRequest("invalid_temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("invalid_top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(
                "invalid_top_k", f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not -2 <= value <= 2:
                raise InvalidRequest(f"invalid_{name}", f"{name} must be a number in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if isinstance(rep, bool) or not isinstance(rep, int | float) or not 0 < rep < float("inf"):
            raise InvalidRequest(
                "invalid_repetition_penalty",
                f"repetition_penalty must be a finite number > 0 (1 disables it), got {rep!r}",
            )
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):  # fmt: skip
            raise InvalidRequest(
                "invalid_logprobs",
                f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}",
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("invalid_stop", "stop must be a list of non-empty strings")


@dataclass
class RequestError:
    code: str
    message: str


@dataclass
class RequestOutput:
    """A finished request (from ``generate``) or the state so far (``finished`` False while streaming)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None  # stop | length | abort | error; None while running
    prompt_tokens: int
    cached_tokens: int = 0
    error: RequestError | None = None
    kv: Any = None  # KVBlock of the prompt when the request asked for export_kv (prefill → decode)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "error": None if self.error is None else {"code": self.error.code, "message": self.error.message},
        }


@dataclass
class StreamEvent:
    """One increment of a running request: the new tokens and the text they completed."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: RequestError | None = None
    kv: Any = None  # on the final event of an export_kv request: its KVBlock
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (known once admitted)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
