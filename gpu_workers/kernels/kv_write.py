"""KV write: quantise new tokens' K or V to the cache format and scatter them into their slots.

``write_kv(x, slots, slot_mapping, page_scale, page_size)``: x [T, kv_heads, dim] goes to
``slots[slot_mapping]``, cast to the cache's element type; into int8 slots [slots, kv_heads, dim + 2] as
INT8 entries, each with its own scale (``formats.kv_int8``); or, with ``page_scale`` (FP8 caches), as e4m3
bits of ``x / page_scale[page]`` saturated at ±448 (``formats.fp8.quantize_fp8``). Page scales are set
before the write (``KVCache`` opens pages); this is only the element-wise part.

``rotate_write_kv``: the same write straight from a fused q/k/v projection's output, q and k rotated by
position first (``rotary.apply_rotary``), INT8 keys and their queries Hadamard-rotated too (``KVCache``):
the split, the rotations and both writes are one kernel launch where Triton runs, and the queries come back
ready for the decode kernel.
"""

from __future__ import annotations

import torch

from gpu_workers.formats.fp8 import quantize_fp8
from gpu_workers.formats.kv_int8 import hadamard, is_int8, quantize_int8_entries
from gpu_workers.kernels import use_triton
from gpu_workers.kernels.rotary import apply_rotary


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


def rotate_write_kv_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_block: int,
) -> torch.Tensor:
    tokens, dim = qkv.shape[0], cos.shape[1]
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    q, k = apply_rotary(qk, cos, sin).split([heads, kv_heads], dim=1)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    if key_block > 1:
        q, k = hadamard(q, key_block).to(q.dtype), hadamard(k, key_block)
    write_kv_reference(k, k_slots, slot_mapping, None, 1)
    write_kv_reference(v, v_slots, slot_mapping, None, 1)
    return q


def rotate_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_block: int,
) -> torch.Tensor:
    """From qkv [T, (heads + 2 kv_heads) * dim] and the rotary tables ``cos``/``sin`` [T, dim] (qkv's dtype):
    rotate q and k, write k and v to their slots (unquantised, or INT8 entries with keys times the
    ``key_block`` Hadamard matrix, as ``KVCache.write``), and return the queries [T, heads, dim] as the
    cache's keys are read (``KVCache.queries``: Hadamard-rotated when ``key_block`` > 1)."""
    args = (qkv, cos, sin, heads, kv_heads, k_slots, v_slots, slot_mapping, key_block)
    if use_triton(qkv.device):
        from gpu_workers.kernels.kv_write_triton import rotate_write_kv_triton

        return rotate_write_kv_triton(*args)
    return rotate_write_kv_reference(*args)
