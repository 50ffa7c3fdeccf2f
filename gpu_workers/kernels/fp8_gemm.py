"""FP8-weight linear (W8A16): activations in bf16/fp16/fp32 times e4m3 weights with per-output-channel scales.

The kernel (``fp8_gemm_triton``) reads the 1-byte weights, upcasts them in registers (exact: every e4m3
value is a bf16 value) and applies the channel scale once to the accumulator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_workers.kernels import use_triton
from gpu_workers.quant.formats import dequantize_fp8_weight


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] @ (weight * scale).T + bias, the weight dequantised to x's dtype."""
    return F.linear(x, dequantize_fp8_weight(weight, weight_scale, x.dtype), bias)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if use_triton(x.device):
        from gpu_workers.kernels.fp8_gemm_triton import fp8_linear_triton

        return fp8_linear_triton(x, weight, weight_scale, bias)
    return fp8_linear_reference(x, weight, weight_scale, bias)
