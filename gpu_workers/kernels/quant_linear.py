"""Quantised-weight linears, each a torch reference beside the dispatch to its Triton kernel.

- FP8 (W8A16): activations in bf16/fp16/fp32 times e4m3 weights with per-output-channel scales. The kernel
  (``fp8_linear_triton``) reads the 1-byte weights, upcasts them in registers (exact: every e4m3 value is
  a bf16 value) and applies the channel scale once to the accumulator.
- INT4 (W4A16): group-quantised weights (``formats.weights``). The reference dequantises the whole weight
  and calls ``F.linear``; the kernels (``int4_linear_triton``) unpack and dequantise tiles in registers,
  so only the packed bytes cross memory. Two GPU kernels: "fast" reads the weight repacked once into its
  tiled layout (``Int4GpuPack``) and places nibbles into float bit patterns, scaling the accumulator per
  group; "convert" reads the stored bytes and converts each nibble to fp32. ``TESSERA_INT4_KERNEL`` picks
  the one ``Int4Linear`` runs. On CPU, torch's packed int4 kernel (``Int4CpuPack``): the codes are
  repacked once into its tiled layout, our zero points folded into its per-group offsets.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_workers.formats.weights import SYMMETRIC_ZERO, dequantize_fp8_weight, dequantize_int4, unpack_int4
from gpu_workers.kernels import kernel_mode, use_triton
from gpu_workers.kernels.int4_pack import Int4GpuPack

# The W4A16 kernel ``Int4Linear`` runs on a GPU, "convert" unless ``TESSERA_INT4_KERNEL=fast``. Both equal
# the reference under Triton's interpreter on every format (tests/test_int4_fast_dequant.py), but "fast"
# keeps its repacked copy of the codes beside the stored ones, so an int4 layer holds its weights twice in
# accelerator memory: it becomes the default only once a GPU shows it faster (scripts/gpu-session.sh's
# kernels stage: ``tessera bench kernels`` rows int4 and int4-fast) and the stored copy is let go.
INT4_KERNEL_ENV = "TESSERA_INT4_KERNEL"
INT4_KERNELS = ("convert", "fast")

# What torch's CPU int4 kernel takes: these group sizes, output channels in multiples of 16, activations
# in these dtypes. Any other layer runs the reference.
INT4_CPU_GROUP_SIZES = (32, 64, 128, 256)
INT4_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Measured on this project's 2-core CPU (torch 2.13): the kernel is fast with bf16 activations only (fp32
# ones run 30-70x slower than bf16), and a call costs ~0.1 ms whatever its size. So fp32 compute sends a
# layer of at least this many weights through it with bf16 activations (4096x4096, one row: 5 ms against
# 17 ms for the fp32 matmul), and dequantises a smaller layer once, where 4 bytes a weight are little and
# the fp32 matmul is 4x faster than the kernel's fixed cost.
INT4_CPU_KERNEL_MIN_WEIGHTS = 1 << 20


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
    weight_min: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] @ W.T + bias, W = dequantised int4 [out, in] in x's dtype (``formats.weights``: with
    ``weight_min``, W = q * scale + min)."""
    weight = dequantize_int4(weight_packed, weight_scale, weight_zero, group_size, x.dtype, weight_min)
    return F.linear(x, weight, bias)


def int4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    weight_min: torch.Tensor | None = None,
    pack: Int4GpuPack | None = None,
) -> torch.Tensor:
    """``int4_linear_reference``'s result; on the Triton kernels, the fast one where ``pack`` (this weight
    from ``prepack_int4_gpu``) is given, else the convert one."""
    if use_triton(x.device):
        from gpu_workers.kernels.int4_linear_triton import int4_linear_fast_triton, int4_linear_triton

        args = (x, weight_packed, weight_scale, weight_zero, group_size, bias)
        if pack is not None:
            return int4_linear_fast_triton(*args, weight_min=weight_min, pack=pack)
        return int4_linear_triton(*args, weight_min=weight_min)
    return int4_linear_reference(x, weight_packed, weight_scale, weight_zero, group_size, bias, weight_min)


