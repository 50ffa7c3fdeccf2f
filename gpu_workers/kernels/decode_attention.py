"""Paged decode attention: one query token per sequence attending to its cached K/V through its page table.

``paged_decode_attention`` (reference here, kernel in ``decode_attention_triton``) takes tensors a kernel
can read: q [B, heads, dim], the layer's cache slots [pages * page_size, kv_heads, dim] (BF16 as stored,
or FP8 bits with per-page ``k_scale``/``v_scale``), ``block_tables`` [B, max_pages] and ``seq_lens`` [B].
``paged_attention`` has ``gpu_workers.kv.attention.paged_attention``'s signature: it runs the decode rows
of a step through ``paged_decode_attention`` and leaves prefill rows to the kv reference.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gpu_workers.kernels import use_triton
from gpu_workers.kv.formats import dequantize_fp8


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequence b's query attends to positions [max(0, len - window), len) of its pages; [B, heads, dim].

    GQA: query head h reads KV head ``h // (heads // kv_heads)``. Computed in fp32, returned in q's dtype.
    """
    heads, kv_heads = q.shape[1], k_slots.shape[1]
    positions = torch.arange(block_tables.shape[1] * page_size, device=q.device)
    pages = block_tables.long()[:, positions // page_size]  # [B, L]
    slots = pages * page_size + positions % page_size
    k = _read(k_slots, slots, k_scale, pages).repeat_interleave(heads // kv_heads, dim=2)  # [B, L, H, D]
    v = _read(v_slots, slots, v_scale, pages).repeat_interleave(heads // kv_heads, dim=2)
    lens = seq_lens.long()[:, None]
    valid = positions[None, :] < lens
    if sliding_window is not None:
        valid &= positions[None, :] >= lens - sliding_window
    scores = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bhl,blhd->bhd", probs, v).to(q.dtype)


def _read(
    slots: torch.Tensor, index: torch.Tensor, page_scale: torch.Tensor | None, pages: torch.Tensor
) -> torch.Tensor:
    x = slots[index]
    if page_scale is None:
        return x.float()
    return dequantize_fp8(x, page_scale[pages][..., None, None], torch.float32)


def paged_decode_attention(
    q: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    args = (q, k_slots, v_slots, block_tables, seq_lens, page_size, scale, sliding_window, k_scale, v_scale)
    if use_triton(q.device):
        from gpu_workers.kernels.decode_attention_triton import paged_decode_attention_triton

        return paged_decode_attention_triton(*args)
    return paged_decode_attention_reference(*args)


def paged_attention(
    q: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    meta,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kv.attention.paged_attention`` with its decode rows on the Triton kernel where kernels run."""
    # Imported here: kv.attention calls into this module, so a module-level import would be circular.
    from gpu_workers.kv import attention as reference

    if not use_triton(q.device):
        return reference.paged_attention(q, k_slots, v_slots, meta, scale, sliding_window, k_scale, v_scale)
    # A group padded to one query row is the step's decode rows (AttentionMetadata groups them apart).
    decode = [g for g in meta.groups if g.q_index.shape[1] == 1]
    others = [g for g in meta.groups if g.q_index.shape[1] != 1]
    out = reference.paged_attention(
        q, k_slots, v_slots, replace(meta, groups=others), scale, sliding_window, k_scale, v_scale
    )
    for g in decode:
        rows = g.q_index[:, 0]
        # Key positions are clamped to the last token, so every page-start entry names a real page.
        block_tables = (g.key_slots[:, :: meta.page_size] // meta.page_size).to(torch.int32)
        seq_lens = (g.q_pos[:, 0] + 1).to(torch.int32)
        out[rows] = paged_decode_attention(
            q[rows],
            k_slots,
            v_slots,
            block_tables,
            seq_lens,
            meta.page_size,
            scale,
            sliding_window,
            k_scale,
            v_scale,
        )
    return out
