"""Triton KV write: one program per new token scatters its [kv_heads * dim] values into its slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # a global a jitted kernel reads must be a constexpr


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
