"""Triton W4A16 GEMM/GEMV: unpack int4 nibbles and dequantise in registers, accumulate in fp32.

One program computes a [BLOCK_M, BLOCK_N] tile of x @ W.T over one split of the K dimension. Each K step
loads a [BLOCK_K / 2, BLOCK_N] tile of packed bytes once and splits it into the low nibbles (even input
columns) and the high ones (odd columns), each multiplied by x's matching columns: two ``tl.dot`` calls
that together read every weight byte once. Decode batches (M <= 16) use 16-row tiles, the smallest
``tl.dot`` shape, and few output tiles (a 4096 x 4096 layer has 32 of 128 columns): the K dimension is
split so that every SM gets programs, and a deterministic sum over the splits (no atomics: the same
input gives the same bits) finishes the output.

Measured on an H200 against the previous one-byte-per-column kernel: BENCHMARKS.md, "W4A16: the kernel
rewritten".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_workers.kernels import interpreted


@dataclass(frozen=True)
class Int4Tiles:
    """A launch of the W4A16 kernel: tile sizes, how many splits of K, and the warps per program."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


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
    k_per_split,
    num_groups,
    stride_xm,
    stride_om,
    stride_os,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, BLOCK_K // 2)  # byte j of a K step holds input columns 2j (low) and 2j + 1 (high)
    m_mask = rm < M
    n_mask = rn < N
    half_k = K // 2
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        even = k0 + 2 * rj
        j_mask = even < k_end
        packed = tl.load(
            packed_ptr + rn[None, :] * half_k + (k0 // 2 + rj)[:, None],
            mask=j_mask[:, None] & n_mask[None, :],
            other=0,
        ).to(tl.int32)  # [BLOCK_K / 2, BLOCK_N]
        x_rows = x_ptr + rm[:, None] * stride_xm + even[None, :]
        x_mask = m_mask[:, None] & j_mask[None, :]
        x_even = tl.load(x_rows, mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + 1, mask=x_mask, other=0.0)
        if GROUP_SIZE % BLOCK_K == 0:  # the whole step lies in one group: one scale (and zero) per column
            group = k0 // GROUP_SIZE
            scale = tl.load(scale_ptr + rn * num_groups + group, mask=n_mask, other=0.0).to(tl.float32)[
                None, :
            ]
            if HAS_ZERO:
                zero = tl.load(zero_ptr + rn * num_groups + group, mask=n_mask, other=0.0).to(tl.float32)[
                    None, :
                ]
            else:
                zero = 8.0
            scale_odd, zero_odd = scale, zero
        else:  # groups narrower than a step, or not aligned to it: per-row scales
            tile_mask = j_mask[:, None] & n_mask[None, :]
            at = rn[None, :] * num_groups + (even // GROUP_SIZE)[:, None]
            at_odd = rn[None, :] * num_groups + ((even + 1) // GROUP_SIZE)[:, None]
            scale = tl.load(scale_ptr + at, mask=tile_mask, other=0.0).to(tl.float32)
            scale_odd = tl.load(scale_ptr + at_odd, mask=tile_mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                zero = tl.load(zero_ptr + at, mask=tile_mask, other=0.0).to(tl.float32)
                zero_odd = tl.load(zero_ptr + at_odd, mask=tile_mask, other=0.0).to(tl.float32)
            else:
                zero, zero_odd = 8.0, 8.0
        # (q - zero) * scale, or q * scale + min (zero_ptr then holds the minimums), in fp32 as the
        # reference dequantises, then x's dtype for the tensor cores.
        if HAS_MIN:
            w_even = (packed & 0xF).to(tl.float32) * scale + zero
            w_odd = (packed >> 4).to(tl.float32) * scale_odd + zero_odd
        else:
            w_even = ((packed & 0xF).to(tl.float32) - zero) * scale
            w_odd = ((packed >> 4).to(tl.float32) - zero_odd) * scale_odd
        if DOT_FP32:
            acc += tl.dot(x_even.to(tl.float32), w_even, input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), w_odd, input_precision="ieee")
        else:
            acc += tl.dot(x_even, w_even.to(x_even.dtype))
            acc += tl.dot(x_odd, w_odd.to(x_odd.dtype))
    if HAS_BIAS:  # added once, by the first split
        bias = tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    tl.store(
        out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def int4_tiles(m: int, n: int, k: int, group_size: int, device: torch.device) -> Int4Tiles:
    """The launch for an [m, k] x [k, n] product, from the H200 sweep (BENCHMARKS.md, "W4A16: the
    kernel rewritten"): 16/32/64-row tiles by batch; 128 columns up to 32 rows, 64 above; K steps of 128
    inputs (64 or 32 where the group size asks for it); K split 8 ways up to 32 rows and 4 above (each
    split at least one step), unless the output tiles alone give every SM two programs. On a 4096 x 4096
    layer that choice was within 2% of the best of 15 tile widths and splits at 1, 8 and 32 rows, and
    within 6% on 4096 x 14336 and 14336 x 4096."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 128 if m <= 32 else 64
    block_k = next((b for b in (128, 64, 32) if group_size % b == 0), 64)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    split_k = 1 if tiles >= 2 * sms else min(8 if m <= 32 else 4, triton.cdiv(k, block_k))
    return Int4Tiles(block_m, block_n, block_k, split_k)


def int4_linear_triton(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    tiles: Int4Tiles | None = None,
    weight_min: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``quant_linear.int4_linear_reference``. ``tiles`` overrides ``int4_tiles``'s
    choice (the benchmark's sweep)."""
    offsets = weight_min if weight_min is not None else weight_zero
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if m == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    tiles = tiles or int4_tiles(m, n, k, group_size, x.device)
    # Whole K steps per split; the split count that covers K with them.
    k_per_split = triton.cdiv(triton.cdiv(k, tiles.split_k), tiles.block_k) * tiles.block_k
    splits = triton.cdiv(k, k_per_split)
    if splits == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:  # fp32 partial sums, one [m, n] slab per split, summed in a fixed order below
        out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), splits)
    _int4_gemm_kernel[grid](
        x2,
        weight_packed,
        weight_scale,
        weight_scale if offsets is None else offsets,
        out if bias is None else bias,
        out,
        m,
        n,
        k,
        k_per_split,
        weight_scale.shape[1],
        x2.stride(0),
        out.stride(-2),
        out.stride(0) if splits > 1 else 0,
        GROUP_SIZE=group_size,
        HAS_ZERO=offsets is not None,
        HAS_MIN=weight_min is not None,
        HAS_BIAS=bias is not None,
        DOT_FP32=x.dtype == torch.float32 or interpreted(),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if splits > 1:
        out = out.sum(0).to(x.dtype)
    return out.view(*x.shape[:-1], n)
