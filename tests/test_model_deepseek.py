"""DeepSeek-V3 (MLA over a latent KV cache, YaRN, grouped sigmoid-routed MoE) equals transformers.

Tiny random checkpoints, built and saved by transformers at test time: one with the q LoRA and YaRN
scaling, one with a plain q projection and default RoPE; both with a dense first layer, 8 experts in 4
groups (2 kept, top-2) and a shared expert. Logits are compared in fp32 through the paged cache: whole
prefill, chunked prefill then decode, and packed with another sequence; greedy generation through the
``Engine`` equals HF ``generate``.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.checkpoint import ModelConfig, ModelLoadError
from gpu_workers.model import load_model
from gpu_workers.model.deepseek_v3 import MLAttention, latent_kv_spec
from gpu_workers.model.layers import MLP
from gpu_workers.model.moe import DeepseekMoE
from gpu_workers.tools.capacity import NAMED_CONFIGS, named_model
from tests.hf_models import PAGE_SIZE, Checkpoint, random_tokens, run_paged, save_tiny

TOLERANCE = 1e-4
PROMPT = random_tokens(20, seed=1)
OTHER = random_tokens(14, seed=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# The tiny configs' latent entry: kv_lora_rank 16 + qk_rope_head_dim 8 values per layer, 3 layers.
LAYERS, ENTRY = 3, 16 + 8


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v3_plain_q"])
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
    # 7 + 6 prompt tokens in two chunks, then 7 single-token decode steps through the latent pages.
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
    assert config.architecture == "DeepseekV3ForCausalLM"
    assert (config.moe.n_group, config.moe.topk_group, config.moe.num_shared_experts) == (4, 2, 1)
    assert config.moe.first_k_dense_replace == 1 and config.moe.routed_scaling_factor == 2.5
    layers = model.model.layers
    assert type(layers[0].mlp) is MLP and all(isinstance(layer.mlp, DeepseekMoE) for layer in layers[1:])
    assert all(isinstance(layer.self_attn, MLAttention) for layer in layers)
    if checkpoint.arch == "deepseek_v3":
        assert config.mla.q_lora_rank == 24 and config.rope.type == "yarn"
        assert config.rope.mscale_all_dim == 1.0 and layers[0].self_attn.scale > config.head_dim**-0.5
    else:
        assert config.mla.q_lora_rank is None and config.rope.type == "default"
        assert hasattr(layers[0].self_attn, "q_proj")


def test_group_limited_routing_changes_the_logits(checkpoint, model):
    # Guards the parity tests: routing over all 4 groups must give different logits than keeping 2.
    [routed] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    gates = [layer.mlp.gate for layer in model.model.layers[1:]]
    try:
        for gate in gates:
            gate.moe = dataclasses.replace(gate.moe, topk_group=gate.moe.n_group)
        [ungrouped] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    finally:
        for gate in gates:
            gate.moe = dataclasses.replace(gate.moe, topk_group=2)
    assert max_diff(routed, ungrouped) > 1e-2
    assert max_diff(routed, checkpoint.hf_logits(PROMPT)) <= TOLERANCE


def test_greedy_engine_generation_matches_hf_generate(checkpoint):
    engine = make_engine(checkpoint.path)
    for prompt in prompts(3, seed=1):
        expected = checkpoint.hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert engine.generate([prompt], GREEDY)[0].token_ids == expected


def test_batch_of_16_with_preemption_equals_running_alone(checkpoint):
    batch = prompts(16, seed=2)
    alone = make_engine(checkpoint.path)
    expected = [alone.generate([p], GREEDY)[0].token_ids for p in batch]
    # 96 latent tokens for 16 requests of up to 50 tokens, 16 tokens a step: chunked prefill and preemption.
    budget = 96 * LAYERS * ENTRY * 4
    engine = make_engine(checkpoint.path, kv_budget_bytes=budget, max_num_batched_tokens=16)
    outputs = engine.generate(batch, GREEDY)
    assert engine.stats()["preemptions"] > 0
    assert [o.token_ids for o in outputs] == expected


def test_prefix_cache_reuses_latent_pages_within_a_tenant_only(checkpoint):
    engine = make_engine(checkpoint.path)
    shared = random_tokens(17, seed=5)
    first = engine.generate([shared + [3, 4]], GREEDY, tenant="a")[0].token_ids
    again = engine.generate([shared + [3, 4]], GREEDY, tenant="a")[0].token_ids
    hits = engine.stats()["prefix_cache_hit_tokens"]
    assert again == first and hits >= 16  # four full 4-token latent pages of the shared prompt
    engine.generate([shared + [3, 4]], GREEDY, tenant="b")
    assert engine.stats()["prefix_cache_hit_tokens"] == hits


def test_latent_cache_holds_one_entry_of_rank_plus_rope_per_layer(checkpoint):
    for kv_dtype, element in (("auto", 4), ("bf16", 2)):
        engine = make_engine(checkpoint.path, kv_cache_dtype=kv_dtype)
        assert engine.stats()["kv_bytes_per_token"] == LAYERS * ENTRY * element
        assert engine.cache.v is engine.cache.k  # one tensor per layer: values are the latent part
        assert engine.cache.nbytes == engine.cache.k.nbytes
        assert engine.model.kv_spec == latent_kv_spec(engine.model.config)
        # What the pool allocates per token of capacity is the declared entry.
        assert engine.cache.nbytes / engine.cache.capacity_tokens == LAYERS * ENTRY * element
    # transformers caches per-head K (nope + rope) and V for each of the 4 heads.
    per_head_kv = LAYERS * 4 * ((8 + 8) + 12)
    assert per_head_kv / ENTRY / LAYERS > 4


def test_kimi_k2_latent_entry_is_576_values_per_layer_as_tessera_capacity_says():
    config = ModelConfig.from_dict({**NAMED_CONFIGS["Kimi-K2"], "max_position_embeddings": 131072})
    spec = latent_kv_spec(config)  # what DeepseekV3ForCausalLM.kv_spec returns, without building 61 layers
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.v_is_k) == (61, 1, 576, True)
    engine_bytes = spec.bytes_per_token(torch.bfloat16)
    assert engine_bytes == 61 * 576 * 2 == named_model("Kimi-K2").kv.bytes_per_token("bf16")
    # transformers caches K (128 nope + 64 rope) and V (128) for each of the 64 heads: 35.6x the latent.
    assert 61 * 64 * (192 + 128) * 2 / engine_bytes >= 25


def test_prefill_to_decode_handoff_through_fp8_latent_kv_matches_one_engine(checkpoint):
    first_token = SamplingParams(temperature=0.0, max_tokens=1)
    rest = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens - 1, ignore_eos=True)
    prefill = make_engine(checkpoint.path, kv_cache_dtype="fp8_e4m3")
    decode = make_engine(checkpoint.path, kv_cache_dtype="fp8_e4m3")
    single = make_engine(checkpoint.path, kv_cache_dtype="fp8_e4m3")
    for prompt in prompts(3, seed=4):
        events = []
        prefill.add_request(prompt, first_token, export_kv="fp8_e4m3", on_event=events.append)
        while prefill.has_unfinished():
            prefill.step()
        block = events[-1].kv
        assert block.kv_format == "fp8_e4m3" and tuple(block.k.shape[2:]) == (1, ENTRY)
        decoded = []
        decode.add_request(prompt + events[-1].token_ids, rest, kv_import=block, on_event=decoded.append)
        while decode.has_unfinished():
            decode.step()
        out = [t for e in decoded for t in e.token_ids]
        assert events[-1].token_ids + out == single.generate([prompt], GREEDY)[0].token_ids


def test_fp8_latent_kv_runs_and_stays_close(checkpoint, model, monkeypatch):
    engine = make_engine(checkpoint.path, kv_cache_dtype="fp8_e4m3")
    # FP8 latent + rope key, one fp32 scale per layer and page.
    assert engine.stats()["kv_bytes_per_token"] == LAYERS * ENTRY + LAYERS * 4 / PAGE_SIZE
    outputs = engine.generate(prompts(4, seed=3), GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)

    schedule = [[(0, 7)], [(0, 6)]] + [[(0, 1)]] * 7
    [fp8] = run_paged(model, [PROMPT], schedule, kv_dtype=torch.float8_e4m3fn)
    [exact] = run_paged(model, [PROMPT], schedule)
    # Measured on these random checkpoints: top-1 0.5 / 0.8, KL mean 0.14 / 0.10 (wide random weights make
    # attention peaky; tiny Llama with the same weights: top-1 0.9, KL 0.009).
    assert (fp8.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.4
    # The one-tensor latent entry quantises exactly as a separate K and V copy of it would.
    spec = model.kv_spec
    monkeypatch.setattr(
        type(model), "kv_spec", property(lambda self: dataclasses.replace(spec, v_is_k=False))
    )
    [two_tensors] = run_paged(model, [PROMPT], schedule, kv_dtype=torch.float8_e4m3fn)
    assert torch.equal(fp8, two_tensors)


@pytest.mark.parametrize("weights", ["fp8", "int4"])
def test_quantised_weights_keep_the_router_and_absorb_the_quantised_kv_b_proj(checkpoint, weights):
    model = load_model(checkpoint.path, weights=weights)
    attn = model.model.layers[1].self_attn
    assert type(attn.kv_b_proj) is not torch.nn.Linear
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router is never quantised
    latent = torch.randn(5, attn.rank)
    w_uk, w_uv = attn.absorbed_weights()
    with torch.inference_mode():
        kv = attn.kv_b_proj(latent).view(5, attn.num_heads, attn.nope + attn.v_dim)
    torch.testing.assert_close(torch.einsum("tr,hdr->thd", latent, torch.cat((w_uk, w_uv), 1)), kv)
    # Paged decode through the latent pages gives the quantised model's own whole-prompt logits.
    [decoded] = run_paged(model, [PROMPT], [[(0, 13)]] + [[(0, 1)]] * 7)
    [whole] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    assert max_diff(decoded, whole) <= TOLERANCE


def test_mtp_layer_in_the_checkpoint_is_skipped_with_a_log_line(checkpoint, tmp_path, caplog):
    path = tmp_path / "with-mtp"
    shutil.copytree(checkpoint.path, path)
    tensors = load_file(path / "model.safetensors")
    # The MTP layer sits after the decoder's layers: a decoder layer's tensors plus its own projections.
    mtp = {k.replace(".layers.2.", ".layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    mtp["model.layers.3.enorm.weight"] = torch.ones(32)
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="gpu_workers.model.loader"):
        model = load_model(path)
    assert any(
        "multi-token-prediction" in r.message and "model.layers.3" in r.message for r in caplog.records
    )
    [logits] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    assert max_diff(logits, checkpoint.hf_logits(PROMPT)) <= TOLERANCE

    # A layer beyond the MTP layers is a config/weights mismatch, not something to skip.
    save_file({**tensors, "model.layers.7.enorm.weight": torch.ones(32)}, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.7\.enorm\.weight"):
        load_model(path)
