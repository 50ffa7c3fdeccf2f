"""Mixtral: the Llama/Mistral decoder with a sparse mixture of SwiGLU experts in place of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.checkpoint import ModelConfig
from gpu_workers.model.llama import Attention, DecoderLayer, LlamaForCausalLM


class Expert(nn.Module):
    """One SwiGLU expert, in Mixtral's names: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Each token goes to its top-k experts by router softmax; their outputs are summed, weighted by the
    top-k probabilities renormalised to sum to one."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(config.hidden_size, config.intermediate_size) for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # Sort the T*k (token, expert) assignments by expert so each expert runs once on all its tokens.
        flat_expert = chosen.flatten()
        order = flat_expert.argsort(stable=True)
        counts = torch.bincount(flat_expert, minlength=len(self.experts)).tolist()
        flat_weight = weights.flatten()
        out = torch.zeros_like(x)
        for expert, assignments in zip(self.experts, order.split(counts), strict=True):
            if assignments.numel() == 0:
                continue
            tokens = assignments // self.top_k
            y = expert(x[tokens]) * flat_weight[assignments, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class MixtralForCausalLM(LlamaForCausalLM):
    """Same interface as ``LlamaForCausalLM``; only the feed-forward differs."""

    cuda_graph_safe = False  # routing reads expert counts back to the host (moe.py)

    @staticmethod
    def decoder_layer(config: ModelConfig, layer_idx: int) -> DecoderLayer:
        """x += attn(norm(x)); x += moe(norm(x)), the experts under Mixtral's ``block_sparse_moe``."""
        attention = Attention(config, layer_idx)
        return DecoderLayer(config, attention, SparseMoE(config), ffn_name="block_sparse_moe")
