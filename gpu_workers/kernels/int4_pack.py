"""The fast W4A16 kernel's weight layout (``Int4GpuPack``), made once per layer by ``prepack_int4_gpu``: torch
only, so the layer (``quant.linear``) and the dispatch (``quant_linear``) use it without importing Triton, and
the kernel (``int4_linear_triton``) reads it without importing the dispatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Int4GpuPack:
    """One int4 weight in the layout of the fast W4A16 kernel (``int4_linear_fast_triton``), made once.

    ``words`` [ceil(in / block_k), out, block_k / 8] int32: the codes of one K step (``block_k`` inputs) of
    one output row are the contiguous ``words[step, row]``, so a program's [BLOCK_N, block_k] tile is one
    contiguous block of memory. Word j of a step holds inputs 8j .. 8j + 7 of it, input 8j + p in bits
    4p .. 4p + 3: the stored bytes read as little-endian words, the order in which the kernel's
    shift-mask-or, two nibbles per 32-bit operation, and its joins put each code under its input. Inputs
    past ``in_features`` hold code 0 (they meet zero activations).
    ``scale`` and ``offset`` (zero points, or GGUF's minimums where ``has_min``; None: symmetric, zero 8)
    are [groups, out] in their stored dtype: one step's per-column values are one contiguous load.
    """

    words: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    has_min: bool
    group_size: int
    block_k: int
    in_features: int

    @property
    def nbytes(self) -> int:
        offset = 0 if self.offset is None else self.offset.nbytes
        return self.words.nbytes + self.scale.nbytes + offset

    def weight_packed(self) -> torch.Tensor:
        """The [out, in / 2] bytes it was packed from (``formats.weights``' order)."""
        steps, rows, _ = self.words.shape
        stored = self.words.view(torch.uint8).transpose(0, 1).reshape(rows, steps * self.block_k // 2)
        return stored[:, : self.in_features // 2].contiguous()


def int4_gpu_block_k(group_size: int) -> int:
    """The fast kernel's K step for ``group_size``: the largest of 128/64/32/16 inside one group, so that
    each step's scale and zero apply to its whole dot product."""
    block_k = next((b for b in (128, 64, 32, 16) if group_size % b == 0), None)
    if block_k is None:
        raise ValueError(f"the fast W4A16 kernel needs groups of a multiple of 16 inputs, got {group_size}")
    return block_k


def prepack_int4_gpu(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor | None,
    group_size: int,
    weight_min: torch.Tensor | None = None,
) -> Int4GpuPack:
    """Our int4 encoding (``formats.weights``) as the fast W4A16 kernel reads it (``Int4GpuPack``), on the
    weight's device."""
    block_k = int4_gpu_block_k(group_size)
    rows, half = weight_packed.shape
    steps = -(-2 * half // block_k)
    stored = F.pad(weight_packed, (0, steps * block_k // 2 - half))
    words = stored.view(rows, steps, block_k // 2).transpose(0, 1).contiguous().view(torch.int32)
    offset = weight_min if weight_min is not None else weight_zero
    return Int4GpuPack(
        words=words,
        scale=weight_scale.t().contiguous(),
        offset=None if offset is None else offset.t().contiguous(),
        has_min=weight_min is not None,
        group_size=group_size,
        block_k=block_k,
        in_features=2 * half,
    )
