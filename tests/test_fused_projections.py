"""Serving fuses q/k/v and gate/up into one matmul each after loading; outputs stay those of the checkpoint."""

from __future__ import annotations

import pytest
import torch

from gpu_workers import Engine, EngineConfig
from gpu_workers.kv import AttentionMetadata, KVCache
from gpu_workers.model import load_model
from gpu_workers.model.attention import PagedAttention
from gpu_workers.quant.linear import Fp8Linear, Int4Linear


def prefill_logits(model, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    cache = KVCache(model.kv_spec, num_pages=8, page_size=4, dtype=dtype)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", ["int4", "fp8"])
def test_quantised_projections_fuse_into_one_layer_of_their_format_with_the_same_logits(
    tiny_llama_dir, weights, dtype
):
    """Codes, scales (and int4's zero points) stack along the output dimension, so the fused layer holds
    the same numbers and computes the same logits: bit for bit on the CPUs measured (each output column's
    sum runs as before), within a last-bits tolerance here, since a kernel may block a wider matrix
    differently; a misplaced block of rows would be off by the logits' own size."""
    kind = {"int4": Int4Linear, "fp8": Fp8Linear}[weights]
    model = load_model(tiny_llama_dir, dtype=dtype, weights=weights)
    ids = [3, 17, 42, 9, 88, 5, 61, 23, 7, 100, 11]
    apart = prefill_logits(model, ids, dtype)
    attn = model.model.layers[0].self_attn
    q_scales, v_scales = attn.q_proj.weight_scale, attn.v_proj.weight_scale
    model.fuse_projections()
    assert isinstance(attn.qkv_proj, kind) and attn.q_proj is None
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, kind)
    assert model.model.layers[0].mlp.gate_proj is None
    q_rows, kv_rows = attn.qkv_sizes[0], attn.qkv_sizes[1]
    assert attn.qkv_proj.out_features == q_rows + 2 * kv_rows
    assert torch.equal(attn.qkv_proj.weight_scale[:q_rows], q_scales)  # q's rows first, v's last
    assert torch.equal(attn.qkv_proj.weight_scale[q_rows + kv_rows :], v_scales)
    fused = prefill_logits(model, ids, dtype)
    tolerance = (1e-5 if dtype == torch.float32 else 2e-2) * apart.abs().max().item()
    torch.testing.assert_close(fused, apart, rtol=0, atol=tolerance)


def test_projections_of_different_formats_stay_apart(tiny_llama_dir):
    model = load_model(tiny_llama_dir, weights="int4")
    attn = model.model.layers[0].self_attn
    attn.k_proj = load_model(tiny_llama_dir, weights="fp8").model.layers[0].self_attn.k_proj
    model.fuse_projections()
    assert attn.qkv_proj is None and isinstance(attn.q_proj, Int4Linear)  # int4 q, fp8 k: no common format
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Int4Linear)


def test_engine_serves_fused_projections_in_every_weight_format(demo_model_dir):
    for weights, kind in (("auto", torch.nn.Linear), ("int4", Int4Linear), ("fp8", Fp8Linear)):
        engine = Engine.from_pretrained(
            demo_model_dir, EngineConfig(dtype="float32", kv_budget_bytes=2**22, weights=weights)
        )
        attn = engine.model.model.layers[0].self_attn
        assert isinstance(attn.qkv_proj, kind) and attn.q_proj is None, weights


def test_int4_parts_fuse_only_where_each_keeps_its_own_cpu_path():
    """In fp32 compute a CPU int4 layer of >= 1M weights runs torch's kernel on bf16 activations, a smaller
    one its exact fp32 dequantised weight: two 512K-weight parts stay on the exact path fused (1M together),
    and a 1M part never fuses with a 256K one."""

    def part(out_features: int) -> Int4Linear:
        layer = Int4Linear(1024, out_features, False, torch.float32, 128, False)
        layer.load_dense(
            torch.randn(out_features, 1024, generator=torch.Generator().manual_seed(out_features))
        )
        return layer

    assert Int4Linear.concat([part(1024), part(256)]) is None
    parts = [part(512), part(512)]
    fused = Int4Linear.concat(parts)
    x = torch.randn(3, 1024)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-6, atol=1e-5)
