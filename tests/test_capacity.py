"""The memory model behind `tessera capacity`: weight bytes from real shapes, KV bytes per token, tokens."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest
import torch
import transformers

from gpu_workers.kv import KVSpec
from gpu_workers.tools import capacity as cap
from tests.hf_models import save_tiny

GIB = 2**30


def run_capacity(capsys, *argv: str) -> str:
    from tessera.cli.kv import add_commands

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(["capacity", *argv])
    args.func(args)
    return capsys.readouterr().out


# -- named configs: published shapes give published parameter counts ---------------------------------


@pytest.mark.parametrize(
    "name, params",
    [
        ("Llama-3.1-8B", 8_030_261_248),  # the exact count of meta-llama/Llama-3.1-8B
        ("Qwen3-32B", 32_762_123_264),
        ("Mixtral-8x7B", 46_702_792_704),
        ("DeepSeek-V3", 671.0e9),  # as published, without the 14B MTP module
        ("Kimi-K2", 1.026e12),  # "1.03T" on its model card
        ("GLM-5", 744e9),
    ],
)
def test_named_configs_have_their_published_parameter_counts(name, params):
    assert cap.named_model(name).num_params == pytest.approx(params, rel=0.002)


def test_llama_8b_figures_by_hand():
    model = cap.named_model("llama-3.1-8b")
    params = 8_030_261_248
    embed = 128256 * 4096  # embed_tokens and lm_head, each stays bf16
    norms = 4096 * (2 * 32 + 1)
    linear = params - 2 * embed - norms
    assert model.weight_bytes("bf16") == 2 * params
    rows = 32 * (4096 + 1024 + 1024 + 4096 + 14336 * 2 + 4096)  # output channels of every linear
    assert model.weight_bytes("fp8") == linear + 4 * rows + 2 * (2 * embed + norms)
    assert model.kv.bytes_per_token("bf16") == 32 * 2 * 8 * 128 * 2
    assert model.kv.bytes_per_token("fp8_e4m3", page_size=16) == 32 * 2 * 8 * 128 + 32 * 2 * 4 / 16
    rows_by_format = {(r.weight_format, r.kv_format): r for r in cap.capacity(model, 80, gpus=1)}
    bf16 = rows_by_format["bf16", "bf16"]
    assert bf16.tokens == (80 * GIB - 2 * params) // (32 * 2 * 8 * 128 * 2)
    for weights in cap.WEIGHT_FORMATS:
        ratio = rows_by_format[weights, "fp8_e4m3"].tokens / rows_by_format[weights, "bf16"].tokens
        assert 1.99 < ratio < 2.0  # 2x, less the fp32 scales per (layer, page)
    assert rows_by_format["int4", "bf16"].tokens > rows_by_format["fp8", "bf16"].tokens > bf16.tokens


def test_int4_packs_two_per_byte_with_a_bf16_scale_and_zero_per_128():
    model = cap.ModelShapes(
        "one", {"model.layers.0.mlp.down_proj.weight": (64, 300)}, cap.KVEntry(KVSpec(1, 1, 1))
    )
    assert model.weight_bytes("int4") == 64 * 150 + 64 * 3 * 4
    assert model.weight_bytes("fp8") == 64 * 300 + 64 * 4


def test_embeddings_lm_head_norms_and_routers_stay_bf16():
    model = cap.named_model("Mixtral-8x7B")
    kept = {name for name, shape in model.tensors.items() if not cap.is_quantizable(name, shape)}
    assert "model.layers.0.block_sparse_moe.gate.weight" in kept
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= kept
    assert not kept & {
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "model.layers.0.self_attn.q_proj.weight",
    }
    kimi = cap.named_model("Kimi-K2")
    assert not cap.is_quantizable(
        "model.layers.5.mlp.gate.weight", kimi.tensors["model.layers.5.mlp.gate.weight"]
    )
    assert cap.is_quantizable("model.layers.0.mlp.gate_proj.weight", (18432, 7168))


def test_mla_caches_one_latent_per_token_and_tensor_parallel_cannot_split_it():
    kimi = cap.named_model("Kimi-K2").kv
    assert (kimi.kind, kimi.num_layers, kimi.elements_per_layer) == ("mla", 61, 512 + 64)
    assert kimi.bytes_per_token("bf16", gpus=8) == kimi.bytes_per_token("bf16", gpus=1) == 61 * 576 * 2
    llama = cap.named_model("Llama-3.1-8B").kv
    assert llama.bytes_per_token("bf16", gpus=8) == llama.bytes_per_token("bf16") / 8
    # More GPUs than KV heads: each GPU still holds one whole head.
    assert llama.bytes_per_token("bf16", gpus=16) == llama.bytes_per_token("bf16", gpus=8)
    glm = cap.named_model("GLM-5").kv
    assert glm.elements_per_layer == 512 + 64 + 128  # latent, rope key, DSA indexer key


# -- checkpoints: the same model, read from safetensors headers ---------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "mixtral"])
def test_generated_shapes_match_a_transformers_checkpoint(tmp_path, arch):
    save_tiny(arch, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert cap.checkpoint_model(tmp_path).tensors == cap.hf_tensor_shapes(config)


def test_generated_mla_shapes_match_a_transformers_deepseek_v3_checkpoint(tmp_path):
    config = transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
        max_position_embeddings=64,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    model = cap.checkpoint_model(tmp_path)
    assert model.tensors == cap.hf_tensor_shapes(raw)
    assert (model.kv.kind, model.kv.num_layers, model.kv.elements_per_layer, model.kv.shards) == (
        "mla",
        3,
        20,
        1,
    )


def test_capacity_of_a_checkpoint_folder(tiny_llama_dir, capsys):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model = cap.checkpoint_model(tiny_llama_dir)
    assert model.num_params == sum(p.numel() for p in hf.parameters())
    assert (model.kv.kind, model.kv.num_layers, model.kv.elements_per_layer, model.kv.shards) == (
        "gqa",
        2,
        64,
        2,
    )
    report = json.loads(
        run_capacity(capsys, "--model", str(tiny_llama_dir), "--memory-gib", "0.001", "--json")
    )
    rows = {(r["weight_format"], r["kv_format"]): r for r in report["rows"]}
    free = 0.001 * GIB - 2 * model.num_params
    assert rows["bf16", "bf16"]["tokens"] == int(free // (2 * 64 * 2))
    assert rows["bf16", "fp8_e4m3"]["tokens"] == int(free // (2 * 64 + 2 * 2 * 4 / 16))


def test_capacity_command_prints_every_weight_and_kv_format(capsys):
    out = run_capacity(capsys, "--config", "Kimi-K2", "--memory-gib", "140", "--gpus", "8")
    assert "Kimi-K2: 1,026.41B parameters" in out
    for fmt in ("bf16", "fp8", "int4"):
        assert any(line.startswith(fmt) for line in out.splitlines())
    assert "70,272.0" in out  # 61 layers x 576 elements x 2 bytes


def tessera_capacity(capsys, *argv: str) -> tuple[int, str, str]:
    """`tessera capacity ...` through the CLI's own main: (exit code, stdout, stderr)."""
    from tessera.cli import main

    try:
        code = main(["capacity", *argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


LLAMA = ("--config", "Llama-3.1-8B")


@pytest.mark.parametrize(
    "argv, message",
    [
        (LLAMA, "--memory-gib"),
        ((*LLAMA, "--memory-gib", "-1"), "--memory-gib"),
        ((*LLAMA, "--memory-gib", "0"), "--memory-gib"),
        ((*LLAMA, "--memory-gib", "lots"), "--memory-gib"),
        ((*LLAMA, "--memory-gib", "80", "--gpus", "0"), "--gpus"),
        ((*LLAMA, "--memory-gib", "80", "--reserve-gib", "-2"), "--reserve-gib"),
        ((*LLAMA, "--memory-gib", "80", "--page-size", "0"), "--page-size"),
        (("--config", "GPT-5", "--memory-gib", "80"), "unknown model config 'GPT-5'"),
    ],
    ids=["no-memory", "negative-memory", "zero-memory", "memory-not-a-number", "zero-gpus",
         "negative-reserve", "zero-page-size", "unknown-config"],
)  # fmt: skip
def test_bad_capacity_arguments_exit_2_with_a_message(capsys, argv, message):
    code, out, err = tessera_capacity(capsys, *argv)
    assert code == 2
    assert message in err and out == ""


@pytest.mark.parametrize("extra", [(), ("--json",)], ids=["table", "json"])
def test_weights_over_the_memory_do_not_fit_and_exit_non_zero(capsys, extra):
    # Llama-3.1-8B's int4 weights alone are 5.4 GiB.
    code, out, err = tessera_capacity(capsys, *LLAMA, "--memory-gib", "4", *extra)
    assert code == 1
    assert "does not fit" in err and "int4" in err and "5.4 GiB" in err
    if extra:
        assert not any(row["fits"] for row in json.loads(out)["rows"])
    else:
        assert out.count("does not fit") == 3 and not re.search(r"\s-\d", out)  # no negative free memory


def test_reserve_counts_against_the_memory_when_deciding_what_fits(capsys):
    code, _, err = tessera_capacity(capsys, *LLAMA, "--memory-gib", "16", "--reserve-gib", "16")
    assert code == 1 and "does not fit" in err


def test_formats_that_do_not_fit_are_marked_while_the_others_are_counted(capsys):
    code, out, _ = tessera_capacity(capsys, *LLAMA, "--memory-gib", "10")
    assert code == 0
    rows = {
        line.split()[0]: line
        for line in out.splitlines()
        if line.split()[:1] in (["bf16"], ["fp8"], ["int4"])
    }
    assert "does not fit" in rows["bf16"] and not re.search(r"\s-\d", rows["bf16"])
    assert "does not fit" not in rows["fp8"] and "12,593" in rows["fp8"]
    assert "37,595" in rows["int4"]


# -- the seed's published figures (SEED-NOTES.md) -------------------------------------------------------


def routed_int4_g32_bytes(model: cap.ModelShapes) -> int:
    """Bytes of a checkpoint in Kimi K2.6's published convention: routed experts INT4, groups of 32 with a
    bf16 scale and no zero point; attention, shared experts, dense layers, embeddings stay BF16."""
    total = 0
    for name, shape in model.tensors.items():
        numel = math.prod(shape)
        if ".experts." in name:
            rows = numel // shape[-1]
            total += numel // 2 + rows * (shape[-1] // 32) * 2
        else:
            total += 2 * numel
    return total


def glm_mtp_layer(model: cap.ModelShapes) -> cap.ModelShapes:
    """GLM-5's checkpoint carries one multi-token-prediction layer: a MoE decoder layer plus its eh_proj."""
    layer = {name: shape for name, shape in model.tensors.items() if name.startswith("model.layers.77.")}
    layer["model.layers.78.eh_proj.weight"] = (6144, 2 * 6144)
    return cap.ModelShapes("GLM-5 MTP", layer, model.kv)


def test_seed_figures_kimi_fp8_kv_doubles_in_memory_context():
    # Seed: BF16 KV ~686k tokens -> FP8 KV ~1.37M tokens on the same deployment (ratio 1.997).
    kimi = cap.named_model("Kimi-K2")
    rows = {(r.weight_format, r.kv_format): r for r in cap.capacity(kimi, 140, gpus=8)}
    ratio = rows["int4", "fp8_e4m3"].tokens / rows["int4", "bf16"].tokens
    assert ratio == pytest.approx(1.37e6 / 686e3, rel=0.01)
    # 686k BF16 tokens of MLA latent are 44.9 GiB per GPU (replicated under TP). With K2.6's own INT4
    # checkpoint (594 GB, 69.2 GiB/GPU on 8 GPUs), a 140 GiB H200 leaves 70.8 GiB: the deployment
    # reserves ~26 GiB/GPU (~18.5%) for activations, CUDA graphs and workspace, which we do not model.
    weights_per_gpu = routed_int4_g32_bytes(kimi) / 8 / GIB
    kv_per_gpu = 686e3 * kimi.kv.bytes_per_token("bf16", gpus=8) / GIB
    assert weights_per_gpu == pytest.approx(69.2, abs=0.1) and kv_per_gpu == pytest.approx(44.9, abs=0.1)
    reserve = 140 - weights_per_gpu - kv_per_gpu
    assert reserve == pytest.approx(25.9, abs=0.2)


def test_seed_figures_glm_int4_checkpoint_and_kv_room():
    glm, mtp = cap.named_model("GLM-5"), glm_mtp_layer(cap.named_model("GLM-5"))
    # FP8 checkpoint, seed 705 GB (~88 GB/GPU on 8): our FP8 format plus the MTP layer, in GiB.
    fp8 = (glm.weight_bytes("fp8") + mtp.weight_bytes("fp8")) / GIB
    assert fp8 == pytest.approx(705, rel=0.01)
    # INT4, seed 421 GB: our format (all linear layers, g128 + zero points) is 12% smaller; the
    # K2.6-style convention (routed experts only, g32) lands on the published size.
    assert (glm.weight_bytes("int4") + mtp.weight_bytes("int4")) / GIB == pytest.approx(376, abs=1)
    published_style = (routed_int4_g32_bytes(glm) + routed_int4_g32_bytes(mtp)) / GIB
    assert published_style == pytest.approx(421, rel=0.01)
    # ~1.18M tokens: with Kimi's implied 25.9 GiB/GPU reserve, 421 GiB of INT4 weights on 8 x 140 GiB
    # leave room for 1.19M tokens of FP8 KV (latent + rope + indexer key); BF16 KV would hold 0.59M.
    free = (140 - 25.9 - 421 / 8) * GIB
    assert free / glm.kv.bytes_per_token("fp8_e4m3", gpus=8) == pytest.approx(1.18e6, rel=0.02)
    assert free / glm.kv.bytes_per_token("bf16", gpus=8) == pytest.approx(0.59e6, rel=0.02)


def test_a_quantised_checkpoint_counts_the_weights_it_holds(demo_model_dir, tmp_path):
    from gpu_workers.tools import capacity
    from gpu_workers.tools.quantize import quantize_checkpoint

    original = capacity.checkpoint_model(demo_model_dir)
    for fmt in ("int4", "fp8"):
        quantize_checkpoint(demo_model_dir, tmp_path / fmt, fmt)
        converted = capacity.checkpoint_model(tmp_path / fmt)
        assert converted.tensors == original.tensors
