"""GLM-4.5 MoE (``Glm4MoeForCausalLM``): GQA attention whose RoPE rotates only the first
``partial_rotary_factor`` of each head, optional per-head q/k RMSNorm, q/k/v biases as configured, and
DeepSeek's MoE (``model.moe``: sigmoid router with correction bias, group-limited top-k, shared experts)
after the first dense layers.

The cache entry is the standard K/V one, so everything above the model is unchanged. The
multi-token-prediction layer GLM checkpoints carry after the decoder's layers is skipped by the loader.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_workers.checkpoint import ModelConfig
from gpu_workers.kernels.rotary import apply_rotary
from gpu_workers.model.attention import PagedAttention
from gpu_workers.model.deepseek_v3 import ScaledRotary
from gpu_workers.model.layers import RMSNorm, concat_linears
from gpu_workers.model.llama import DecoderLayer, LlamaForCausalLM
from gpu_workers.model.moe import feed_forward


def rotary_dims(config: ModelConfig) -> int:
    return int(config.head_dim * config.partial_rotary_factor)


class GlmAttention(nn.Module):
    """q/k/v projections, per-head q/k norm (``use_qk_norm``), RoPE on the first ``rotary_dims`` of each
    head (the rest passes through), attention through the paged cache, o_proj (no bias in GLM).

    ``fuse`` makes the q, k and v projections one matmul once the checkpoint is loaded."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.scale = config.head_dim**-0.5
        self.rotary_dims = rotary_dims(config)
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.qkv_proj: nn.Module | None = None  # a plain or a quantised linear
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dims == self.head_dim:
            return apply_rotary(x, cos, sin)
        rotated, passed = x.split([self.rotary_dims, self.head_dim - self.rotary_dims], dim=-1)
        return torch.cat((apply_rotary(rotated, cos, sin), passed), dim=-1)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: PagedAttention
    ) -> torch.Tensor:
        tokens = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        o = attn(self.layer_idx, q, k, v, scale=self.scale)
        return self.o_proj(o.reshape(tokens, self.num_heads * self.head_dim))

    def fuse(self) -> None:
        fused = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj, self.q_proj, self.k_proj, self.v_proj = fused, None, None, None


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """Same interface and KV entry as ``LlamaForCausalLM``; the rotary tables cover the rotated dims only."""

    cuda_graph_safe = False  # routing reads expert counts back to the host (moe.py)

    @staticmethod
    def decoder_layer(config: ModelConfig, layer_idx: int) -> DecoderLayer:
        """x += attn(norm(x)); x += mlp(norm(x)), the mlp dense in the first layers and MoE after."""
        attention = GlmAttention(config, layer_idx)
        return DecoderLayer(config, attention, feed_forward(config, layer_idx))

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model.rotary = ScaledRotary(config.rope, rotary_dims(config))

    def fuse_projections(self) -> None:
        """The experts' and dense MLPs' gate/up fusion of ``LlamaForCausalLM``, plus each layer's q/k/v."""
        super().fuse_projections()
        for module in self.modules():
            if isinstance(module, GlmAttention):
                module.fuse()
