"""The KV tensors of one engine: pages of K and V for every layer, sized from a byte budget."""

from __future__ import annotations

import torch

from gpu_workers.kv.spec import KVSpec


class KVCache:
    """K and V pages, shape [layers, pages, page_size, kv_heads, head_dim] each.

    A token's slot is ``page * page_size + offset``; writes scatter new tokens to their slots.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {page_size}")
        self.spec = spec
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        shape = (spec.num_layers, num_pages, page_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def pages_for_budget(spec: KVSpec, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        """How many whole pages fit in ``budget_bytes``."""
        return budget_bytes // (page_size * spec.bytes_per_token(dtype))

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer flattened to slots: [pages * page_size, kv_heads, head_dim]."""
        k = self.k[layer].view(-1, self.spec.num_kv_heads, self.spec.head_dim)
        v = self.v[layer].view(-1, self.spec.num_kv_heads, self.spec.head_dim)
        return k, v

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        k_slots, v_slots = self.layer(layer)
        k_slots[slot_mapping] = k.to(self.dtype)
        v_slots[slot_mapping] = v.to(self.dtype)