def int4_gpu_kernel() -> str:
    """The W4A16 Triton kernel ``Int4Linear`` runs: ``TESSERA_INT4_KERNEL`` (convert or fast), default convert."""
    kernel = os.environ.get(INT4_KERNEL_ENV, INT4_KERNELS[0])
    if kernel not in INT4_KERNELS:
        raise ValueError(
            f"{INT4_KERNEL_ENV}={kernel!r} is not a W4A16 kernel; use one of {', '.join(INT4_KERNELS)}"
        )
    return kernel


def use_int4_gpu_pack(x: torch.Tensor) -> bool:
    """Whether an int4 linear over ``x`` runs the fast Triton kernel, on a weight packed once for it."""
    return use_triton(x.device) and int4_gpu_kernel() == "fast"


@dataclass(frozen=True)
class Int4CpuPack:
    """One int4 weight in the layout of ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

    Torch dequantises ``(q - 8) * scale + offset`` per group; ours is ``(q - zero) * scale``, so
    ``offset = (8 - zero) * scale``. In fp32 both products are exact (an 8-bit bf16 scale times a small
    integer), so the kernel sees exactly our weights. GGUF's ``q * scale + min`` has
    ``offset = min + 8 * scale``, rounded once to the activations' dtype with the float16 scale (bf16
    activations keep 8 of its 11 significant bits: the kernel's arithmetic, not the stored weights).
    A ragged last group is padded with code 0 columns that meet zero-padded activations.
    """

    weight: torch.Tensor  # torch's tiled uint8 packing of [out, padded_in] codes
    scales_and_offsets: torch.Tensor  # [groups, out, 2] in the activations' dtype
    group_size: int
    in_features: int  # padded_in - in_features zero columns are appended to x

    @functools.cached_property
    def padding(self) -> int:
        """Zero columns appended to x: a ragged last group's."""
        return self.scales_and_offsets.shape[0] * self.group_size - self.in_features

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales_and_offsets.nbytes


def use_cpu_weights(x: torch.Tensor) -> bool:
    """Whether a quantised linear over ``x`` runs on weights prepared once (torch's packed int4 kernel, fp8
    dequantised once): on CPU, unless ``TESSERA_KERNELS`` forces the references."""
    return x.device.type == "cpu" and kernel_mode() == "auto"


def int4_cpu_supported(out_features: int, group_size: int, dtype: torch.dtype) -> bool:
    return group_size in INT4_CPU_GROUP_SIZES and out_features % 16 == 0 and dtype in INT4_CPU_DTYPES


def prepack_int4_cpu(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype,
    weight_min: torch.Tensor | None = None,
) -> Int4CpuPack:
    """Our int4 encoding (``formats.weights``) as torch's CPU int4 kernel reads it, for activations in
    ``dtype``; check ``int4_cpu_supported`` first."""
    codes = unpack_int4(weight_packed).to(torch.int32)
    rows, cols = codes.shape
    padded = weight_scale.shape[1] * group_size
    codes = F.pad(codes, (0, padded - cols))
    scale = weight_scale.float()
    if weight_min is not None:
        offsets = weight_min.float() + SYMMETRIC_ZERO * scale
    else:
        zero = SYMMETRIC_ZERO if weight_zero is None else weight_zero.float()
        offsets = (SYMMETRIC_ZERO - zero) * scale
    return Int4CpuPack(
        weight=torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1),
        scales_and_offsets=torch.stack((scale, offsets), dim=2).transpose(0, 1).to(dtype).contiguous(),
        group_size=group_size,
        in_features=cols,
    )


_INT4_CPU_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default  # the overload: no resolution per call


def int4_linear_cpu(x: torch.Tensor, pack: Int4CpuPack, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W.T + bias through torch's packed int4 CPU kernel, in the pack's activation dtype (x is
    cast to it and the result back to x's dtype). Called for every linear of every decode step: each
    step below is skipped where it would do nothing."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    activations = pack.scales_and_offsets.dtype
    if rows.dtype != activations:
        rows = rows.to(activations)
    if pack.padding:
        rows = F.pad(rows, (0, pack.padding))
    out = _INT4_CPU_MM(rows.contiguous(), pack.weight, pack.group_size, pack.scales_and_offsets)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], out.shape[-1])
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if bias is None else out + bias
