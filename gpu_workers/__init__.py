"""Tessera's data plane: model code, paged KV cache, engine and worker pools.

Exports are lazy so that importing ``gpu_workers.protocol`` (all the gateway needs) never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_workers.engine import Engine, EngineConfig, SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gpu_workers import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'gpu_workers' has no attribute {name!r}")
