"""Rotary position embedding (RoPE), with the linear and Llama 3 frequency rescalings."""

from __future__ import annotations

import math

import torch
from torch import nn

from gpu_workers.checkpoint import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, rescaled as ``rope.type`` says; float32 on the CPU."""
    # Explicit device: models are built under torch.device("meta"), and these values are not weights.
    inv_freq = 1.0 / rope.theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    )
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are stretched by ``factor``, short ones kept, and the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Maps positions [T] to the (cos, sin) tables [T, head_dim] that ``kernels.rotary.apply_rotary`` uses."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        # A plain attribute, not a buffer: it is derived from config, never loaded or saved.
        self.inv_freq = inverse_frequencies(rope, head_dim)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)
