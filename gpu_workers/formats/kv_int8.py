"""INT8 KV entries: each (token, KV head) entry is its values as int8 codes followed by its own scale.

An entry of ``dim`` values is stored as ``dim + 2`` int8 bytes: ``round(x / scale)`` clamped to ±127, then
the two bytes of ``scale`` in bfloat16 (little-endian), ``scale = bf16(max(amax, MIN_AMAX) / 127)`` of the
entry's own values. The scale travels with the entry, so a page copy, a prefix-cache hit or a hand-off
carries it bit for bit, and no page or sequence state decides it.

Why integers and not e4m3: e4m3 keeps 3 mantissa bits whatever its scale (~2.5% RMS relative error on every
value), and an attention score ``q . k`` is dominated by K's largest values, where that error is largest.
A uniform 8-bit grid sized to each entry's own amax errs by at most amax / 254 on every value: on
SmolLM2-135M, K's share of the KL to unquantised KV drops ~8x (BENCHMARKS.md, "FP8 KV quality on a real
model").

Keys are stored rotated (``hadamard``): K times a block-diagonal Hadamard matrix, the queries read them
through the same rotation, and ``q H . k H = block * (q . k)`` (the attention scale divided by ``block``
gives it back). A few channels carry most of a key's size (RoPE's slow pairs); rotated, every channel
carries a share, so the entry's amax, and with it every code's step, shrinks: ~4x less KL again on
SmolLM2. V is not rotated (the output would need rotating back).
"""

from __future__ import annotations

import torch

from gpu_workers.formats.fp8 import MIN_AMAX

INT8_DTYPE = torch.int8
INT8_MAX = 127
SCALE_BYTES = 2  # the bf16 scale at the end of every entry


def is_int8(dtype: torch.dtype) -> bool:
    return dtype == INT8_DTYPE


def entry_scale(amax: torch.Tensor) -> torch.Tensor:
    """The bf16 scale of entries whose largest magnitude is ``amax`` (rounded to nearest even from fp32)."""
    return (amax.float().clamp_min(MIN_AMAX) / INT8_MAX).to(torch.bfloat16)


def quantize_int8_entries(x: torch.Tensor) -> torch.Tensor:
    """int8 entries [..., dim + 2] of values ``x`` [..., dim]: codes, then the entry's bf16 scale bytes."""
    x = x.float()
    scale = entry_scale(x.abs().amax(dim=-1, keepdim=True))
    codes = (x / scale.float()).round_().clamp_(-INT8_MAX, INT8_MAX).to(INT8_DTYPE)
    return torch.cat((codes, scale.view(torch.int16).contiguous().view(INT8_DTYPE)), dim=-1)


def int8_entry_scales(entries: torch.Tensor) -> torch.Tensor:
    """The float32 scales [..., 1] of int8 entries [..., dim + 2]."""
    return entries[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).float()


def rotation_block(head_dim: int) -> int:
    """The Hadamard block size for entries of ``head_dim`` values: its largest power-of-two divisor."""
    return head_dim & -head_dim


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., dim] times the block-diagonal Hadamard matrix of ``block``-sized ±1 blocks, in float32.

    The fast transform's butterflies (sums and differences of pairs h apart, h = 1, 2, 4 .. block / 2) in a
    fixed order: the CPU kernel's copy (``kernels.kv_write_cpu._hadamard``) gives the same bits. Unscaled:
    applying it twice multiplies by ``block``.
    """
    x = x.float()
    h = 1
    while h < block:
        pairs = x.reshape(*x.shape[:-1], -1, 2, h)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((low + high, low - high), dim=-2).reshape(x.shape)
        h *= 2
    return x


def dequantize_int8_entries(entries: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values [..., dim] in ``dtype`` of int8 entries [..., dim + 2] (code times scale, exact in float32)."""
    codes = entries[..., :-SCALE_BYTES]
    return (codes.float() * int8_entry_scales(entries)).to(dtype)
