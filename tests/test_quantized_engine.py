"""The engine on quantised weights: int4/fp8 checkpoints and load-time quantisation, token for token."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.checkpoint import ModelLoadError
from gpu_workers.formats.weights import dequantize_fp8_weight, dequantize_int4
from gpu_workers.model import load_model
from gpu_workers.quant.linear import Fp8Linear, Int4Linear
from gpu_workers.tokenizer import load_tokenizer
from gpu_workers.tools.quantize import quantize_checkpoint

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def push(self, item):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def int4_dir(demo_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("demo-int4")
    quantize_checkpoint(demo_model_dir, path, "int4")
    return path


def config(**overrides) -> EngineConfig:
    return EngineConfig(**{"dtype": "float32", "kv_budget_bytes": 8 * 2**20, **overrides})


def dequantized_copy(model: nn.Module) -> nn.Module:
    """The torch reference of a quantised model: each quantised layer replaced by an ``nn.Linear`` holding
    its dequantised weight, so every matmul is a plain dense one."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Int4Linear):
            args = (module.weight_packed, module.weight_scale, module.weight_zero, module.group_size)
            weight = dequantize_int4(*args, torch.float32)
        elif isinstance(module, Fp8Linear):
            weight = dequantize_fp8_weight(module.weight, module.weight_scale, torch.float32)
        else:
            continue
        dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        dense.weight.data.copy_(weight)
        if module.bias is not None:
            dense.bias.data.copy_(module.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, dense)
    return model


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_greedy_output_equals_the_dense_torch_reference_exactly(demo_model_dir, tmp_path, fmt):
    path = tmp_path / fmt
    quantize_checkpoint(demo_model_dir, path, fmt)
    engine = Engine.from_pretrained(path, config())
    reference = Engine(dequantized_copy(load_model(path)), load_tokenizer(path), config())
    ours, theirs = engine.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in ours)


def test_int4_at_load_serves_what_the_converted_checkpoint_serves(demo_model_dir, int4_dir):
    # bf16 compute: the converted checkpoint's bf16 embeddings and norms equal the source's cast at load.
    at_load = Engine.from_pretrained(demo_model_dir, config(dtype="bfloat16", weights="int4"))
    converted = Engine.from_pretrained(int4_dir, config(dtype="bfloat16"))
    assert [o.token_ids for o in at_load.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in converted.generate(PROMPTS, GREEDY)
    ]


def test_one_checkpoint_serves_fp8_prefill_and_int4_decode(demo_model_dir):
    """Phase-aware formats: a prefill engine on fp8 weights hands its KV to a decode engine on int4 weights."""
    prefill = Engine.from_pretrained(demo_model_dir, config(weights="fp8"))
    decode = Engine.from_pretrained(demo_model_dir, config(weights="int4", kv_cache_dtype="fp8_e4m3"))
    assert isinstance(prefill.model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert isinstance(decode.model.model.layers[0].mlp.down_proj, Int4Linear)
    prompt = prefill.tokenizer.encode(PROMPTS[0])
    first: list = []
    prefill.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=1), export_kv="fp8_e4m3", on_event=first.append
    )
    while prefill.has_unfinished():
        prefill.step()
    assert first[-1].finish_reason == "length" and first[-1].kv.kv_format == "fp8_e4m3"
    rest: list = []
    decode.add_request(prompt + first[-1].token_ids, GREEDY, kv_import=first[-1].kv, on_event=rest.append)
    while decode.has_unfinished():
        decode.step()
    assert rest[-1].error is None and sum(len(e.token_ids) for e in rest) == GREEDY.max_tokens
    assert decode.stats()["kv_pages_used"] == 0


def test_asking_for_bf16_weights_of_an_int4_checkpoint_is_a_clear_error(int4_dir):
    with pytest.raises(ModelLoadError, match=r"holds int4 weights.*weights='auto'"):
        Engine.from_pretrained(int4_dir, config(weights="bf16"))


def test_weights_must_be_a_known_format():
    with pytest.raises(ValueError, match="weights must be auto, bf16, fp8 or int4"):
        EngineConfig(weights="int8")


def test_int4_engine_on_prepared_cpu_weights_decodes_what_the_per_call_reference_decodes(
    int4_dir, monkeypatch
):
    engine = Engine.from_pretrained(int4_dir, config())
    packed = engine.generate(PROMPTS, GREEDY)
    layer = engine.model.model.layers[0].mlp.down_proj
    # The demo's layers are small: fp32 compute dequantised them once instead of every call.
    assert layer._dense._key is not None and layer._cpu_pack._key is None
    monkeypatch.setenv("TESSERA_KERNELS", "reference")
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [o.token_ids for o in packed]


def test_bench_weights_reports_decode_speed_per_format_beside_quality(demo_model_dir, capsys):
    from tessera.bench.weights import run_weights

    run_weights(demo_model_dir, ["bf16", "fp8", "int4"], 128, False, None, 256, False, True, 4, 2, 1, True)
    report = json.loads(capsys.readouterr().out)
    assert [row["weights"] for row in report["quality"]] == ["bf16", "fp8", "int4"]
    speed = report["decode"]
    assert set(speed["tok_s"]) == {"checkpoint", "fp8", "int4", "fp8 (reference)", "int4 (reference)"}
    assert all(s["median"] > 0 for s in speed["tok_s"].values())
    assert set(speed["vs_checkpoint"]) == set(speed["tok_s"]) - {"checkpoint"}
    assert speed["batch"] == 2 and speed["max_tokens"] == 4 and speed["dtype"] in ("float32", "bfloat16")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["weights", "--model", "m", "--decode-tokens", "-1"], "--decode-tokens must be 0 or more"),
        (["weights", "--model", "m", "--rounds", "0"], "--rounds needs positive"),
        (["serving", "--concurrency", "0"], "--concurrency needs positive"),
        (["serving", "--threads", "0"], "--threads needs a positive"),
    ],
)
def test_bench_weights_and_serving_refuse_bad_counts_with_exit_2(argv, message):
    from tessera.cli import build_parser
    from tessera.cli.common import CliError

    args = build_parser().parse_args(["bench", *argv])
    with pytest.raises(CliError, match=message) as error:
        args.func(args)
    assert error.value.exit_code == 2
