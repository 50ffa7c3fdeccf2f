"""HF-compatible model code, checkpoint loader and tokenizer.

Exports are lazy: the tokenizer and config are torch-free, so the gateway can import them without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_workers.model.config import ModelConfig
    from gpu_workers.model.errors import ModelLoadError
    from gpu_workers.model.loader import load_model
    from gpu_workers.model.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer

_EXPORTS = {
    "ChatTemplateError": "gpu_workers.model.tokenizer",
    "ModelConfig": "gpu_workers.model.config",
    "ModelLoadError": "gpu_workers.model.errors",
    "Tokenizer": "gpu_workers.model.tokenizer",
    "load_model": "gpu_workers.model.loader",
    "load_tokenizer": "gpu_workers.model.tokenizer",
}
__all__ = ["ChatTemplateError", "ModelConfig", "ModelLoadError", "Tokenizer", "load_model", "load_tokenizer"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpu_workers.model' has no attribute {name!r}")
