"""Quantised-weight linears, each a torch reference beside the dispatch to its Triton kernel.

- FP8 (W8A16): activations in bf16/fp16/fp32 times e4m3 weights with per-output-channel scales. The kernel
  (``fp8_linear_triton``) reads the 1-byte weights, upcasts them in registers (exact: every e4m3 value is
  a bf16 value) and applies the channel scale once to the accumulator.
- INT4 (W4A16): group-quantised weights (``formats.weights``). The reference dequantises the whole weight
  and calls ``F.linear``; the kernel (``int4_linear_triton``) unpacks and dequantises tiles in registers,
  so only the packed bytes cross memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_workers.formats.weights import dequantize_fp8_weight, dequantize_int4
from gpu_workers.kernels import use_triton


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] @ (weight * scale).T + bias, the weight dequantised to x's dtype."""
    return F.linear(x, dequantize_fp8_weight(weight, weight_scale, x.dtype), bias)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if use_triton(x.device):
        from gpu_workers.kernels.fp8_linear_triton import fp8_linear_triton

        return fp8_linear_triton(x, weight, weight_scale, bias)
    return fp8_linear_reference(x, weight, weight_scale, bias)


def int4_linear_reference(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] @ W.T + bias, W = dequantised int4 [out, in] in x's dtype."""
    weight = dequantize_int4(weight_packed, weight_scale, weight_zero, group_size, x.dtype)
    return F.linear(x, weight, bias)


def int4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    if use_triton(x.device):
        from gpu_workers.kernels.int4_linear_triton import int4_linear_triton

        return int4_linear_triton(x, weight_packed, weight_scale, weight_zero, group_size, bias)
    return int4_linear_reference(x, weight_packed, weight_scale, weight_zero, group_size, bias)
