"""GLM-4.5 MoE (partial RoPE, q/k norm, attention biases, grouped sigmoid-routed MoE) equals transformers.

Tiny random checkpoints built and saved by transformers at test time: one with q/k norm, q/k/v biases and
group-limited routing (8 experts in 4 groups, 2 kept), one without any of them and unnormalised top-k
weights; both rotate half of each head, have a dense first layer and a shared expert.
"""

from __future__ import annotations

import logging
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.model import load_model
from gpu_workers.model.deepseek_v3 import ScaledRotary
from gpu_workers.model.glm4_moe import GlmAttention
from gpu_workers.model.layers import MLP
from gpu_workers.model.moe import DeepseekMoE
from tests.hf_models import PAGE_SIZE, Checkpoint, random_tokens, run_paged, save_tiny

TOLERANCE = 1e-4
PROMPT = random_tokens(20, seed=1)
OTHER = random_tokens(14, seed=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["glm4_moe", "glm4_moe_plain"])
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def model(checkpoint: Checkpoint) -> torch.nn.Module:
    return load_model(checkpoint.path)


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape
    return (ours - theirs).abs().max().item()


def make_engine(path, **overrides) -> Engine:
    config = dict(dtype="float32", kv_budget_bytes=2**20, page_size=PAGE_SIZE, max_num_batched_tokens=64)
    return Engine.from_pretrained(path, EngineConfig(**{**config, **overrides}))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 120) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def test_whole_prompt_prefill_matches_hf(checkpoint, model):
    [logits] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    assert max_diff(logits, checkpoint.hf_logits(PROMPT)) <= TOLERANCE


def test_chunked_prefill_then_decode_matches_hf(checkpoint, model):
    schedule = [[(0, 7)], [(0, 6)]] + [[(0, 1)]] * 7
    [logits] = run_paged(model, [PROMPT], schedule)
    assert max_diff(logits, checkpoint.hf_logits(PROMPT)) <= TOLERANCE


def test_two_sequences_packed_in_one_step_match_hf(checkpoint, model):
    schedule = [[(0, 12), (1, 9)], [(0, 1), (1, 4)], [(0, 7), (1, 1)]]
    first, second = run_paged(model, [PROMPT, OTHER], schedule)
    assert max_diff(first, checkpoint.hf_logits(PROMPT)) <= TOLERANCE
    assert max_diff(second, checkpoint.hf_logits(OTHER)) <= TOLERANCE


def test_features_under_test_are_switched_on(checkpoint, model):
    config = model.config
    layers = model.model.layers
    assert config.architecture == "Glm4MoeForCausalLM" and config.partial_rotary_factor == 0.5
    assert layers[0].self_attn.rotary_dims == config.head_dim // 2 and config.num_kv_heads < config.num_heads
    assert type(layers[0].mlp) is MLP and all(isinstance(layer.mlp, DeepseekMoE) for layer in layers[1:])
    assert all(isinstance(layer.self_attn, GlmAttention) for layer in layers)
    grouped = checkpoint.arch == "glm4_moe"
    assert (config.qk_norm, config.qkv_bias, config.moe.norm_topk_prob) == (grouped, grouped, grouped)
    assert (config.moe.n_group, config.moe.topk_group) == ((4, 2) if grouped else (1, 1))
    assert (layers[0].self_attn.q_proj.bias is not None) == grouped
    assert layers[0].self_attn.o_proj.bias is None


def test_partial_rotary_changes_the_logits(checkpoint, model):
    # Guards the parity tests: rotating whole heads must give different logits than rotating half.
    [partial] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    attns = [layer.self_attn for layer in model.model.layers]
    rotary = model.model.rotary
    try:
        model.model.rotary = ScaledRotary(model.config.rope, model.config.head_dim)
        for attn in attns:
            attn.rotary_dims = attn.head_dim
        [whole] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    finally:
        model.model.rotary = rotary
        for attn in attns:
            attn.rotary_dims = attn.head_dim // 2
    assert max_diff(partial, whole) > 1e-2


def test_greedy_engine_generation_matches_hf_generate(checkpoint):
    engine = make_engine(checkpoint.path)
    # The engine serves fused projections: q/k/v and every MLP's gate/up as one matmul each.
    layer = engine.model.model.layers[1]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.experts[0].gate_up_proj is not None
    for prompt in prompts(3, seed=1):
        expected = checkpoint.hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert engine.generate([prompt], GREEDY)[0].token_ids == expected


def test_batch_of_16_with_preemption_equals_running_alone(checkpoint, model):
    batch = prompts(16, seed=2)
    alone = make_engine(checkpoint.path)
    expected = [alone.generate([p], GREEDY)[0].token_ids for p in batch]
    budget = 96 * model.kv_spec.bytes_per_token(torch.float32)  # 96 tokens for 16 requests of up to 50
    engine = make_engine(checkpoint.path, kv_budget_bytes=budget, max_num_batched_tokens=16)
    outputs = engine.generate(batch, GREEDY)
    assert engine.stats()["preemptions"] > 0
    assert [o.token_ids for o in outputs] == expected


def test_fp8_kv_runs_and_stays_close(checkpoint, model):
    engine = make_engine(checkpoint.path, kv_cache_dtype="fp8_e4m3")
    spec = model.kv_spec
    assert engine.stats()["kv_bytes_per_token"] == spec.bytes_per_token(torch.uint8) + 2 * spec.num_layers
    outputs = engine.generate(prompts(4, seed=3), GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)
    schedule = [[(0, 7)], [(0, 6)]] + [[(0, 1)]] * 7
    [fp8] = run_paged(model, [PROMPT], schedule, kv_dtype=torch.float8_e4m3fn)
    [exact] = run_paged(model, [PROMPT], schedule)
    assert (fp8.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.6


def test_mtp_layer_in_the_checkpoint_is_skipped_with_a_log_line(checkpoint, tmp_path, caplog):
    path = tmp_path / "with-mtp"
    shutil.copytree(checkpoint.path, path)
    tensors = load_file(path / "model.safetensors")
    mtp = {k.replace(".layers.2.", ".layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="gpu_workers.model.loader"):
        model = load_model(path)
    assert any("multi-token-prediction" in r.message for r in caplog.records)
    [logits] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    assert max_diff(logits, checkpoint.hf_logits(PROMPT)) <= TOLERANCE
