"""DeepSeek-style mixture of experts (DeepSeek-V3, Kimi K2, GLM-4.5): a sigmoid router with a correction
bias and group-limited top-k, routed SwiGLU experts computed grouped by expert, and shared experts.

Module names match the checkpoints' (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{i}.gate_proj.weight``, ``mlp.shared_experts.*``). The router is a plain parameter, not an
``nn.Linear``, so weight quantisation never touches it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.checkpoint import ModelConfig, MoEConfig
from gpu_workers.model.layers import MLP


class TopkRouter(nn.Module):
    """Each token's top-k experts and their weights [T, k], routed in fp32.

    Scores are sigmoid(logits); the choice adds ``e_score_correction_bias`` (load balancing) and keeps the
    experts of the ``topk_group`` groups whose two best biased scores sum highest. The weights are the
    unbiased scores of the chosen experts, renormalised to sum to one with ``norm_topk_prob``, times
    ``routed_scaling_factor``.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe: MoEConfig):
        super().__init__()
        self.top_k = top_k
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias.float()
        moe = self.moe
        if moe.n_group > 1 and moe.topk_group < moe.n_group:
            grouped = biased.view(len(x), moe.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1).indices, True)
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).view(len(x), -1)
        chosen = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, chosen


def grouped_experts(
    x: torch.Tensor, experts: nn.ModuleList, weights: torch.Tensor, chosen: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * experts[chosen[t, k]](x[t]), computed expert by expert: the T*k assignments are
    sorted by expert so each active expert runs once, as one matmul per projection, on all its tokens."""
    top_k = chosen.shape[1]
    flat_expert = chosen.flatten()
    order = flat_expert.argsort(stable=True)
    counts = torch.bincount(flat_expert, minlength=len(experts)).tolist()
    flat_weight = weights.flatten()
    out = torch.zeros_like(x)
    for expert, assignments in zip(experts, order.split(counts), strict=True):
        if assignments.numel() == 0:
            continue
        tokens = assignments // top_k
        y = expert(x[tokens]) * flat_weight[assignments, None].to(x.dtype)
        out.index_add_(0, tokens, y)
    return out


class DeepseekMoE(nn.Module):
    """routed experts (top-k of ``num_experts``) + shared experts (one SwiGLU of n_shared x the width)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.gate = TopkRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok, moe)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, moe.intermediate_size) for _ in range(config.num_experts)
        )
        self.shared_experts = (
            MLP(config.hidden_size, moe.intermediate_size * moe.num_shared_experts)
            if moe.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x)
        out = grouped_experts(x, self.experts, weights, chosen)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def feed_forward(config: ModelConfig, layer_idx: int) -> nn.Module:
    """The layer's ``mlp``: a dense SwiGLU in the first ``first_k_dense_replace`` layers, MoE after."""
    if layer_idx < config.moe.first_k_dense_replace:
        return MLP(config.hidden_size, config.intermediate_size)
    return DeepseekMoE(config)
