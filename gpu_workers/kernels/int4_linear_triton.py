"""Triton W4A16 GEMM/GEMV: unpack int4 nibbles and dequantise in registers, accumulate in fp32.

Two kernels with ``quant_linear.int4_linear_reference``'s contract. Both compute a [BLOCK_M, BLOCK_N]
tile of x @ W.T per program over one split of the K dimension. Decode batches (M <= 16) use 16-row tiles,
the smallest ``tl.dot`` shape, and few output tiles (a 4096 x 4096 layer has 32 of 128 columns): the K
dimension is split so that every SM gets programs, and a deterministic sum over the splits (no atomics:
the same input gives the same bits) finishes the output.

``int4_linear_triton`` ("convert") reads the stored bytes: each K step loads a [BLOCK_K / 2, BLOCK_N]
tile of packed bytes once and splits it into the low nibbles (even input columns) and the high ones (odd
columns), converts each to fp32, subtracts the zero and multiplies the scale, then two ``tl.dot`` calls.
Measured on an H200 against the previous one-byte-per-column kernel: BENCHMARKS.md, "W4A16: the kernel
rewritten".

``int4_linear_fast_triton`` ("fast", Marlin-style) reads the weight repacked once (``Int4GpuPack``: one
contiguous block per tile) and does no int-to-float conversion and no per-weight scaling. A code q ORed
into the mantissa of 16.0's bit pattern, at the bit worth 1 (bfloat16 0x4180 | q << 3, float16
0x4C00 | q << 6), reads as exactly 16 + q; one shift, AND and OR on a 32-bit word make two such values
(its two 16-bit halves). The K step never leaves one group, so with x_s = sum_k x_k over the step:

    sum_k x_k (q_k - z) s = s * sum_k x_k (16 + q_k) - (16 + z) s * x_s        (zero points; 8 symmetric)
    sum_k x_k (q_k s + m) = s * sum_k x_k (16 + q_k) + (m - 16 s) * x_s        (GGUF's minimums)

so with bf16/fp16 activations the dot runs on the 16 + q tile and the scale and zero (or minimum) are
applied once per group to the [BLOCK_M, BLOCK_N] accumulator. 16 is the smallest value whose binade holds
16 integers: the multiple of x_s cancelled afterwards passes through the fp32 accumulator, which a larger
one (Marlin's 1024, subtracted per weight there) would cost bits of. Even 16 costs fp32 activations the
precision they are promised (1.6e-5 of the output's scale with mean-shifted activations at K = 4096,
against 1e-5): there the tile is dequantised before the dot, (16 + q - (16 + z)) * s or
(16 + q - 16) * s + m, the reference's weights exactly.
Whether it is faster than "convert" is to be measured on a GPU (scripts/gpu-session.sh's kernels stage:
``tessera bench kernels``, rows int4 and int4-fast).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from gpu_workers.kernels import interpreted
from gpu_workers.kernels.int4_pack import Int4GpuPack, prepack_int4_gpu


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


@triton.jit
def _codes_plus_16(words, s: tl.constexpr, MAGIC: tl.constexpr, SHIFT: tl.constexpr, CODES: tl.constexpr):
    """Nibble ``s`` of both 16-bit halves of each word as 16 + code in ``CODES`` ([R, W] words -> [R, 2W],
    the low half's first): one shift, one AND and one OR per two codes, then reinterpreted."""
    pairs = words << (SHIFT - 4 * s) if 4 * s <= SHIFT else words >> (4 * s - SHIFT)
    pairs = (pairs & (0x000F000F << SHIFT)) | (MAGIC * 0x10001)
    low = pairs.to(tl.int16).to(CODES, bitcast=True)
    high = (pairs >> 16).to(tl.int16).to(CODES, bitcast=True)
    return tl.interleave(low, high)


@triton.jit
def _int4_fast_gemm_kernel(
    x_ptr,
    words_ptr,
    scale_ptr,
    offset_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_om,
    stride_os,
    GROUP_SIZE: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_TILE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP16_CODES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    # A step's [BLOCK_N, BLOCK_K / 8] words are contiguous (Int4GpuPack); the step's block follows.
    words_at = words_ptr + rn[:, None] * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)[None, :]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # x_s as a [BLOCK_M, BLOCK_N] tile in the accumulator's layout: a second dot, on the tensor cores. A row
    # sum of x compiled for sm_90 took 112 shuffles and ~120 adds per step and thread at 16 x 128 tiles
    # (448 and ~450 at 64 x 64), against 32 more MMAs (8 more wgmma).
    ones = tl.full((BLOCK_K, BLOCK_N), 1.0, tl.float32 if DOT_FP32 else x_ptr.dtype.element_ty)
    for k0 in range(k_start, k_end, BLOCK_K):
        words = tl.load(words_at + (k0 // BLOCK_K) * N * (BLOCK_K // 8), mask=n_mask[:, None], other=0)
        # Nibble s of a word's low half is input s of its 8, of its high half input 4 + s; the
        # interleaves put input 8j + 4h + s at column 8j + 4h + s of the tile.
        if FP16_CODES:
            c0 = _codes_plus_16(words, 0, 0x4C00, 6, tl.float16)
            c1 = _codes_plus_16(words, 1, 0x4C00, 6, tl.float16)
            c2 = _codes_plus_16(words, 2, 0x4C00, 6, tl.float16)
            c3 = _codes_plus_16(words, 3, 0x4C00, 6, tl.float16)
        else:
            c0 = _codes_plus_16(words, 0, 0x4180, 3, tl.bfloat16)
            c1 = _codes_plus_16(words, 1, 0x4180, 3, tl.bfloat16)
            c2 = _codes_plus_16(words, 2, 0x4180, 3, tl.bfloat16)
            c3 = _codes_plus_16(words, 3, 0x4180, 3, tl.bfloat16)
        codes = tl.interleave(tl.interleave(c0, c2), tl.interleave(c1, c3))  # [BLOCK_N, BLOCK_K]: 16 + q
        cols = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + cols[None, :],
            mask=m_mask[:, None] & (cols < K)[None, :],
            other=0.0,
        )
        group_at = (k0 // GROUP_SIZE) * N + rn
        scale = tl.load(scale_ptr + group_at, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_OFFSET:  # zero points, or the minimums
            offset = tl.load(offset_ptr + group_at, mask=n_mask, other=0.0).to(tl.float32)
        else:
            offset = tl.full((BLOCK_N,), 8.0, tl.float32)
        if SCALE_TILE:
            # fp32 activations: the reference's weights exactly (16 + q - 16 and 16 + q - (16 + z) are exact)
            if HAS_MIN:
                w = (codes.to(tl.float32) - 16.0) * scale[:, None] + offset[:, None]
            else:
                w = (codes.to(tl.float32) - (16.0 + offset[:, None])) * scale[:, None]
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:  # the group's scale and zero (or minimum) applied to the accumulator, as the docstring derives
            shift = offset - 16.0 * scale if HAS_MIN else -(16.0 + offset) * scale
            if DOT_FP32:
                x = x.to(tl.float32)
                dot = tl.dot(x, tl.trans(codes.to(tl.float32)), input_precision="ieee")
                x_sum = tl.dot(x, ones, input_precision="ieee")
            else:
                dot = tl.dot(x, tl.trans(codes))
                x_sum = tl.dot(x, ones)
            acc += dot * scale[None, :] + x_sum * shift[None, :]
    if HAS_BIAS:  # added once, by the first split
        bias = tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    tl.store(
        out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def int4_linear_fast_triton(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    tiles: Int4Tiles | None = None,
    weight_min: torch.Tensor | None = None,
    pack: Int4GpuPack | None = None,
) -> torch.Tensor:
    """Same contract as ``quant_linear.int4_linear_reference``, computed from ``pack`` (these weights'
    ``prepack_int4_gpu``; made here when None, which a caller running the weight more than once avoids).
    ``tiles`` overrides the launch (``int4_tiles``' choice, measured for the convert kernel, with the pack's
    K step); its ``block_k`` must be the pack's."""
    if pack is None:
        pack = prepack_int4_gpu(weight_packed, weight_scale, weight_zero, group_size, weight_min)
    n, k = pack.words.shape[1], pack.in_features
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if m == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    tiles = tiles or replace(int4_tiles(m, n, k, pack.group_size, x.device), block_k=pack.block_k)
    if tiles.block_k != pack.block_k:
        raise ValueError(f"tiles.block_k {tiles.block_k} is not the pack's K step {pack.block_k}")
    k_per_split = triton.cdiv(triton.cdiv(k, tiles.split_k), tiles.block_k) * tiles.block_k
    splits = triton.cdiv(k, k_per_split)
    if splits == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:  # fp32 partial sums, one [m, n] slab per split, summed in a fixed order below
        out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), splits)
    _int4_fast_gemm_kernel[grid](
        x2,
        pack.words,
        pack.scale,
        pack.scale if pack.offset is None else pack.offset,
        out if bias is None else bias,
        out,
        m,
        n,
        k,
        k_per_split,
        x2.stride(0),
        out.stride(-2),
        out.stride(0) if splits > 1 else 0,
        GROUP_SIZE=pack.group_size,
        HAS_OFFSET=pack.offset is not None,
        HAS_MIN=pack.has_min,
        HAS_BIAS=bias is not None,
        SCALE_TILE=x.dtype == torch.float32,
        DOT_FP32=interpreted(),
        FP16_CODES=x.dtype == torch.float16,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if splits > 1:
        out = out.sum(0).to(x.dtype)
    return out.view(*x.shape[:-1], n)
