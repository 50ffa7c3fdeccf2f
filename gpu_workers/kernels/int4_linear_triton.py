"""Triton W4A16 GEMM/GEMV: unpack int4 nibbles and dequantise in registers, accumulate in fp32.

One program computes a [BLOCK_M, BLOCK_N] tile of x @ W.T. BLOCK_K divides the group size, so each K step
reads one scale (and zero) per output column. Decode batches (M ≤ 16) use 16-row tiles: the smallest
``tl.dot`` shape; the weight bytes, not the arithmetic, bound them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_workers.kernels import interpreted


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    num_groups,
    stride_xm,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    half_k = K // 2
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        # Byte k // 2 holds columns k and k + 1; the odd one is in the high nibble.
        packed = tl.load(
            packed_ptr + rn[None, :] * half_k + (k // 2)[:, None],
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        ).to(tl.int32)
        codes = (packed >> ((k % 2) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
        group = k0 // GROUP_SIZE
        scale = tl.load(scale_ptr + rn * num_groups + group, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(zero_ptr + rn * num_groups + group, mask=n_mask, other=0.0).to(tl.float32)
        else:
            zero = tl.full((BLOCK_N,), 8.0, dtype=tl.float32)
        w = (codes.to(tl.float32) - zero[None, :]) * scale[None, :]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def int4_linear_triton(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``quant_linear.int4_linear_reference``."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    block_m, block_n = (16, 32) if m <= 16 else (32, 64) if m <= 32 else (64, 64)
    block_k = min(128, group_size & -group_size)  # largest power of two dividing the group size
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x2,
        weight_packed,
        weight_scale,
        weight_scale if weight_zero is None else weight_zero,
        out if bias is None else bias,
        out,
        m,
        n,
        k,
        weight_scale.shape[1],
        x2.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        HAS_ZERO=weight_zero is not None,
        HAS_BIAS=bias is not None,
        DOT_FP32=x.dtype == torch.float32 or interpreted(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out.view(*x.shape[:-1], n)
