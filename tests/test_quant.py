"""Weight formats: int4/fp8 round trips, `tessera quantize` checkpoints, loading them, and their quality."""

from __future__ import annotations

import json

import pytest
import torch
from tessera.cli import build_parser
from tessera.deployments import check_checkpoint
from torch import nn

from gpu_workers.checkpoint import ModelLoadError
from gpu_workers.formats.fp8 import FP8_MAX
from gpu_workers.formats.weights import (
    dequantize_fp8_weight,
    dequantize_int4,
    pack_int4,
    quantize_fp8_weight,
    quantize_int4,
    unpack_int4,
)
from gpu_workers.kernels.packed_linear import PackedLinear, cpu_packing_available
from gpu_workers.kernels.quant_linear import fp8_linear_reference, int4_linear_cpu, int4_linear_reference
from gpu_workers.model import load_model
from gpu_workers.quant.config import QuantConfig
from gpu_workers.quant.linear import Fp8Linear, Int4Linear, _identity
from gpu_workers.tools import capacity
from gpu_workers.tools.metrics import compare_models, token_windows
from gpu_workers.tools.quantize import quantize_checkpoint
from tests.hf_models import CASES, random_tokens, save_tiny


def run_cli(*argv) -> None:
    """``tessera <argv>``, parsed by the real parser and run in this process."""
    args = build_parser().parse_args([str(a) for a in argv])
    args.func(args)


