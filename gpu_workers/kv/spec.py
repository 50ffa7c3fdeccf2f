"""What one token's KV-cache entry is, as declared by a model; the allocator is built on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    """Per-token cache entry of a standard (MHA/GQA) transformer: K and V for every KV head of every layer.

    ``v_is_k``: the values are read from the keys' own slots and no V is stored (MLA's latent entry: one
    "KV head" holding the latent and the rope key; the model uses the latent part of the output).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_is_k: bool = False

    @property
    def tensors(self) -> int:
        """How many [tokens, kv_heads, head_dim] tensors one layer stores: K and V, or K alone."""
        return 1 if self.v_is_k else 2

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return self.tensors * self.num_layers * self.num_kv_heads * self.head_dim * element
