"""Triton paged decode attention over BF16, FP8 or INT8 KV pages (flash-decoding with split KV).

Program (sequence b, KV head h, split s) computes the query heads that share KV head h together (GQA: the
KV tile is read once for all of them, padded to 16 rows for ``tl.dot``), over split s of the sequence's
positions, with an online softmax in base 2. A tile is a run of positions inside one page (pages smaller
than ``tl.dot``'s 16 columns excepted), so its block-table entry and FP8 scales are one load each: the
page's K scale times the softmax scale times log2(e) is the one multiply a score gets, and its V scale
multiplies the probabilities before P·V; FP8 bytes become the compute dtype in registers. INT8 entries
carry their own scales (the bf16 after their codes), per position. Splits give a batch of few long
sequences enough programs to fill the GPU; a second small kernel merges the splits' partial results by
their log-sum-exp (base 2, as the splits keep it).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from gpu_workers.kernels import interpreted

TILE = 32  # most positions per tile
MIN_TILE = 16  # tl.dot's least width: a tile over smaller pages spans several


@triton.jit
def _entry_scales(entries, HEAD_DIM: tl.constexpr, mask):
    """The fp32 scales of the INT8 entries at ``entries`` [BLOCK_N] pointers: the bf16 after their codes."""
    low = tl.load(entries + HEAD_DIM, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint32)
    high = tl.load(entries + HEAD_DIM + 1, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint32)
    return ((high << 8 | low) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    qk_scale,
    window,
    chunk,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kslot,
    stride_kh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    GQA: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    INT8: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``qk_scale`` is the softmax scale times log2(e): scores, maxima and sums are in base 2."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    # Tiles start at multiples of BLOCK_N (chunk is a multiple of it), so where BLOCK_N divides the page size
    # no tile crosses a page; a window's first tile starts before the window, those positions masked.
    lo = start // BLOCK_N * BLOCK_N + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_N)
    heads = kv_head * GQA + g
    g_mask = g < GQA
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    table = block_tables_ptr + b * stride_bt
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + rows
        n_mask = n < hi
        if HAS_WINDOW:
            n_mask &= n >= start
        # ``page`` is a scalar where the tile lies in one page, else each position's page [BLOCK_N]; the
        # scales below load and broadcast as either.
        if BLOCK_N <= PAGE_SIZE:
            page = tl.load(table + n0 // PAGE_SIZE).to(tl.int64)
            slot = page * PAGE_SIZE + n0 % PAGE_SIZE + rows
        else:
            page = tl.load(table + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + n % PAGE_SIZE
        entry = slot * stride_kslot + kv_head * stride_kh
        kv_offs = entry[:, None] + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        if FP8:
            k = k.to(tl.float8e4nv, bitcast=True)
            v = v.to(tl.float8e4nv, bitcast=True)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") if DOT_FP32 else tl.dot(q, tl.trans(k))
        if FP8:
            s = s * (tl.load(k_scale_ptr + page) * qk_scale)
        elif INT8:
            s = s * (_entry_scales(k_ptr + entry, HEAD_DIM, n_mask) * qk_scale)
        else:
            s = s * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8:
            p = p * tl.load(v_scale_ptr + page)
        if INT8:
            p = p * _entry_scales(v_ptr + entry, HEAD_DIM, n_mask)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    part = (b * NUM_HEADS + heads) * num_splits + split  # [BLOCK_G]
    tl.store(max_ptr + part, m_i, mask=g_mask)
    tl.store(sum_ptr + part, l_i, mask=g_mask)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(
    acc_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    part = (b * NUM_HEADS + head) * num_splits + s
    m = tl.load(max_ptr + part, mask=s_mask, other=float("-inf"))
    m_all = tl.max(m, axis=0)
    # A split past the sequence's end never ran its loop: max -inf, sum 0, weight 0.
    w = tl.where(m > float("-inf"), tl.exp2(m - m_all), 0.0)
    total = tl.sum(tl.load(sum_ptr + part, mask=s_mask, other=0.0) * w, axis=0)
    acc = tl.load(
        acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
    )


def paged_decode_attention_triton(
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
    """Same contract as ``paged_attention.paged_decode_attention_reference``."""
    batch, heads, head_dim = q.shape
    kv_heads = k_slots.shape[1]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_n = _tile(page_size)
    # The most positions a program's tiles cover, without reading the lengths back from the device: a
    # window's first tile starts up to block_n - 1 positions before it.
    span = block_tables.shape[1] * page_size
    if sliding_window is not None:
        span = min(span, sliding_window + block_n - 1)
    num_splits = _num_splits(batch * kv_heads, span, block_n, q.device)
    chunk = triton.cdiv(triton.cdiv(span, num_splits), block_n) * block_n
    partial = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    maxes = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    q = q.contiguous()
    fp8 = k_scale is not None
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q,
        k_slots,
        v_slots,
        block_tables,
        seq_lens,
        k_scale if fp8 else maxes,
        v_scale if fp8 else maxes,
        partial,
        maxes,
        sums,
        scale * math.log2(math.e),
        sliding_window or 0,
        chunk,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_slots.stride(0),
        k_slots.stride(1),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        NUM_HEADS=heads,
        GQA=heads // kv_heads,
        PAGE_SIZE=page_size,
        FP8=fp8,
        INT8=k_slots.dtype == torch.int8,
        HAS_WINDOW=sliding_window is not None,
        DOT_FP32=q.dtype == torch.float32 or interpreted(),
        BLOCK_G=max(16, triton.next_power_of_2(heads // kv_heads)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        num_warps=4,
    )
    _merge_splits_kernel[(batch, heads)](
        partial,
        maxes,
        sums,
        out,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        NUM_HEADS=heads,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
        num_warps=1,
    )
    return out


def _tile(page_size: int) -> int:
    """Positions per tile: the largest power of two dividing the page size, at most ``TILE``, so tiles
    never cross a page; ``MIN_TILE`` (spanning pages) where that is narrower than ``tl.dot`` takes."""
    return max(MIN_TILE, min(page_size & -page_size, TILE))


def _num_splits(programs: int, span: int, block_n: int, device: torch.device) -> int:
    """Enough splits for about two programs per SM, none shorter than one tile."""
    sms = _multiprocessors(device.index) if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(span, block_n), 64))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    """The GPU's SM count, asked of the driver once (every layer of every step plans its splits)."""
    return torch.cuda.get_device_properties(index).multi_processor_count
