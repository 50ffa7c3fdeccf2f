"""Our models' logits equal Hugging Face transformers' for tiny random checkpoints of every architecture.

Each is checked as one whole-prompt prefill, as chunked prefill then decode through the paged cache, and
packed with a second sequence in the same steps.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from gpu_workers.checkpoint import ModelConfig
from gpu_workers.model import load_model
from gpu_workers.model.rotary import inverse_frequencies
from tests.hf_models import CASES, Checkpoint, random_tokens, run_paged, save_tiny

TOLERANCE = 1e-4
PROMPT = random_tokens(20, seed=1)
OTHER = random_tokens(14, seed=2)


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def model(checkpoint: Checkpoint) -> torch.nn.Module:
    return load_model(checkpoint.path)


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape
    return (ours - theirs).abs().max().item()


def test_whole_prompt_prefill_matches_hf(checkpoint, model):
    [logits] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    assert max_diff(logits, checkpoint.hf_logits(PROMPT)) <= TOLERANCE


def test_chunked_prefill_then_decode_matches_hf(checkpoint, model):
    # 7 + 6 prompt tokens in two chunks, then 7 single-token decode steps: chunks straddle 4-token pages.
    schedule = [[(0, 7)], [(0, 6)]] + [[(0, 1)]] * 7
    [logits] = run_paged(model, [PROMPT], schedule)
    assert max_diff(logits, checkpoint.hf_logits(PROMPT)) <= TOLERANCE


def test_two_sequences_packed_in_one_step_match_hf(checkpoint, model):
    # Steps mix prefill chunks and decodes of both sequences, whose pages interleave in the cache.
    schedule = [[(0, 12), (1, 9)], [(0, 1), (1, 4)], [(0, 7), (1, 1)]]
    first, second = run_paged(model, [PROMPT, OTHER], schedule)
    assert max_diff(first, checkpoint.hf_logits(PROMPT)) <= TOLERANCE
    assert max_diff(second, checkpoint.hf_logits(OTHER)) <= TOLERANCE


def test_features_under_test_are_switched_on(checkpoint, model):
    config = model.config
    expected = {
        "llama": dict(rope_type="llama3", qkv_bias=True, o_bias=True, mlp_bias=True),
        "mistral": dict(sliding_windows=(8, 8)),
        "qwen2": dict(qkv_bias=True, o_bias=False, sliding_windows=(None, 6)),
        "qwen3": dict(qk_norm=True, head_dim=16, tie_word_embeddings=True),
        "mixtral": dict(num_experts=4, num_experts_per_tok=2),
    }[checkpoint.arch]
    actual = {**dataclasses.asdict(config), "rope_type": config.rope.type}
    assert {k: actual[k] for k in expected} == expected
    assert config.num_kv_heads < config.num_heads
    if config.tie_word_embeddings:
        with safe_open(checkpoint.path / "model.safetensors", framework="pt") as f:
            assert "lm_head.weight" not in f.keys()  # noqa: SIM118 - safe_open is not a mapping


def test_mistral_sliding_window_changes_logits(tmp_path):
    # Guards the parity test above: a 20-token prompt under an 8-token window must differ from full attention.
    checkpoint = save_tiny("mistral", tmp_path)
    model = load_model(checkpoint.path)
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    [logits] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    assert max_diff(logits, checkpoint.hf_logits(PROMPT)) > 1e-2


def test_pre_transformers5_rope_keys_load_identically(tmp_path):
    # Checkpoints in the wild spell RoPE as top-level rope_theta plus rope_scaling with a "type" key.
    checkpoint = save_tiny("llama", tmp_path / "new")
    legacy = tmp_path / "legacy"
    shutil.copytree(checkpoint.path, legacy)
    config = json.loads((legacy / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    (legacy / "config.json").write_text(json.dumps(config))

    model = load_model(legacy)
    assert model.config.rope == load_model(checkpoint.path).config.rope
    [logits] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    assert max_diff(logits, checkpoint.hf_logits(PROMPT)) <= TOLERANCE


def test_linear_rope_scaling_matches_hf_frequencies():
    hf_config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
    )
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](hf_config, "cpu")
    config = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert config.rope.type == "linear"
    torch.testing.assert_close(inverse_frequencies(config.rope, config.head_dim), hf_inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_equals_hf_bit_for_bit(dtype):
    """The norm every decoder layer runs twice: HF's LlamaRMSNorm to the last bit, in bf16 and fp32, on
    rows of very different scales (the fused kernel must reduce as HF's pow/mean/rsqrt does)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from gpu_workers.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(0)
    for dim in (64, 256, 4096):
        x = (torch.randn(300, dim, generator=gen) * torch.logspace(-3, 3, 300)[:, None]).to(dtype)
        weight = torch.randn(dim, generator=gen).to(dtype)
        theirs, ours = LlamaRMSNorm(dim, eps=1e-5).to(dtype), RMSNorm(dim, 1e-5).to(dtype)
        theirs.weight.data.copy_(weight)
        ours.weight.data.copy_(weight)
        assert torch.equal(ours(x), theirs(x))
