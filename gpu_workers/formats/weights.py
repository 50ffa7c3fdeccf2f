"""Quantised weight tensors: FP8-e4m3 with one scale per output channel, INT4 in groups along the input.

Layouts (also the checkpoint's, see ``tools.quantize``):
- fp8: ``weight`` [out, in] float8_e4m3fn = W / scale, saturated at ±448; ``weight_scale`` [out] fp32.
  In memory the bits live in uint8 tensors, like the FP8 KV cache, so ``Module.to(dtype)`` and CPU torch's
  missing fp8 ops never touch them.
- int4: codes q in 0..15, two per byte along the input dimension (column 2j in the low nibble of byte j,
  2j+1 in the high one): ``weight_packed`` [out, in/2] uint8. Groups of ``group_size`` input columns share a
  bf16 ``weight_scale`` and, asymmetric, a bf16 ``weight_zero`` [out, ceil(in/group_size)]:
  W ≈ (q - zero) * scale. Symmetric stores no zeros: the zero is 8. Zeros are integers (exact in bf16)
  but not clamped to 0..15, so a group of all-positive weights keeps its full range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_workers.formats.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8

SCALE_DTYPE = torch.bfloat16  # int4 scales and zeros
GGUF_SCALE_DTYPE = torch.float16  # the scales (and minimums) of GGUF's Q4_0 / Q4_1 blocks
SYMMETRIC_ZERO = 8.0
_MIN_RANGE = 1e-8  # a constant group still needs a usable scale


@dataclass
class Fp8Weight:
    weight: torch.Tensor  # [out, in] uint8 bits of float8_e4m3fn
    weight_scale: torch.Tensor  # [out] fp32


@dataclass
class Int4Weight:
    weight_packed: torch.Tensor  # [out, in/2] uint8
    weight_scale: torch.Tensor  # [out, groups] bf16
    weight_zero: torch.Tensor | None  # [out, groups] bf16; None when symmetric or with minimums
    group_size: int
    weight_min: torch.Tensor | None = None  # [out, groups]: W = q * scale + min (GGUF's Q4_1)


def quantize_fp8_weight(w: torch.Tensor) -> Fp8Weight:
    """Per-output-channel FP8: each row's amax maps onto 448."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(_MIN_RANGE) / FP8_MAX
    return Fp8Weight(quantize_fp8(w, scale[:, None]), scale)


def dequantize_fp8_weight(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8(bits, scale.float()[:, None], dtype)


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = False) -> Int4Weight:
    """Round-to-nearest INT4 of ``w`` [out, in] in groups of ``group_size`` input columns.

    Scales are rounded to bf16 before the codes are computed, so the stored (scale, zero, code) triple is
    exactly what dequantisation reads. A ragged last group is fine; ``in`` must be even (two per byte).
    """
    rows, cols = w.shape
    if cols % 2:
        raise ValueError(f"int4 packs two columns per byte; in_features {cols} is odd")
    groups = -(-cols // group_size)
    padded = groups * group_size
    w = w.float()
    # Pad the last group with copies of its last column: its min and max stay the real ones.
    wg = torch.cat((w, w[:, -1:].expand(rows, padded - cols)), dim=1).view(rows, groups, group_size)
    if symmetric:
        scale = (wg.abs().amax(dim=2).clamp_min(_MIN_RANGE) / 7).to(SCALE_DTYPE)
        zero = torch.full_like(scale, SYMMETRIC_ZERO, dtype=torch.float32)
    else:
        wmin, wmax = wg.amin(dim=2), wg.amax(dim=2)
        scale = ((wmax - wmin).clamp_min(_MIN_RANGE) / 15).to(SCALE_DTYPE)
        zero = torch.round(-wmin / scale.float())
    codes = torch.round(wg / scale.float()[..., None]) + zero[..., None]
    codes = codes.clamp_(0, 15).to(torch.uint8).view(rows, padded)[:, :cols]
    return Int4Weight(
        pack_int4(codes), scale, None if symmetric else zero.to(SCALE_DTYPE), group_size=group_size
    )


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes 0..15 → [out, in/2] bytes, even columns in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[out, in/2] bytes → [out, in] codes 0..15 (uint8)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=2).view(packed.shape[0], -1)


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype,
    minimum: torch.Tensor | None = None,
) -> torch.Tensor:
    """W ≈ (q - zero) * scale, or q * scale + minimum, as [out, in] in ``dtype``, computed in fp32."""
    codes = unpack_int4(packed)
    rows, cols = codes.shape
    groups = scale.shape[1]
    # A ragged last group is padded to a whole one, then cut off again.
    codes = F.pad(codes, (0, groups * group_size - cols)).view(rows, groups, group_size).float()
    if minimum is not None:
        weight = codes * scale.float()[..., None] + minimum.float()[..., None]
    else:
        zero = SYMMETRIC_ZERO if zero is None else zero.float()[..., None]
        weight = (codes - zero) * scale.float()[..., None]
    return weight.view(rows, -1)[:, :cols].to(dtype)


def int4_bytes(rows: int, cols: int, group_size: int, symmetric: bool) -> int:
    """Storage of one int4 weight: packed codes plus bf16 scales (and zeros)."""
    groups = -(-cols // group_size)
    return rows * cols // 2 + rows * groups * 2 * (1 if symmetric else 2)


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||reference - approx|| / ||reference|| (Frobenius), in fp32."""
    ref = reference.float()
    return (
        torch.linalg.vector_norm(ref - approx.float()) / torch.linalg.vector_norm(ref).clamp_min(1e-30)
    ).item()
