"""Scheduler, batches, sampling and the step loop; ``Engine`` is the public face."""

from gpu_workers.engine.engine import Engine
from gpu_workers.engine.params import (
    EngineConfig,
    InvalidRequest,
    RequestError,
    RequestOutput,
    SamplingParams,
    StreamEvent,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "InvalidRequest",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StreamEvent",
]
