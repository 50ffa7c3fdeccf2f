"""Tiny random Hugging Face checkpoints, and a runner that feeds our model through a paged KV cache."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from gpu_workers.kv import AttentionMetadata, KVCache
from gpu_workers.model.attention import PagedAttention

# Small enough to build and run in milliseconds; GQA (4 query heads share 2 KV heads) everywhere.
BASE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the 8-dim heads have wavelengths in all three bands: kept, interpolated, stretched.
    "original_max_position_embeddings": 16,
}
# One case per architecture, each switching on the features that architecture brings.
CASES: dict[str, tuple[type, dict]] = {
    "llama": (
        transformers.LlamaConfig,
        dict(rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True),
    ),
    "mistral": (transformers.MistralConfig, dict(sliding_window=8)),
    "qwen2": (
        transformers.Qwen2Config,
        # Layer 1 slides over 6 tokens, layer 0 attends to everything.
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
}
# DeepSeek-V3 / GLM-4.5 MoE: 3 layers (the first dense), 8 routed experts in 4 groups of which 2 are kept,
# top-2 per token, one shared expert. Used by tests/test_model_deepseek.py and tests/test_model_glm.py.
DEEPSEEK_MOE = dict(
    moe_intermediate_size=16,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    # = max_position_embeddings / original_max_position_embeddings, as YaRN configs have it.
    "factor": 16.0,
    # Small, so the 8 rope dims fall on both sides of the ramp: kept and interpolated.
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
MOE_CASES: dict[str, tuple[type, dict]] = {}
MOE_CASES["deepseek_v3"] = (
    transformers.DeepseekV3Config,
    dict(
        DEEPSEEK_MOE,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        rope_parameters=DEEPSEEK_YARN,
    ),
)
MOE_CASES["deepseek_v3_plain_q"] = (
    transformers.DeepseekV3Config,
    dict(
        MOE_CASES["deepseek_v3"][1],
        q_lora_rank=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    ),
)
MOE_CASES["glm4_moe"] = (
    transformers.Glm4MoeConfig,
    dict(
        DEEPSEEK_MOE,
        head_dim=16,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
)
MOE_CASES["glm4_moe_plain"] = (
    transformers.Glm4MoeConfig,
    dict(
        DEEPSEEK_MOE,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
)
PAGE_SIZE = 4


@dataclass
class Checkpoint:
    arch: str
    path: Path
    hf_model: transformers.PreTrainedModel

    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        """HF's logits for every position of one whole sequence, [len(ids), vocab]."""
        with torch.no_grad():
            return self.hf_model(torch.tensor([ids])).logits[0].float()


def save_tiny(arch: str, path: Path, seed: int = 0, max_shard_size: str | None = None) -> Checkpoint:
    """Build a random HF model of ``arch`` (a key of CASES or MOE_CASES) and ``save_pretrained`` it to ``path``."""
    config_cls, extra = {**CASES, **MOE_CASES}[arch]
    torch.manual_seed(seed)
    hf_model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**BASE, **extra})).eval()
    _spread_weights(hf_model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(path, **kwargs)
    return Checkpoint(arch, Path(path), hf_model)


def _spread_weights(model: torch.nn.Module) -> None:
    # HF's 0.02-std init leaves attention almost uniform and logits near zero, which would hide RoPE,
    # masking and routing bugs; wider weights and non-unit norms make every feature move the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3)


def random_tokens(n: int, seed: int, vocab_size: int = BASE["vocab_size"]) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]


def run_paged(
    model: torch.nn.Module,
    sequences: list[list[int]],
    schedule: list[list[tuple[int, int]]],
    num_pages: int = 32,
    kv_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Feed ``sequences`` through one paged cache and return each one's logits for every token it was fed.

    Each schedule entry is one step: a list of (sequence index, number of next tokens). A step may mix
    prefill chunks and single-token decodes of several sequences. ``kv_dtype`` is the cache's format
    (e.g. ``torch.float8_e4m3fn``: dynamic per-page scales).
    """
    cache = KVCache(model.kv_spec, num_pages, PAGE_SIZE, kv_dtype)
    # Shuffled page ids, handed out one at a time across sequences, so page tables are scattered.
    free = list(range(num_pages))
    random.Random(1).shuffle(free)
    tables: list[list[int]] = [[] for _ in sequences]
    fed = [0] * len(sequences)
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in schedule:
        ids, positions, context_lens, query_lens = [], [], [], []
        for seq, n in step:
            start, end = fed[seq], fed[seq] + n
            while len(tables[seq]) * PAGE_SIZE < end:
                tables[seq].append(free.pop())
            ids += sequences[seq][start:end]
            positions += range(start, end)
            context_lens.append(end)
            query_lens.append(n)
            fed[seq] = end
        meta = AttentionMetadata.build([tables[s] for s, _ in step], context_lens, query_lens, PAGE_SIZE)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), PagedAttention(cache, meta))
            step_logits = model.compute_logits(hidden)
        for (seq, _), chunk in zip(step, step_logits.split(query_lens), strict=True):
            logits[seq].append(chunk)
    return [torch.cat(chunks) for chunks in logits]
