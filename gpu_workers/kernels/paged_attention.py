"""Paged attention: queries attending to cached K/V through page tables; the torch reference and the
dispatch to the Triton decode kernel, in one place.

``paged_attention`` takes a step's flat queries and ``kv.metadata.AttentionMetadata`` (decode rows with
their block tables and per-step masks; prefill rows one by one). The reference gathers the whole pages
a row needs and dequantises only those, with the per-page scales the cache keeps. Where kernels run, the decode rows (one query each)
go to ``paged_decode_attention`` instead: reference here, kernel in ``paged_attention_triton``, taking
tensors a kernel can read: q [B, heads, dim], the layer's cache slots [pages * page_size, kv_heads, dim]
(BF16 as stored, FP8 bits with per-page ``k_scale``/``v_scale``, or INT8 entries [.., dim + 2] that carry
their own scales), ``block_tables`` [B, max_pages] and ``seq_lens`` [B].
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from gpu_workers.formats.fp8 import dequantize_fp8_entry
from gpu_workers.formats.kv_int8 import dequantize_int8_entries, is_int8
from gpu_workers.kernels import use_cpu_kernels, use_triton


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
    dim = q.shape[-1]
    k = _read(k_slots, slots, k_scale, pages, dim).repeat_interleave(heads // kv_heads, dim=2)  # [B, L, H, D]
    v = _read(v_slots, slots, v_scale, pages, dim).repeat_interleave(heads // kv_heads, dim=2)
    lens = seq_lens.long()[:, None]
    valid = positions[None, :] < lens
    if sliding_window is not None:
        valid &= positions[None, :] >= lens - sliding_window
    scores = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bhl,blhd->bhd", probs, v).to(q.dtype)


def _read(
    slots: torch.Tensor, index: torch.Tensor, page_scale: torch.Tensor | None, pages: torch.Tensor, dim: int
) -> torch.Tensor:
    x = slots[index]
    if is_int8(x.dtype):
        return dequantize_int8_entries(x, torch.float32)
    if page_scale is None:
        return x.float()
    return dequantize_fp8_entry(x, page_scale[pages][..., None, None], torch.float32, dim)


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
    if use_cpu_kernels(q.device) and _cpu_kernel_reads(k_slots, q):
        from gpu_workers.kernels.paged_attention_cpu import paged_decode_attention_cpu

        return paged_decode_attention_cpu(*args)
    return paged_decode_attention_reference(*args)


def _cpu_kernel_reads(k_slots: torch.Tensor, q: torch.Tensor) -> bool:
    from gpu_workers.kernels.paged_attention_cpu import supports

    return supports(k_slots, q)


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
    Decode rows attend in one call per length group over their gathered pages (whole pages: one copy per
    page, not per slot); prefill rows in one call per group of equal context and chunk lengths, unpadded.
    """
    out = torch.empty_like(q)
    heads, kv_heads, head_dim = q.shape[1], k_slots.shape[1], q.shape[2]
    gqa = heads != kv_heads
    page_size = meta.page_size
    decode = meta.decode
    for group in (decode.groups or [decode]) if decode is not None else []:
        tables = group.block_tables
        k = _gather_pages(k_slots, tables, k_scale, page_size, q.dtype, head_dim).transpose(
            1, 2
        )  # [B, Hkv, L, D]
        v = _gather_pages(v_slots, tables, v_scale, page_size, q.dtype, head_dim).transpose(1, 2)
        # The query heads sharing a KV head act as that head's query rows: GQA without repeating K/V.
        rows = q[group.rows].view(-1, kv_heads, heads // kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            rows, k, v, attn_mask=group.mask(page_size, sliding_window, q.dtype), scale=scale
        )
        out[group.rows] = o.reshape(-1, heads, head_dim)
    if meta.prefill:  # every prefill row's pages in one gather (and one dequantisation) per tensor
        pages = meta.prefill_pages[None]
        k_all = _gather_pages(k_slots, pages, k_scale, page_size, q.dtype, head_dim)[0]
        v_all = _gather_pages(v_slots, pages, v_scale, page_size, q.dtype, head_dim)[0]
    for group in meta.prefill:
        ctx, n, rows = group.context_len, group.query_len, group.rows
        lo, width = group.first_page * page_size, -(-ctx // page_size) * page_size
        k, v = (
            x[lo : lo + rows * width].view(rows, width, *x.shape[1:])[:, :ctx].transpose(1, 2)
            for x in (k_all, v_all)
        )
        mask = None
        if n != ctx or sliding_window is not None:
            key_pos = torch.arange(ctx, device=q.device)
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = key_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                mask &= key_pos[None, :] > q_pos[:, None] - sliding_window
        queries = q[group.span] if group.span is not None else q.index_select(0, group.tokens)
        o = F.scaled_dot_product_attention(
            queries.view(rows, n, heads, head_dim).transpose(1, 2),
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        ).transpose(1, 2)
        if group.span is not None:
            out[group.span] = o.reshape(rows * n, heads, head_dim)
        else:
            out.index_copy_(0, group.tokens, o.reshape(rows * n, heads, head_dim))
    return out


def _gather_pages(
    slots: torch.Tensor,
    tables: torch.Tensor,
    page_scale: torch.Tensor | None,
    page_size: int,
    dtype: torch.dtype,
    dim: int,
) -> torch.Tensor:
    """The pages ``tables`` [B, P] names as [B, P * page_size, kv_heads, dim] in ``dtype``, dequantised if FP8
    (FP8 slots wider than ``dim`` carry a bf16 tail: ``formats.fp8.dequantize_fp8_entry``) or INT8."""
    rows, width = tables.shape
    pages = slots.view(-1, page_size, *slots.shape[1:]).index_select(0, tables.flatten())
    if is_int8(pages.dtype):
        x = dequantize_int8_entries(pages, dtype)
    elif page_scale is None:
        x = pages.to(dtype)
    else:
        x = dequantize_fp8_entry(pages, page_scale[tables.flatten()][:, None, None, None], dtype, dim)
    return x.view(rows, width * page_size, *x.shape[2:])


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
    """``paged_attention_reference`` with its decode rows on a kernel where kernels run: Triton on CUDA,
    numba on the CPU."""
    # The decode kernels read whole-entry FP8, INT8 or unquantised slots; an FP8 entry with a bf16 tail
    # (wider slots than the queries) stays on the reference.
    kernel = use_triton(q.device) or (use_cpu_kernels(q.device) and _cpu_kernel_reads(k_slots, q))
    tail = k_slots.shape[-1] != q.shape[-1] and not is_int8(k_slots.dtype)
    if not kernel or meta.decode is None or tail:
        return paged_attention_reference(q, k_slots, v_slots, meta, scale, sliding_window, k_scale, v_scale)
    decode = meta.decode
    tables, lens = decode.int32_tables()
    args = (k_slots, v_slots, tables, lens, meta.page_size, scale, sliding_window, k_scale, v_scale)
    if not meta.prefill:  # a decode-only step: one row per token, in order
        return paged_decode_attention(q, *args)
    out = paged_attention_reference(
        q, k_slots, v_slots, replace(meta, decode=None), scale, sliding_window, k_scale, v_scale
    )
    out[decode.rows] = paged_decode_attention(q[decode.rows], *args)
    return out
