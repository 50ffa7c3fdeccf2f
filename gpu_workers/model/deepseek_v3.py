"""DeepSeek-V3 (and the Kimi K2 text decoders): multi-head latent attention over a latent KV cache, YaRN
RoPE, and DeepSeek's MoE (``model.moe``) after the first dense layers.

MLA caches one entry per token and layer: the ``kv_lora_rank`` latent (after ``kv_a_layernorm``) and the
shared, rotated ``qk_rope_head_dim`` rope key (576 values for V3's 512 + 64). Attention never
decompresses it: by weight absorption, each head's nope query is projected into the latent space through
its slice of ``kv_b_proj`` (W_UK), so ``q_nope . (W_UK c) = (q_nope W_UK) . c``, and the heads attend as
MQA over the entries, one "KV head" of 576 dims shared by all query heads. The values are the latent part
of the same entries; each head's latent output goes back through its W_UV slice, then ``o_proj``. The
softmax scale is the original one, qk_head_dim^-0.5, times YaRN's mscale².

The model declares this entry as ``KVSpec(layers, 1, kv_lora_rank + qk_rope_head_dim,
v_is_k=True)``, so the engine's allocator, prefix cache, integrity tags and FP8 formats hold the latent.

The multi-token-prediction layer some checkpoints carry (``model.layers.{num_hidden_layers}``) is not
part of this decoder; the loader skips it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gpu_workers.checkpoint import ModelConfig, RopeConfig
from gpu_workers.kernels.rotary import apply_rotary
from gpu_workers.kv import KVSpec
from gpu_workers.model.attention import PagedAttention
from gpu_workers.model.layers import RMSNorm
from gpu_workers.model.llama import DecoderLayer, LlamaForCausalLM
from gpu_workers.model.moe import feed_forward
from gpu_workers.model.rotary import inverse_frequencies

# DeepSeek's q_a/kv_a norms use the default epsilon whatever rms_norm_eps says (as transformers does).
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies for ``dim`` rotary dims and the factor cos/sin are scaled by.

    Wavelengths longer than the original context are interpolated by ``factor``, short ones kept, with a
    linear ramp between the dims that make ``beta_fast`` and ``beta_slow`` rotations over it."""
    base, factor, old_len = rope.theta, rope.factor, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    return inv_freq, float(attention_factor)


class ScaledRotary(nn.Module):
    """Positions [T] -> (cos, sin) [T, dim], scaled by YaRN's attention factor (1 for other rope types)."""

    def __init__(self, rope: RopeConfig, dim: int):
        super().__init__()
        if rope.type == "yarn":
            self.inv_freq, self.attention_factor = yarn_inverse_frequencies(rope, dim)
        else:
            self.inv_freq, self.attention_factor = inverse_frequencies(rope, dim), 1.0

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return (
            (angles.cos() * self.attention_factor).to(dtype),
            (angles.sin() * self.attention_factor).to(dtype),
        )


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: dims (0, 1), (2, 3), ... are the rotated pairs. Returned in the half-split layout
    (evens then odds), as transformers does; q and k both get it, so their dot products are unchanged."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention_scale(config: ModelConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)² under a scaled RoPE (DeepSeek's correction)."""
    scale = config.head_dim**-0.5
    rope = config.rope
    if rope.type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class MLAttention(nn.Module):
    """Multi-head latent attention with the absorbed (latent-space) attention described in the module doc."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        mla = config.mla
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.nope, self.rope, self.rank, self.v_dim = (
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.kv_lora_rank,
            mla.v_head_dim,
        )
        self.interleaved = mla.rope_interleave
        self.q_lora_rank = mla.q_lora_rank
        self.scale = attention_scale(config)
        q_size = config.num_heads * (self.nope + self.rope)
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(config.hidden_size, q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, mla.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.rank + self.rope, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, config.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(config.num_heads * self.v_dim, config.hidden_size, bias=config.qkv_bias)
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, rank] and W_UV [heads, v_dim, rank], the per-head slices of kv_b_proj."""
        if type(self.kv_b_proj) is nn.Linear:
            weight = self.kv_b_proj.weight
        elif self._absorbed is None:  # a quantised kv_b_proj: its dense weight, once, from the identity
            eye = torch.eye(
                self.rank, dtype=self.kv_a_layernorm.weight.dtype, device=self.kv_a_layernorm.weight.device
            )
            weight = self.kv_b_proj(eye).T
        else:
            return self._absorbed
        w_uk, w_uv = weight.view(self.num_heads, self.nope + self.v_dim, self.rank).split(
            [self.nope, self.v_dim], 1
        )
        if type(self.kv_b_proj) is not nn.Linear:
            self._absorbed = (w_uk, w_uv)
        return w_uk, w_uv

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: PagedAttention
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self._queries(x)
        q_nope, q_rope = q.view(tokens, self.num_heads, self.nope + self.rope).split(
            [self.nope, self.rope], -1
        )
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rope = k_rope.view(tokens, 1, self.rope)
        rotate = apply_rotary_interleaved if self.interleaved else apply_rotary
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope, cos, sin)
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        entry = torch.cat((latent[:, None, :], k_rope), dim=-1)  # [T, 1, rank + rope]: what the cache holds
        o = attn(self.layer_idx, torch.cat((q_latent, q_rope), dim=-1), entry, entry, scale=self.scale)
        out = torch.einsum("thr,hvr->thv", o[..., : self.rank], w_uv)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Same interface as ``LlamaForCausalLM``; the rotary tables cover the rope dims only, and the KV
    entry is the latent one."""

    cuda_graph_safe = False  # routing reads expert counts back to the host (moe.py)

    @staticmethod
    def decoder_layer(config: ModelConfig, layer_idx: int) -> DecoderLayer:
        """x += mla(norm(x)); x += mlp(norm(x)), the mlp dense in the first layers and MoE after."""
        attention = MLAttention(config, layer_idx)
        return DecoderLayer(config, attention, feed_forward(config, layer_idx))

    # The latent option of an FP8 KV cache: False quantises the whole entry under the page scale; True
    # keeps the rope key in bf16 (the published FP8 MLA layout). Set it before the engine is built.
    kv_rope_bf16: bool = False

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model.rotary = ScaledRotary(config.rope, config.mla.qk_rope_head_dim)

    @classmethod
    def cache_entry(cls, config: ModelConfig, rope_bf16: bool = False) -> KVSpec:
        return latent_kv_spec(config, rope_bf16)

    @property
    def kv_spec(self) -> KVSpec:
        return self.cache_entry(self.config, self.kv_rope_bf16)


def latent_kv_spec(config: ModelConfig, rope_bf16: bool = False) -> KVSpec:
    """The cache entry of an MLA model, from its config alone (no weights): one tensor per layer of one
    "KV head" holding the latent and the rope key, values read from the same slots; ``rope_bf16`` keeps
    the rope key out of FP8 (``KVSpec.bf16_tail``)."""
    mla = config.mla
    tail = mla.qk_rope_head_dim if rope_bf16 else 0
    return KVSpec(config.num_layers, 1, mla.kv_lora_rank + mla.qk_rope_head_dim, v_is_k=True, bf16_tail=tail)
