"""`tessera capacity` and the engine agree on KV bytes per token: one declaration, measured allocations.

For every architecture the engine serves and every KV format, a tiny checkpoint is built at test time, an
engine allocates its pool, and the bytes of the tensors it really holds (K, V, FP8 scales, INT8 entries'
own scales; a tensor shared between K and V counted once) per token of capacity must equal the planner's figure for the same
checkpoint folder.
"""

from __future__ import annotations

import json

import pytest

from gpu_workers import Engine, EngineConfig
from gpu_workers.checkpoint import ModelConfig
from gpu_workers.kv import KVCache
from gpu_workers.model.deepseek_v3 import DeepseekV3ForCausalLM
from gpu_workers.tools import capacity as cap
from tests.hf_models import save_tiny

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "deepseek_v3", "glm4_moe"]
PAGE_SIZE = 16


def allocated_bytes(cache: KVCache) -> int:
    """Bytes of the distinct tensors the cache holds (MLA's V is its K, and its V scales its K scales)."""
    held = {}
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        if t is not None:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(held.values())


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("kv_format", cap.KV_FORMATS)
def test_planner_bytes_per_token_equal_what_the_engine_pool_allocates(checkpoint, kv_format):
    config = EngineConfig(
        dtype="float32", kv_cache_dtype=kv_format, kv_budget_bytes=2**20, page_size=PAGE_SIZE
    )
    engine = Engine.from_pretrained(checkpoint.path, config)
    measured = allocated_bytes(engine.cache) / engine.cache.capacity_tokens
    planned = cap.checkpoint_model(checkpoint.path).kv.bytes_per_token(kv_format, page_size=PAGE_SIZE)
    assert planned == measured
    assert engine.stats()["kv_bytes_per_token"] == measured


def test_kimi_k2_capacity_agrees_with_the_engine_cache_for_the_v3_config(capsys):
    from tessera.cli import main

    assert main(["capacity", "--config", "Kimi-K2", "--memory-gib", "140", "--gpus", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    planned = {r["kv_format"]: r["kv_bytes_per_token_per_gpu"] for r in report["rows"]}
    config = ModelConfig.from_dict(cap.NAMED_CONFIGS["Kimi-K2"])
    spec = DeepseekV3ForCausalLM.cache_entry(config)  # what the model's kv_spec gives the engine
    for kv_format, dtype in cap.KV_DTYPES.items():
        cache = KVCache(spec, 2, PAGE_SIZE, dtype)
        assert planned[kv_format] == allocated_bytes(cache) / cache.capacity_tokens
    # One latent tensor per layer: 61 x 576 values, plus one fp32 scale per (layer, page) under FP8, one
    # bf16 scale per entry under INT8.
    assert planned == {
        "bf16": 61 * 576 * 2,
        "int8": 61 * (576 + 2),
        "fp8_e4m3": 61 * 576 + 61 * 4 / PAGE_SIZE,
    }
    assert planned["fp8_e4m3"] == 35_151.25


def test_tensor_parallel_splits_kv_heads_but_replicates_the_latent():
    llama, kimi = cap.named_model("Llama-3.1-8B").kv, cap.named_model("Kimi-K2").kv
    assert llama.bytes_per_token("fp8_e4m3", gpus=8) == (32 * 2 * 1 * 128 * 16 + 32 * 2 * 4) / 16
    assert kimi.bytes_per_token("fp8_e4m3", gpus=8) == kimi.bytes_per_token("fp8_e4m3") == 35_151.25
