"""FP8-e4m3 elements: scales, quantise and dequantise; the lowest layer, shared by the KV cache and kernels.

FP8 KV pages hold ``x / scale`` saturated to ±448 (the largest finite e4m3 value, so nothing overflows to
NaN/inf) as float8_e4m3fn bits in uint8 tensors: CPU torch lacks several fp8 ops (ENVIRONMENT.md), and
a uint8 view supports every gather and slot assignment the cache needs. Reading views the bits as fp8
again and multiplies by the scale.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.float32
# A page of exact zeros still needs a usable scale; below this amax, precision no longer matters.
MIN_AMAX = 1e-6


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a cache of ``dtype`` elements is allocated as: FP8 lives in uint8 tensors."""
    return torch.uint8 if is_fp8(dtype) else dtype


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps ``amax`` onto the largest finite e4m3 value."""
    return amax.float().clamp_min(MIN_AMAX) / FP8_MAX


def fp8_scale_pow2(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two at least ``fp8_scale(amax)``.

    Dividing by a power of two only shifts exponents, so a value in e4m3's normal range rounds to the
    same 3-bit mantissa whatever the scale: two scales computed from different chunks of the same
    sequence store the same dequantised values, except at the range ends (saturation, subnormals).
    """
    # From the float's own fields, not exp2(ceil(log2(s))): an fp32 log2 rounds to the integer below for
    # s just above a power of two, which gave a scale under s (and values past 448, clamped).
    scale = fp8_scale(amax)
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """uint8 bits of ``x / scale`` in e4m3; values beyond ±448·scale saturate instead of becoming inf/NaN."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    if bits.device.type != "cpu":
        return (bits.view(FP8_DTYPE).float() * scale).to(dtype)
    # On the CPU torch's fp8 -> fp32 cast is a slow scalar loop (745 µs for 213k values, ~5x the integer
    # ops below): place the e4m3 fields into a 16-bit float's instead, which the CPU widens in hardware,
    # and put back with the scale, in fp32, the power of two they sit below their value.
    bits = bits.view(torch.uint8)
    # bfloat16's fields take one integer op fewer than float16's; they sit 2^120 below their value, which
    # would overflow the factor of a scale of 2^8 or more (those take the float16 route).
    factor = _times(scale, BF16_FIELDS_OFFSET)
    if _finite(factor):
        placed = e4m3_bits_as_bf16(bits)
        if dtype != torch.bfloat16:
            return placed.float().mul_(factor).to(dtype)
        # Into bf16 in place, in fp32 math with one rounding, as `.float() * scale` then `.to` rounds: a
        # Python scale as is; a tensor of scales as bf16 when that holds them exactly (powers of two, as
        # the cache's dynamic scales are), since fp32 tensor math into bf16 is a slow loop on the CPU.
        if isinstance(factor, float):
            return placed.mul_(factor)
        exact = factor.to(torch.bfloat16)
        if torch.equal(exact.float(), factor):
            return placed.mul_(exact)
    return e4m3_bits_as_half(bits).float().mul_(_times(scale, 256.0)).to(dtype)


def _times(scale: torch.Tensor | float, offset: float) -> torch.Tensor | float:
    return scale * offset if isinstance(scale, (int, float)) else scale.float() * offset


BF16_FIELDS_OFFSET = 2.0**120  # e4m3's exponent bias 7 is bfloat16's 127 minus 120


def _finite(factor: torch.Tensor | float) -> bool:
    if isinstance(factor, float):
        return math.isfinite(factor)
    return factor.numel() == 0 or bool(torch.isfinite(factor.amax()))


def e4m3_bits_as_bf16(bits: torch.Tensor) -> torch.Tensor:
    """bfloat16 values exactly 2^-120 times the e4m3 values whose uint8 ``bits`` are given (NaN excepted:
    the quantiser never stores it). Exponent and mantissa move to bits 10..4, the lowest of bfloat16's
    exponent and the top of its mantissa (e4m3 subnormals land on bfloat16 subnormals of the same mantissa);
    the sign, sign-extended from int8, fills bits 15..11, and the mask clears 14..11 to leave it at bit 15."""
    wide = bits.view(torch.int8).to(torch.int16).bitwise_left_shift_(4)
    return wide.bitwise_and_(_BF16_FIELDS_MASK).view(torch.bfloat16)


_BF16_FIELDS_MASK = 0x87FF - 0x10000  # sign bit and bits 10..0, as an int16


def e4m3_bits_as_half(bits: torch.Tensor) -> torch.Tensor:
    """float16 values exactly 2^-8 times the e4m3 values whose uint8 ``bits`` are given (NaN excepted: the
    quantiser never stores it). Exponent and mantissa move to bits 13..7 (e4m3's exponent bias 7 is fp16's
    15 minus 8, and its subnormals land on fp16 subnormals of the same mantissa); the sign, shifted to bit
    14 with them, moves on to bit 15 by adding it to itself (int16 wraps)."""
    wide = bits.to(torch.int16).bitwise_left_shift_(7)
    return wide.add_(torch.bitwise_and(wide, 0x4000)).view(torch.float16)


# An FP8 entry may keep its last ``tail`` values in bf16 (MLA's rope key, as the published FP8 MLA layouts
# do): its uint8 bits are ``dim - tail`` e4m3 values of ``x / scale`` followed by the 2 * tail bytes of
# the tail's bf16 bits, ``dim + tail`` bytes in all. The scale covers the FP8 part only.


def quantize_fp8_entry(x: torch.Tensor, scale: torch.Tensor | float, tail: int) -> torch.Tensor:
    """uint8 bits [..., dim + tail] of entries ``x`` [..., dim]: the head in e4m3, the last ``tail`` in bf16."""
    if not tail:
        return quantize_fp8(x, scale)
    head = x.shape[-1] - tail
    rope = x[..., head:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat((quantize_fp8(x[..., :head], scale), rope), dim=-1)


def dequantize_fp8_entry(
    bits: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype, dim: int
) -> torch.Tensor:
    """Entries [..., dim] from their uint8 bits; a width beyond ``dim`` is a bf16 tail of that many values."""
    tail = bits.shape[-1] - dim
    if not tail:
        return dequantize_fp8(bits, scale, dtype)
    head = dim - tail
    rope = bits[..., head:].contiguous().view(torch.bfloat16).to(dtype)
    return torch.cat((dequantize_fp8(bits[..., :head], scale, dtype), rope), dim=-1)
