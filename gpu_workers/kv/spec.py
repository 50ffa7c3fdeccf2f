"""What one token's KV-cache entry is, as declared by a model; the allocator is built on it.

The same declaration prices the cache: ``page_bytes`` is what ``KVCache`` allocates per page in a KV
format (elements plus that format's scales), and ``tessera capacity`` plans with it, so the planner and
the engine cannot disagree about bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_workers.formats.fp8 import SCALE_DTYPE, is_fp8, storage_dtype
from gpu_workers.formats.kv_int8 import SCALE_BYTES, is_int8


@dataclass(frozen=True)
class KVSpec:
    """Per-token cache entry of a standard (MHA/GQA) transformer: K and V for every KV head of every layer.

    ``v_is_k``: the values are read from the keys' own slots and no V is stored (MLA's latent entry: one
    "KV head" holding the latent and the rope key; the model uses the latent part of the output).
    ``bf16_tail``: in an FP8 cache, the last this many values of every entry stay bf16 and only the rest
    is e4m3 under the page scale (MLA's rope key, as the published FP8 MLA layouts keep it); the stored
    entry is then ``head_dim + bf16_tail`` bytes (``formats.fp8.quantize_fp8_entry``). An INT8 cache stores
    ``head_dim + 2`` bytes per entry, codes and the entry's own scale (``formats.kv_int8``), and has no
    ``bf16_tail``. Unquantised caches store every value as it is.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_is_k: bool = False
    bf16_tail: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.bf16_tail < self.head_dim:
            raise ValueError(f"bf16_tail must be in [0, head_dim={self.head_dim}), got {self.bf16_tail}")

    def stored_dim(self, dtype: torch.dtype) -> int:
        """Width of one stored entry in ``storage_dtype(dtype)`` elements (bytes for FP8, tail included;
        bytes for INT8, scale included)."""
        if is_int8(dtype):
            return self.head_dim + SCALE_BYTES
        return self.head_dim + self.bf16_tail if is_fp8(dtype) else self.head_dim

    @property
    def tensors(self) -> int:
        """How many [tokens, kv_heads, head_dim] tensors one layer stores: K and V, or K alone."""
        return 1 if self.v_is_k else 2

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Element bytes of one token's entry in ``dtype`` elements (no scales)."""
        element = torch.empty((), dtype=dtype).element_size()
        return self.tensors * self.num_layers * self.num_kv_heads * self.head_dim * element

    def page_bytes(self, page_size: int, dtype: torch.dtype) -> int:
        """Bytes one page of ``page_size`` tokens costs in a cache of ``dtype`` (``KVCache``'s formats):
        its entries (an INT8 entry's scale included) plus, for FP8, one fp32 scale per stored tensor (K, and
        V unless ``v_is_k``) per layer."""
        scales = self.tensors * self.num_layers * SCALE_DTYPE.itemsize if is_fp8(dtype) else 0
        element = torch.empty((), dtype=storage_dtype(dtype)).element_size()
        entry = self.tensors * self.num_layers * self.num_kv_heads * self.stored_dim(dtype) * element
        return page_size * entry + scales
