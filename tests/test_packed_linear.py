"""Serving on the CPU packs bf16 linears for oneDNN once at load: outputs bit-identical to ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.kernels.packed_linear import PackedLinear, bucket_rows, cpu_packing_available, pack_linears
from gpu_workers.model import load_model

pytestmark = pytest.mark.skipif(
    not cpu_packing_available(torch.bfloat16), reason="this CPU or torch build has no oneDNN bf16 GEMM"
)


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_exactly_what_f_linear_computes_for_any_batch(bias):
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(160, 96, generator=gen))
    packed = PackedLinear(linear)
    for shape in ((1, 96), (7, 96), (33, 96), (300, 96), (2049, 96), (2, 5, 96), (3, 17, 96)):
        x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))


def test_row_counts_run_in_few_sizes_that_hold_them():
    # Every size from 1 to 4,096 rows maps onto at most ~90 GEMM shapes (oneDNN caches 1,024 primitives),
    # never fewer rows than asked, and small decode batches run exactly.
    sizes = {rows: bucket_rows(rows) for rows in range(0, 4097)}
    assert all(padded >= rows for rows, padded in sizes.items())
    assert all(sizes[rows] == rows for rows in range(33))
    assert len(set(sizes.values())) <= 100
    assert max(padded / rows for rows, padded in sizes.items() if rows > 256) < 1.25


def test_only_plain_bf16_linears_are_packed():
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8), nn.Embedding(4, 8))
    assert pack_linears(model) == 1
    assert isinstance(model[0], PackedLinear) and type(model[1]) is nn.Linear


def test_a_bf16_engine_packs_its_linears_and_greedy_tokens_stay_those_of_the_unpacked_model(tiny_llama_dir):
    config = EngineConfig(dtype="bfloat16", kv_budget_bytes=2**22)
    packed = Engine.from_pretrained(tiny_llama_dir, config)
    # 2 layers x (q/k/v, o, gate/up, down) and the untied output projection.
    assert packed.stats()["packed_linears"] == 9 and isinstance(packed.model.lm_head, PackedLinear)
    model = load_model(tiny_llama_dir, dtype=torch.bfloat16)
    model.fuse_projections()
    plain = Engine(model, None, config)
    assert plain.stats()["packed_linears"] == 0
    prompts = [[3, 17, 42, 9], [88, 5, 61, 23, 7, 100, 11], [1] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in packed.generate(prompts, params)] == want
    fp32 = Engine.from_pretrained(tiny_llama_dir, EngineConfig(dtype="float32", kv_budget_bytes=2**22))
    assert fp32.stats()["packed_linears"] == 0  # fp32: F.linear is as fast, and faster at one row


def test_a_tied_output_projection_gets_a_packed_copy_with_bit_identical_logits(tmp_path):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    HFLlama(config).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    embedding = model.model.embed_tokens.weight
    hidden = torch.randn(5, 64).to(torch.bfloat16)
    want = model.compute_logits(hidden)
    assert model.lm_head is None and model.pack_tied_output()
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.out_features == 160
    assert torch.equal(model.compute_logits(hidden), want)
    # The input lookup still reads the checkpoint's embedding, in its own layout.
    assert model.model.embed_tokens.weight is embedding and embedding.dtype == torch.bfloat16
    assert not model.pack_tied_output()  # it has its own projection now
    # The engine packs it at load: one fused q/k/v, o, gate/up and down, and the output projection.
    engine = Engine.from_pretrained(tmp_path, EngineConfig(dtype="bfloat16", kv_budget_bytes=2**22))
    assert engine.stats()["packed_linears"] == 5 and isinstance(engine.model.lm_head, PackedLinear)
    fp32 = load_model(tmp_path, dtype=torch.float32)
    assert not fp32.pack_tied_output() and fp32.lm_head is None  # no packed fp32 GEMM: stays tied
