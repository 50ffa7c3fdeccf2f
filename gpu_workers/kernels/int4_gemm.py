"""W4A16 linear: activations in bf16/fp16/fp32 times INT4 group-quantised weights (``quant.formats``).

The reference dequantises the whole weight and calls ``F.linear``; the kernel (``int4_gemm_triton``)
unpacks and dequantises tiles in registers, so only the packed bytes cross memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_workers.kernels import use_triton
from gpu_workers.quant.formats import dequantize_int4


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
        from gpu_workers.kernels.int4_gemm_triton import int4_linear_triton

        return int4_linear_triton(x, weight_packed, weight_scale, weight_zero, group_size, bias)
    return int4_linear_reference(x, weight_packed, weight_scale, weight_zero, group_size, bias)
