"""Triton KV write: one program per new token scatters its [kv_heads * dim] values into its slot; for INT8
entries, one program per (token, KV head) entry computes its scale and codes. ``rotate_write_kv_triton``:
one program per (token, head) of a fused q/k/v projection's output rotates its q or k head (and
Hadamard-rotates it for an INT8 cache) and stores it: q to the returned queries, k and v to their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # a global a jitted kernel reads must be a constexpr
INT8_MAX = tl.constexpr(127.0)
MIN_AMAX = tl.constexpr(1e-6)  # formats.fp8.MIN_AMAX
# Adding then subtracting 1.5 * 2^23 rounds a float32 of magnitude under 2^22 to the nearest integer, ties
# to even, exactly as torch.round: the same bits on a GPU and in the interpreter, without libdevice.
ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def _write_kv_kernel(
    x_ptr,
    slots_ptr,
    slot_mapping_ptr,
    scale_ptr,
    width,
    stride_x,
    stride_slot,
    PAGE_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    for start in range(0, width, BLOCK):
        i = start + offs
        mask = i < width
        x = tl.load(x_ptr + token * stride_x + i, mask=mask, other=0.0)
        if FP8:
            scale = tl.load(scale_ptr + slot // PAGE_SIZE)
            y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)
            tl.store(
                slots_ptr + slot * stride_slot + i, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask
            )
        else:
            tl.store(slots_ptr + slot * stride_slot + i, x.to(slots_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_int8_kernel(
    x_ptr,
    slots_ptr,
    slot_mapping_ptr,
    stride_xt,
    stride_xh,
    stride_slot,
    stride_head,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < DIM
    x = tl.load(x_ptr + token * stride_xt + head * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
    _store_int8_entry(x, slots_ptr + slot * stride_slot + head * stride_head, d, mask, DIM)


@triton.jit
def _store_int8_entry(x, entry, d, mask, DIM: tl.constexpr):
    """fp32 values ``x`` [BLOCK_D] (0 past DIM) as one INT8 entry at ``entry``: codes, then the bf16 scale."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX)
    # The scale in bf16, rounded to nearest even in integer arithmetic (the interpreter truncates casts).
    bits = tl.math.div_rn(amax, INT8_MAX).to(tl.uint32, bitcast=True)
    bf16 = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    scale = (bf16 << 16).to(tl.float32, bitcast=True)
    y = tl.clamp(tl.math.div_rn(x, scale), -INT8_MAX - 1.0, INT8_MAX + 1.0)
    code = tl.clamp((y + ROUNDER) - ROUNDER, -INT8_MAX, INT8_MAX).to(tl.int32)
    tl.store(entry + d, (code & 0xFF).to(tl.uint8), mask=mask)
    tl.store(entry + DIM, (bf16 & 0xFF).to(tl.uint8))
    tl.store(entry + DIM + 1, (bf16 >> 8).to(tl.uint8))


@triton.jit
def _hadamard(x, BLOCK_D: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """fp32 ``x`` [BLOCK_D] times the block-diagonal Hadamard matrix of 2^LOG2_BLOCK: the butterflies of
    ``formats.kv_int8.hadamard`` in its order (sums and differences of pairs h apart, h = 1, 2, 4 ..)."""
    for i in tl.static_range(LOG2_BLOCK):
        pairs = tl.permute(tl.reshape(x, (BLOCK_D // (2 << i), 2, 1 << i)), (0, 2, 1))
        low, high = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(low + high, low - high), (0, 2, 1)), (BLOCK_D,))
    return x


@triton.jit
def _rotate_write_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    slot_mapping_ptr,
    stride_qkv,
    stride_cos,
    stride_q,
    stride_kslot,
    stride_kh,
    stride_vslot,
    stride_vh,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
    INT8: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads, as the projection lays them out
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    src = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x = tl.load(src + d, mask=mask, other=0.0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if head < HEADS + KV_HEADS:
        half = HEAD_DIM // 2
        first = d < half
        partner = tl.load(src + tl.where(first, d + half, d - half), mask=mask, other=0.0).to(tl.float32)
        turned = tl.where(
            first, -partner, partner
        )  # negated in fp32: exact, and the interpreter's bf16 is bits
        c = tl.load(cos_ptr + token * stride_cos + d, mask=mask, other=0.0)
        s = tl.load(sin_ptr + token * stride_cos + d, mask=mask, other=0.0)
        # Rounded to qkv's dtype after each op, as apply_rotary's torch ops round (no fused multiply-add).
        a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
        b = (turned * s.to(tl.float32)).to(x.dtype)
        y = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        r = tl.where(mask, y.to(tl.float32), 0.0)
        if LOG2_BLOCK > 0:
            r = _hadamard(r, BLOCK_D, LOG2_BLOCK)
        if head < HEADS:
            tl.store(q_ptr + token * stride_q + head * HEAD_DIM + d, r.to(x.dtype), mask=mask)
        else:
            entry = k_ptr + slot * stride_kslot + (head - HEADS) * stride_kh
            if INT8:
                _store_int8_entry(r, entry, d, mask, HEAD_DIM)
            else:
                tl.store(entry + d, y.to(k_ptr.dtype.element_ty), mask=mask)
    else:
        entry = v_ptr + slot * stride_vslot + (head - HEADS - KV_HEADS) * stride_vh
        if INT8:
            _store_int8_entry(x.to(tl.float32), entry, d, mask, HEAD_DIM)
        else:
            tl.store(entry + d, x.to(v_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    x: torch.Tensor,
    slots: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_scale: torch.Tensor | None,
    page_size: int,
) -> None:
    """Same contract as ``kv_write.write_kv_reference``."""
    tokens = slot_mapping.numel()
    if tokens == 0:
        return
    if slots.dtype == torch.int8:  # INT8 entries [.., dim + 2]: codes and their own scale, as bytes
        x = x if x.stride(-1) == 1 else x.contiguous()
        dim = x.shape[-1]
        entries = slots.view(torch.uint8)
        _write_int8_kernel[(tokens, x.shape[1])](
            x,
            entries,
            slot_mapping,
            x.stride(0),
            x.stride(1),
            entries.stride(0),
            entries.stride(1),
            DIM=dim,
            BLOCK_D=triton.next_power_of_2(dim),
            num_warps=1,
        )
        return
    x2 = x.reshape(tokens, -1).contiguous()
    width = x2.shape[1]
    flat = slots.view(slots.shape[0], -1)
    _write_kv_kernel[(tokens,)](
        x2,
        flat,
        slot_mapping,
        flat if page_scale is None else page_scale,
        width,
        x2.stride(0),
        flat.stride(0),
        PAGE_SIZE=page_size,
        FP8=page_scale is not None,
        BLOCK=min(1024, triton.next_power_of_2(width)),
        num_warps=4,
    )


def rotate_write_kv_triton(
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
    """Same contract as ``kv_write.rotate_write_kv_reference``."""
    tokens, dim = qkv.shape[0], cos.shape[1]
    q = torch.empty((tokens, heads, dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    int8 = k_slots.dtype == torch.int8
    k, v = (k_slots.view(torch.uint8), v_slots.view(torch.uint8)) if int8 else (k_slots, v_slots)
    _rotate_write_kernel[(tokens, heads + 2 * kv_heads)](
        qkv,
        cos,
        sin,
        q,
        k,
        v,
        slot_mapping,
        qkv.stride(0),
        cos.stride(0),
        q.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=dim,
        LOG2_BLOCK=key_block.bit_length() - 1,
        INT8=int8,
        BLOCK_D=triton.next_power_of_2(dim),
        num_warps=1,
    )
    return q
