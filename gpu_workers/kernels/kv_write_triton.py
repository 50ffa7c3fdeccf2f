"""Triton KV write: one program per new token scatters its [kv_heads * dim] values into its slot; for INT8
entries, one program per (token, KV head) entry computes its scale and codes."""

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
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX)
    # The scale in bf16, rounded to nearest even in integer arithmetic (the interpreter truncates casts).
    bits = tl.math.div_rn(amax, INT8_MAX).to(tl.uint32, bitcast=True)
    bf16 = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    scale = (bf16 << 16).to(tl.float32, bitcast=True)
    y = tl.clamp(tl.math.div_rn(x, scale), -INT8_MAX - 1.0, INT8_MAX + 1.0)
    code = tl.clamp((y + ROUNDER) - ROUNDER, -INT8_MAX, INT8_MAX).to(tl.int32)
    entry = slots_ptr + slot * stride_slot + head * stride_head
    tl.store(entry + d, (code & 0xFF).to(tl.uint8), mask=mask)
    tl.store(entry + DIM, (bf16 & 0xFF).to(tl.uint8))
    tl.store(entry + DIM + 1, (bf16 >> 8).to(tl.uint8))


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
