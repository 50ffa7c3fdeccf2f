"""The checkpoint loader: sharded weights, dtype casting, config parsing, and errors a user can act on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_workers.checkpoint import ModelConfig, ModelLoadError
from gpu_workers.kv import KVSpec
from gpu_workers.model import load_model
from tests.hf_models import Checkpoint, random_tokens, run_paged, save_tiny

PROMPT = random_tokens(10, seed=3)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Checkpoint:
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture
def checkpoint(pristine: Checkpoint, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may break."""
    return Path(shutil.copytree(pristine.path, tmp_path / "ckpt"))


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path: Path, edit) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors")


def test_sharded_checkpoint_loads_and_matches_hf(tmp_path):
    checkpoint = save_tiny("mixtral", tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path, progress=True)
    [logits] = run_paged(model, [PROMPT], [[(0, len(PROMPT))]])
    assert (logits - checkpoint.hf_logits(PROMPT)).abs().max() <= 1e-4


def test_missing_shard_is_named(tmp_path):
    save_tiny("llama", tmp_path, max_shard_size="40KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"names shard {victim.name}, which is missing"):
        load_model(tmp_path)


def test_model_has_contract_attributes_and_casts_to_dtype(checkpoint):
    model = load_model(checkpoint, dtype=torch.bfloat16)
    assert not model.training
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    assert model.kv_spec == KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
    config = model.config
    assert (config.architecture, config.vocab_size, config.hidden_size) == ("LlamaForCausalLM", 128, 32)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 8)
    assert config.max_position_embeddings == 256
    hidden = torch.zeros(3, config.hidden_size, dtype=torch.bfloat16)
    assert model.compute_logits(hidden).dtype == torch.float32


def test_unknown_architecture_is_named_with_supported_list(checkpoint):
    edit_config(checkpoint, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="'GPT2LMHeadModel' is not supported") as err:
        load_model(checkpoint)
    assert "LlamaForCausalLM" in str(err.value) and "MixtralForCausalLM" in str(err.value)


def test_missing_tensor_is_named_as_on_disk(checkpoint):
    edit_weights(checkpoint, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(checkpoint)


def test_shape_mismatch_names_tensor_and_both_shapes(checkpoint):
    edit_weights(checkpoint, lambda w: w.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight .* has shape \[31\], expected \[32\]"):
        load_model(checkpoint)


def test_weights_the_config_does_not_declare_are_rejected(checkpoint):
    # attention_bias=false while the checkpoint has biases: ignoring them would silently corrupt outputs.
    edit_config(checkpoint, attention_bias=False)
    with pytest.raises(
        ModelLoadError, match=r"self_attn\.[qkvo]_proj\.bias .* config and the weights disagree"
    ):
        load_model(checkpoint)


def test_stored_rotary_tables_are_ignored(checkpoint):
    edit_weights(
        checkpoint, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    )
    load_model(checkpoint)


def test_missing_config_says_what_is_needed(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(checkpoint)


def test_missing_weights_say_what_is_needed(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="no model.safetensors .*pytorch_model.bin is not supported"):
        load_model(checkpoint)


def test_unsupported_rope_type_is_named(checkpoint):
    edit_config(checkpoint, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope type 'yarn' .* supported: default, linear, llama3"):
        load_model(checkpoint)


def test_eos_ids_merge_config_and_generation_config(checkpoint):
    edit_config(checkpoint, eos_token_id=2, bos_token_id=1)
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    config = ModelConfig.from_pretrained(checkpoint)
    assert config.eos_token_ids == [2, 7, 9]
    assert config.bos_token_id == 1


def test_config_without_eos_has_empty_eos_list(checkpoint):
    edit_config(checkpoint, eos_token_id=None)
    (checkpoint / "generation_config.json").unlink()
    assert ModelConfig.from_pretrained(checkpoint).eos_token_ids == []


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_loading_a_model_does_not_import_torch_dynamo(arch, tmp_path):
    """Building the model on the meta device skips torch's initialisers: their meta versions would import
    torch._dynamo (~1.3 s of every worker's start). A fresh interpreter loads the checkpoint and says."""
    save_tiny(arch, tmp_path / arch)
    script = (
        "import sys; from gpu_workers.model import load_model; "
        f"m = load_model({str(tmp_path / arch)!r}, dtype=__import__('torch').bfloat16); "
        "assert next(m.parameters()).abs().sum() > 0; print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
