"""Serving fuses q/k/v and gate/up into one matmul each after loading; outputs stay those of the checkpoint."""

from __future__ import annotations

import torch

from gpu_workers import Engine, EngineConfig
from gpu_workers.kv import AttentionMetadata, KVCache, PagedAttention
from gpu_workers.model import load_model
from gpu_workers.quant.linear import Int4Linear


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    cache = KVCache(model.kv_spec, num_pages=8, page_size=4, dtype=torch.float32)
    pages = [5, 2, 7, 0, 3, 6, 1, 4][: -(-len(ids) // 4)]
    meta = AttentionMetadata.build([pages], [len(ids)], [len(ids)], page_size=4)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), PagedAttention(cache, meta))
        return model.compute_logits(hidden)


def test_fused_model_computes_the_same_logits(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    ids = [3, 17, 42, 9, 88, 5, 61, 23, 7, 100, 11]
    before = prefill_logits(model, ids)
    model.fuse_projections()
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.self_attn.q_proj is None
    assert layer.mlp.gate_up_proj is not None and layer.mlp.gate_proj is None
    assert torch.allclose(prefill_logits(model, ids), before, atol=1e-5)


def test_engine_serves_fused_and_quantised_layers_stay_apart(demo_model_dir):
    dense = Engine.from_pretrained(demo_model_dir, EngineConfig(dtype="float32", kv_budget_bytes=2**22))
    assert dense.model.model.layers[0].self_attn.qkv_proj is not None
    int4 = Engine.from_pretrained(
        demo_model_dir, EngineConfig(dtype="float32", kv_budget_bytes=2**22, weights="int4")
    )
    attn = int4.model.model.layers[0].self_attn
    assert attn.qkv_proj is None and isinstance(attn.q_proj, Int4Linear)
