"""Paged attention: queries attending to cached K/V through page tables; the torch reference and the
dispatch to the Triton decode kernel, in one place.

``paged_attention`` takes a step's flat queries and ``kv.attention.AttentionMetadata`` (groups of rows
padded together: index maps and masks). The reference gathers the slots a group needs and dequantises
only those, with the per-page scales the cache keeps. Where kernels run, the decode rows (one query each)
go to ``paged_decode_attention`` instead: reference here, kernel in ``paged_attention_triton``, taking
tensors a kernel can read: q [B, heads, dim], the layer's cache slots [pages * page_size, kv_heads, dim]
(BF16 as stored, or FP8 bits with per-page ``k_scale``/``v_scale``), ``block_tables`` [B, max_pages] and
``seq_lens`` [B].
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from gpu_workers.formats.fp8 import dequantize_fp8
from gpu_workers.kernels import use_triton


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
        from gpu_workers.kernels.paged_attention_triton import paged_decode_attention_triton

        return paged_decode_attention_triton(*args)
    return paged_decode_attention_reference(*args)


def paged_attention_reference(
    q: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    meta,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the flat queries ``q`` [T, heads, dim] over cached slots [slots, kv_heads, dim].

    GQA: query head h reads KV head ``h // (heads // kv_heads)``. Returns [T, heads, dim] in q's dtype.
    FP8 slots (uint8 bits) come with ``k_scale``/``v_scale``, the per-page scales [pages] of this layer.
    """
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_slots.shape[1]
    for g in meta.groups:
        qg = q[g.q_index].transpose(1, 2)  # [B, H, Q, D]
        kg = _gather(k_slots, g.key_slots, k_scale, meta.page_size, q.dtype).transpose(1, 2)  # [B, Hkv, K, D]
        vg = _gather(v_slots, g.key_slots, v_scale, meta.page_size, q.dtype).transpose(1, 2)
        mask = g.key_pos[:, None, :] <= g.q_pos[:, :, None]  # [B, Q, K]
        if sliding_window is not None:
            mask &= g.key_pos[:, None, :] > g.q_pos[:, :, None] - sliding_window
        o = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=mask[:, None], scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        o = o.transpose(1, 2)  # [B, Q, H, D]
        out[g.q_index[g.q_valid]] = o[g.q_valid]
    return out


def _gather(
    slots: torch.Tensor,
    index: torch.Tensor,
    page_scale: torch.Tensor | None,
    page_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The cached entries at ``index`` [B, K] as [B, K, kv_heads, dim] in ``dtype``, dequantised if FP8."""
    x = slots[index]
    if page_scale is None:
        return x.to(dtype)
    return dequantize_fp8(x, page_scale[index // page_size][..., None, None], dtype)


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
    """``paged_attention_reference`` with its decode rows on the Triton kernel where kernels run."""
    if not use_triton(q.device):
        return paged_attention_reference(q, k_slots, v_slots, meta, scale, sliding_window, k_scale, v_scale)
    # A group padded to one query row is the step's decode rows (AttentionMetadata groups them apart).
    decode = [g for g in meta.groups if g.q_index.shape[1] == 1]
    others = [g for g in meta.groups if g.q_index.shape[1] != 1]
    out = paged_attention_reference(
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
