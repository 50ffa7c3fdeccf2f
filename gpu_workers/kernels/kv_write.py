"""KV write: quantise new tokens' K or V to the cache format and scatter them into their slots.

``write_kv(x, slots, slot_mapping, page_scale, page_size)``: x [T, kv_heads, dim] goes to
``slots[slot_mapping]``, cast to the cache's element type; into int8 slots [slots, kv_heads, dim + 2] as
INT8 entries, each with its own scale (``formats.kv_int8``); or, with ``page_scale`` (FP8 caches), as e4m3
bits of ``x / page_scale[page]`` saturated at ±448 (``formats.fp8.quantize_fp8``). Page scales are set
before the write (``KVCache`` opens pages); this is only the element-wise part.
"""

from __future__ import annotations

import torch

from gpu_workers.formats.fp8 import quantize_fp8
from gpu_workers.formats.kv_int8 import is_int8, quantize_int8_entries
from gpu_workers.kernels import use_triton


def write_kv_reference(
    x: torch.Tensor,
    slots: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_scale: torch.Tensor | None,
    page_size: int,
) -> None:
    if page_scale is None:
        stored = quantize_int8_entries(x) if is_int8(slots.dtype) else x.to(slots.dtype)
        slots.index_copy_(0, slot_mapping, stored)  # faster than index_put_ on CPU
    else:
        slots[slot_mapping] = quantize_fp8(x, page_scale[slot_mapping // page_size][:, None, None])


def write_kv(
    x: torch.Tensor,
    slots: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_scale: torch.Tensor | None,
    page_size: int,
) -> None:
    if use_triton(x.device):
        from gpu_workers.kernels.kv_write_triton import write_kv_triton

        write_kv_triton(x, slots, slot_mapping, page_scale, page_size)
    else:
        write_kv_reference(x, slots, slot_mapping, page_scale, page_size)
