"""The Llama decoder; Mistral, Qwen2 and Qwen3 are the same network with config flags.

Biases (Qwen2, attention_bias), per-head q/k RMSNorm (Qwen3) and sliding windows (Mistral, Qwen) come
from ``ModelConfig``. Module names match the checkpoint's tensor names, so weights load by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.checkpoint import ModelConfig
from gpu_workers.kernels.packed_linear import packed_copy
from gpu_workers.kv import KVSpec
from gpu_workers.model.attention import PagedAttention
from gpu_workers.model.layers import MLP, RMSNorm, concat_linears
from gpu_workers.model.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Project to q/k/v, attend through the paged cache (which rotates q and k by position), project back.

    ``fuse`` makes the q, k and v projections one matmul once the checkpoint is loaded.
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.qkv_proj: nn.Module | None = None  # a plain or a quantised linear
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: PagedAttention
    ) -> torch.Tensor:
        tokens = x.shape[0]
        # Submodules read from _modules: nn.Module's attribute fallback costs ~1 us a read, many a step.
        modules = self._modules
        qkv_proj = modules.get("qkv_proj")
        if qkv_proj is not None and self.q_norm is None:  # the fused output goes to attention whole
            o = attn.rotate_and_attend(
                self.layer_idx,
                qkv_proj(x),
                cos,
                sin,
                self.num_heads,
                self.num_kv_heads,
                self.scale,
                self.sliding_window,
            )
            return modules["o_proj"](o.reshape(tokens, self.num_heads * self.head_dim))
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        o = attn(self.layer_idx, q, k, v, self.scale, self.sliding_window, rotary=(cos, sin))
        return self.o_proj(o.reshape(tokens, self.num_heads * self.head_dim))

    def fuse(self) -> None:
        fused = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj, self.q_proj, self.k_proj, self.v_proj = fused, None, None, None


class DecoderLayer(nn.Module):
    """The pre-norm decoder layer every family shares: x += attn(norm(x)); x += ffn(norm(x)), with x carried
    as (last sublayer's output, residual): each add is done by the next norm (``RMSNorm.add_norm``), one
    kernel with it where Triton runs. A family hands over its attention and feed-forward modules; the
    feed-forward is registered under its checkpoint's name (``mlp``; Mixtral's ``block_sparse_moe``)."""

    def __init__(self, config: ModelConfig, attention: nn.Module, ffn: nn.Module, ffn_name: str = "mlp"):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.add_module(ffn_name, ffn)
        self.ffn_name = ffn_name

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: PagedAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The sublayers' forward, not their module call: nothing hooks them, and at decode the call's
        # hook checks are a few microseconds each, every layer of every step.
        modules, kernels = self._modules, attn.backend  # (see Attention.forward)
        x, residual = modules["input_layernorm"].add_norm(x, residual, kernels)
        x, residual = modules["post_attention_layernorm"].add_norm(
            modules["self_attn"].forward(x, cos, sin, attn), residual, kernels
        )
        return modules[self.ffn_name].forward(x), residual


class DecoderStack(nn.Module):
    """Token embedding, the decoder layers and the final norm (HF's ``model.*`` tensors)."""

    def __init__(self, config: ModelConfig, layer: Callable[[ModelConfig, int], DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer.forward(x, residual, cos, sin, attn)  # no module call: nothing hooks layers
        return self.norm.add_norm(x, residual, attn.backend)[0]


class LlamaForCausalLM(nn.Module):
    """``model(input_ids, positions, attn) -> hidden [T, hidden]``; ``compute_logits(hidden) -> [N, vocab]``.

    ``input_ids`` and ``positions`` are the flat batch [T] of every scheduled sequence's new tokens.
    """

    # A forward with no host sync and shapes fixed by its inputs' shapes: a decode step can be captured
    # as a CUDA graph (engine/graphs.py). MoE layers read expert counts back to the host: not safe.
    cuda_graph_safe: bool = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, self.decoder_layer)
        # Tied checkpoints reuse the embedding as the output projection and store no lm_head.weight.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @staticmethod
    def decoder_layer(config: ModelConfig, layer_idx: int) -> DecoderLayer:
        """Layer ``layer_idx`` of this family: its attention and feed-forward in the shared layer."""
        attention = Attention(config, layer_idx)
        return DecoderLayer(
            config, attention, MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        )

    @classmethod
    def cache_entry(cls, config: ModelConfig) -> KVSpec:
        """The cache entry this architecture declares for ``config``, without building the model: what the
        engine allocates (``kv_spec``) and ``tessera capacity`` plans with."""
        return KVSpec(config.num_layers, config.num_kv_heads, config.head_dim)

    @property
    def kv_spec(self) -> KVSpec:
        return self.cache_entry(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def fuse_projections(self) -> None:
        """Fuse each layer's q/k/v and gate/up projections into one matmul each, for serving. Module
        names then differ from the checkpoint's, so this runs after loading; quantised layers fuse as well
        (``concat_linears``) when the fused projections share one format."""
        for module in self.modules():
            if isinstance(module, Attention | MLP):
                module.fuse()

    def pack_tied_output(self) -> bool:
        """On the CPU, give a tied output projection its own packed copy of the embedding
        (``kernels.packed_linear.packed_copy``: vocab x hidden bytes more, the logits bit-identical, the
        projection ~2x faster at decode's batch sizes); whether it did. For a serving model, after loading:
        ``lm_head`` then holds the copy, which no checkpoint stores."""
        if self.lm_head is not None:
            return False
        self.lm_head = packed_copy(self.model.embed_tokens.weight)
        return self.lm_head is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] of the hidden states [N, hidden] the caller picked (e.g. last tokens)."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        # A module call, not its weight: serving may have packed it, or a tied embedding's copy
        # (kernels.packed_linear).
        return self.lm_head(hidden).float()
