"""HF-compatible model code (Llama family, Mixtral) and the checkpoint loader; ``load_model`` is the face.

What a checkpoint declares (``config.json``) is read by the torch-free ``gpu_workers.checkpoint``, and its
tokenizer by ``gpu_workers.tokenizer``.
"""

from gpu_workers.model.loader import load_model

__all__ = ["load_model"]
