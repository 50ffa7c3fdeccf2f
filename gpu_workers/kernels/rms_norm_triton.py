"""Triton residual add + RMSNorm: one program per token reads its row of x and the residual once, writes the
sum and the normalised row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    width,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    mask = i < width
    x = tl.load(x_ptr + row * stride_x + i, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + i, mask=mask, other=0.0)
        # Rounded to x's dtype as torch's add rounds it: the next layer's residual is that value.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + i, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / width + eps)
    w = tl.load(weight_ptr + i, mask=mask, other=0.0)
    y = (x32 * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + i, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``rms_norm.add_rms_norm_reference``."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    tokens, width = x.shape
    out = torch.empty((tokens, width), dtype=torch.result_type(x, weight), device=x.device)
    summed = x if residual is None else torch.empty_like(x)
    if tokens:
        residual = x if residual is None else residual if residual.stride(-1) == 1 else residual.contiguous()
        _add_rms_norm_kernel[(tokens,)](
            x,
            residual,
            weight,
            out,
            summed,
            width,
            eps,
            x.stride(0),
            residual.stride(0),
            out.stride(0),
            summed.stride(0),
            HAS_RESIDUAL=summed is not x,
            BLOCK=triton.next_power_of_2(width),
            num_warps=4 if width <= 4096 else 8,
        )
    return out, summed
