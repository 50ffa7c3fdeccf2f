"""What one token's KV-cache entry is, as declared by a model; the allocator is built on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    """Per-token cache entry of a standard (MHA/GQA) transformer: K and V for every KV head of every layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element
