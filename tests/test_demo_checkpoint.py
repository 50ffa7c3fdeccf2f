"""The demo checkpoint is a valid Hugging Face checkpoint: transformers loads every tensor, nothing left over."""

import json

import pytest
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gpu_workers.tools.demo_checkpoint import BOS_ID, EOS_ID, write_demo_checkpoint


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_transformers_loads_every_tensor_of_the_demo_checkpoint(tmp_path, arch):
    import transformers  # a test dependency, imported here because it is slow to import

    write_demo_checkpoint(tmp_path, arch=arch, with_tokenizer=False)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(model).__name__ == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_same_seed_gives_same_weights_and_other_seed_differs(tmp_path):
    a, b, c = (
        load_file(write_demo_checkpoint(tmp_path / n, seed=s)[1]) for n, s in [("a", 0), ("b", 0), ("c", 1)]
    )
    name = "model.layers.0.self_attn.q_proj.weight"
    assert a[name].equal(b[name]) and not a[name].equal(c[name])
    assert 0.015 < a[name].std().item() < 0.025


def test_tokenizer_round_trips_code_and_prepends_bos(tmp_path):
    write_demo_checkpoint(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # é 漢"
    ids = tok.encode(text).ids
    assert ids[0] == BOS_ID and tok.decode(ids) == text
    assert tok.id_to_token(EOS_ID) == "<|eos|>"
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "messages" in config["chat_template"]


def test_checkpoint_without_tokenizer_has_no_tokenizer_files(tmp_path):
    written = write_demo_checkpoint(tmp_path, with_tokenizer=False)
    assert sorted(p.name for p in written) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "tokenizer.json").exists()


def test_unknown_arch_is_rejected_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match="llama"):
        write_demo_checkpoint(tmp_path, arch="gpt2")