@pytest.fixture(scope="module")
def converted(demo_model_dir, tmp_path_factory):
    """The demo checkpoint (float32) converted by `tessera quantize` to every format."""
    root = tmp_path_factory.mktemp("converted")
    for fmt in ("bf16", "fp8", "int4"):
        quantize_checkpoint(demo_model_dir, root / fmt, fmt)
    return {fmt: root / fmt for fmt in ("bf16", "fp8", "int4")}


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("cols", [256, 200])  # 200: a ragged last group of 72
def test_int4_round_trip_errs_by_half_a_step_inside_the_grid(symmetric, cols):
    w = torch.randn(32, cols) * 0.05
    w[3] += 1.0  # an all-positive row: zero points must follow it out of 0..15
    q = quantize_int4(w, 128, symmetric)
    assert q.weight_packed.shape == (32, cols // 2) and q.weight_scale.shape == (32, 2)
    assert (q.weight_zero is None) == symmetric
    w_hat = dequantize_int4(q.weight_packed, q.weight_scale, q.weight_zero, 128, torch.float32)
    step = q.weight_scale.float().repeat_interleave(128, dim=1)[:, :cols]
    error = (w - w_hat).abs() / step
    codes = unpack_int4(q.weight_packed)
    inside = (codes > 0) & (codes < 15)
    # An unclamped code is round(w / step) steps from the zero: at most half a step off. At the grid's
    # ends the integer zero point (and symmetric's [-8, 7]) can leave the extreme value one step off.
    assert (error[inside] <= 0.5 + 1e-4).all()
    assert (error <= 1 + 1e-2).all()
    assert error.mean() == pytest.approx(0.25, abs=0.03)  # uniform rounding error


def int4_layer(rows: int, cols: int, group: int, symmetric: bool, bias: bool) -> Int4Linear:
    torch.manual_seed(rows + cols + group)
    layer = Int4Linear(cols, rows, bias, torch.float32, group, symmetric)
    w = torch.randn(rows, cols) * 0.05
    w[1] += 0.5  # an all-positive row: its zero point leaves 0..15
    layer.load_dense(w)
    if bias:
        layer.bias.data.copy_(torch.randn(rows))
    return layer


@pytest.mark.parametrize(
    ("rows", "cols", "group", "symmetric", "bias"),
    [
        (64, 256, 128, False, False),
        (48, 256, 32, True, True),
        (32, 64, 128, False, False),  # one group wider than the input: x is zero-padded
        (32, 200, 64, False, True),  # a ragged last group of 8
        (16, 768, 256, True, False),
    ],
)
def test_cpu_packed_int4_kernel_computes_our_dequantised_weights(rows, cols, group, symmetric, bias):
    layer = int4_layer(rows, cols, group, symmetric, bias)
    x = torch.randn(3, 5, cols)
    dense = dequantize_int4(layer.weight_packed, layer.weight_scale, layer.weight_zero, group, torch.float32)
    reference = torch.nn.functional.linear(
        x.double(), dense.double(), None if layer.bias is None else layer.bias.double()
    )
    # torch's kernel over fp32 activations: exact weights, so only the summation order differs.
    out = int4_linear_cpu(x, layer.cpu_pack(torch.float32), layer.bias)
    assert out.shape == (3, 5, rows) and out.dtype == torch.float32
    # Only the summation order differs from float64 over the same weights: a wrong group, zero or nibble
    # mapping would be off by a whole quantisation step.
    assert (out.double() - reference).abs().max() < 1e-5 * reference.abs().max()
    pack, groups = layer.cpu_pack(torch.float32), -(-cols // group)
    # Half a byte per (padded) weight, an fp32 scale and offset per group: the checkpoint's bytes, bar
    # scales twice as wide as bf16.
    assert pack.nbytes == rows * groups * group // 2 + rows * groups * 2 * 4


def test_cpu_packed_int4_in_bf16_matches_the_bf16_reference():
    layer = int4_layer(64, 256, 128, False, False)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    args = (layer.weight_packed, layer.weight_scale, layer.weight_zero, 128)
    reference = int4_linear_reference(x.float(), *args)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - reference).abs().max() < 2**-6 * reference.abs().max()


@pytest.mark.parametrize("change", ["scales in place", "codes replaced"])
def test_an_int4_layer_serves_its_new_weights_after_they_change(change):
    """The pack a layer's calls reuse is made again when its stored buffers change in place or are replaced:
    never the old weights."""
    layer = int4_layer(64, 256, 128, False, False)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    before = layer(x)
    if change == "scales in place":
        layer.weight_scale.mul_(2)
    else:
        layer.weight_packed = torch.flip(layer.weight_packed, dims=[0]).contiguous()
    args = (layer.weight_packed, layer.weight_scale, layer.weight_zero, 128)
    reference = int4_linear_reference(x.float(), *args)
    after = layer(x)
    assert not torch.equal(after, before)
    assert (after.float() - reference).abs().max() < 2**-6 * reference.abs().max()


def test_fp32_compute_runs_large_int4_layers_on_the_kernel_and_small_ones_dequantised_once():
    large, small = int4_layer(1024, 1024, 128, False, True), int4_layer(64, 256, 128, False, True)
    for layer in (large, small):
        x = torch.randn(2, layer.in_features)
        args = (layer.weight_packed, layer.weight_scale, layer.weight_zero, 128, layer.bias)
        reference = int4_linear_reference(x, *args)
        out = layer(x)
        assert out.dtype == torch.float32
        if layer is small:
            assert torch.allclose(out, reference, rtol=1e-5, atol=1e-6)
            assert layer._cpu_pack._key is None and layer._dense._key is not None
        else:  # bf16 activations: their rounding, 2^-9, not the format's 4% error
            assert (out - reference).norm() < 2**-7 * reference.norm()
            assert layer._cpu_pack._key[0] == torch.bfloat16 and layer._dense._key is None


def test_int4_layers_the_cpu_kernel_cannot_take_run_the_reference():
    layer = int4_layer(24, 64, 16, False, False)  # 24 outputs and groups of 16: not in torch's kernel
    x = torch.randn(2, 64)
    args = (layer.weight_packed, layer.weight_scale, layer.weight_zero, 16)
    assert torch.equal(layer(x), int4_linear_reference(x, *args))


def test_cpu_int4_pack_follows_a_reloaded_weight(monkeypatch):
    layer = int4_layer(32, 128, 64, False, False)
    x = torch.randn(2, 128)
    before = layer(x)
    layer.load_state_dict({**layer.state_dict(), "weight_scale": layer.weight_scale * 2})
    assert torch.allclose(layer(x), before * 2, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("TESSERA_KERNELS", "reference")  # the per-call dequantising path, same numbers
    assert torch.allclose(layer(x), before * 2, rtol=1e-5, atol=1e-6)


def test_fp8_layer_on_cpu_dequantises_once_and_matches_the_reference():
    layer = Fp8Linear(96, 32, True, torch.float32)
    layer.load_dense(torch.randn(32, 96))
    layer.bias.data.copy_(torch.randn(32))
    x = torch.randn(3, 96)
    expected = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias)
    assert torch.equal(layer(x), expected)
    key = (x.dtype, *_identity(layer.weight, layer.weight_scale, layer.bias))
    prepared = layer._dense.get(key, None)
    assert prepared is not None  # kept from the first call
    assert torch.equal(layer(x), expected) and layer._dense.get(key, None) is prepared  # and reused
    layer.load_dense(torch.randn(32, 96))
    assert torch.equal(layer(x), fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias))


def test_fp8_layer_on_cpu_in_bf16_runs_the_packed_gemm_with_the_references_bits():
    layer = Fp8Linear(96, 48, True, torch.bfloat16)
    layer.load_dense(torch.randn(48, 96))
    layer.bias.data.copy_(torch.randn(48))
    for rows in (1, 5, 33):  # 33: padded to oneDNN's row bucket of 40, then sliced
        x = torch.randn(rows, 96).to(torch.bfloat16)
        assert torch.equal(layer(x), fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias))
    prepared = layer._dense.get(
        (torch.bfloat16, *_identity(layer.weight, layer.weight_scale, layer.bias)), None
    )
    assert isinstance(prepared, PackedLinear) == cpu_packing_available(torch.bfloat16)


def test_int4_packs_even_columns_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_int4(packed), codes)


def test_fp8_weight_maps_each_rows_amax_to_448():
    w = torch.randn(16, 64) * torch.logspace(-3, 1, 16)[:, None]  # rows of very different ranges
    q = quantize_fp8_weight(w)
    assert q.weight.dtype == torch.uint8 and q.weight_scale.shape == (16,)
    assert torch.allclose(
        q.weight.view(torch.float8_e4m3fn).float().abs().amax(1), torch.full((16,), FP8_MAX)
    )
    w_hat = dequantize_fp8_weight(q.weight, q.weight_scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 for normal values.
    assert ((w - w_hat).abs() <= w.abs() * 2**-4 + q.weight_scale[:, None] * 2**-9).all()


def test_quantize_writes_a_checkpoint_deployments_accept(demo_model_dir, tmp_path, capsys):
    dst = tmp_path / "int4"
    run_cli("quantize", demo_model_dir, dst, "--weights", "int4")
    out = capsys.readouterr().out
    assert "int4, groups of 128, asymmetric" in out and "linear weights:" in out and "0.266x" in out
    config = json.loads((dst / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["format"] == "int4" and quant["group_size"] == 128 and quant["symmetric"] is False
    assert {"embed_tokens", "lm_head", "norm", "block_sparse_moe.gate"} <= set(quant["modules_not_converted"])
    assert (dst / "tokenizer.json").read_bytes() == (demo_model_dir / "tokenizer.json").read_bytes()
    assert (dst / "tokenizer_config.json").is_file()
    check_checkpoint(dst, prefill_weights="int4", decode_weights="int4")  # the control plane agrees


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
def test_checkpoint_bytes_are_what_the_capacity_model_counts(demo_model_dir, converted, fmt):
    written = (converted[fmt] / "model.safetensors").stat().st_size
    predicted = capacity.checkpoint_model(demo_model_dir).weight_bytes(fmt)
    assert 0 <= written - predicted < 16 * 1024  # the safetensors JSON header is the only difference


def test_linear_weights_shrink_to_the_format_ratios(demo_model_dir, tmp_path):
    int4 = quantize_checkpoint(demo_model_dir, tmp_path / "int4", "int4")
    fp8 = quantize_checkpoint(demo_model_dir, tmp_path / "fp8", "fp8")
    # int4 g128: 0.5 byte + 4 bytes of bf16 scale and zero per 128 weights = 0.2656x bf16.
    assert int4.converted_bytes / int4.converted_bf16_bytes == pytest.approx((0.5 + 4 / 128) / 2)
    # fp8: 1 byte + an fp32 scale per output row (256 or 768 inputs) ≈ 0.50x bf16; int4 ≈ 0.53x fp8.
    assert fp8.converted_bytes / fp8.converted_bf16_bytes == pytest.approx(0.5, abs=0.01)
    assert int4.converted_bytes / fp8.converted_bytes == pytest.approx(0.53, abs=0.01)
    assert int4.converted_tensors == fp8.converted_tensors == 4 * 7


def test_quantized_checkpoint_loads_without_flags(converted):
    model = load_model(converted["int4"])
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.model.embed_tokens, nn.Embedding)
    assert model.quantization.format == "int4"
    assert isinstance(load_model(converted["fp8"]).model.layers[1].mlp.up_proj, Fp8Linear)
    assert load_model(converted["bf16"]).quantization is None


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantizing_at_load_gives_the_converted_checkpoints_tensors(demo_model_dir, converted, fmt):
    at_load = dict(load_model(demo_model_dir, weights=fmt).named_buffers())
    stored = dict(load_model(converted[fmt]).named_buffers())
    assert at_load.keys() == stored.keys() and len(stored) >= 4 * 7 * 2
    for name, tensor in stored.items():
        assert torch.equal(at_load[name], tensor), name


def test_a_quantized_checkpoint_refuses_other_weight_formats(converted):
    with pytest.raises(ModelLoadError, match="holds int4 weights.*cannot load as bf16"):
        load_model(converted["int4"], weights="bf16")
    with pytest.raises(ModelLoadError, match="cannot load as fp8"):
        load_model(converted["int4"], weights="fp8")
    assert load_model(converted["int4"], weights="int4").quantization.format == "int4"


def test_quantize_refuses_a_quantized_source_and_a_used_destination(converted, demo_model_dir, tmp_path):
    with pytest.raises(ValueError, match="already quantised"):
        quantize_checkpoint(converted["int4"], tmp_path / "again", "fp8")
    with pytest.raises(ValueError, match="not an empty folder"):
        quantize_checkpoint(demo_model_dir, converted["bf16"], "int4")
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_checkpoint(demo_model_dir, tmp_path / "g", "int4", group_size=100)


def test_quant_config_keeps_routers_but_converts_gate_proj():
    quant = QuantConfig("int4", group_size=128)
    assert quant.converts("model.layers.0.mlp.gate_proj")
    assert quant.converts("model.layers.0.block_sparse_moe.experts.3.w1")
    assert not quant.converts("model.layers.0.block_sparse_moe.gate")
    assert not quant.converts("model.layers.0.mlp.gate")
    assert not quant.converts("lm_head")
    assert QuantConfig.from_json(quant.to_json()) == quant


@pytest.mark.parametrize("arch", sorted(CASES))
def test_every_architecture_converts_with_the_expected_layer_error(arch, tmp_path):
    ckpt = save_tiny(arch, tmp_path / "src")
    reference = load_model(ckpt.path)
    # Per-layer relative error of round-to-nearest on Gaussian weights: fp8 e4m3 ≈ 2.3% (3 mantissa bits);
    # int4 in groups of 32 ≈ 8% (a group spans ~4 sigma in 15 steps, error step/sqrt(12)). Groups of 32 on
    # 32- and 48-wide inputs also exercise a ragged last group.
    expected = {"fp8": (0.015, 0.035), "int4": (0.05, 0.12)}
    for fmt, (low, high) in expected.items():
        quantize_checkpoint(ckpt.path, tmp_path / fmt, fmt, group_size=32)
        model = load_model(tmp_path / fmt)
        if arch == "mixtral":
            assert type(model.model.layers[0].block_sparse_moe.gate) is nn.Linear  # the router stays bf16
        report = compare_models(reference, model, [random_tokens(24, seed=3)])
        errors = list(report.layer_errors.values())
        assert len(errors) >= 2 * 7
        assert low < min(errors) and max(errors) < high, (fmt, errors)


def test_compare_models_of_identical_weights_reports_no_error(demo_model_dir):
    windows = token_windows([list(range(10, 60))], window=32)
    report = compare_models(load_model(demo_model_dir), load_model(demo_model_dir), windows)
    assert report.tokens == 31 + 17 and report.kl == pytest.approx(0, abs=1e-6) and report.top1 == 1.0
    assert max(report.layer_errors.values()) == 0.0 and report.nll == report.reference_nll


def test_a_sharded_checkpoint_keeps_its_shards_and_gets_a_new_index(tmp_path):
    ckpt = save_tiny("qwen2", tmp_path / "src", max_shard_size="20KB")
    assert len(list(ckpt.path.glob("*.safetensors"))) > 1
    quantize_checkpoint(ckpt.path, tmp_path / "int4", "int4", group_size=16)
    index = json.loads((tmp_path / "int4" / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.down_proj.weight_packed" in index["weight_map"]
    assert not any(name.endswith("proj.weight") for name in index["weight_map"])
    assert {p.name for p in (tmp_path / "int4").glob("*.safetensors")} == set(index["weight_map"].values())
    model = load_model(tmp_path / "int4")
    assert isinstance(model.model.layers[1].self_attn.q_proj, Int4Linear)
    assert model.model.layers[1].self_attn.q_proj.bias is not None  # Qwen2's biases stay bf16


@pytest.mark.parametrize("command", [["quantize"], ["bench", "kernels"], ["bench", "weights"]])
def test_every_command_prints_its_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(*command, "--help")
    assert exit_info.value.code == 0 and "usage: tessera" in capsys.readouterr().out
