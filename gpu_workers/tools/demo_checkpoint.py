"""A tiny random-init checkpoint in Hugging Face layout, so the pipeline can be tried before a trained model exists.

Its weights are random: generation runs end to end, but the text is gibberish.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from gpu_workers.tokenizer import train_byte_level_bpe

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
# Fixed, sorted so the tokenizer is the same on every machine running the same Python version.
STDLIB_TRAINING_FILES = [
    "argparse.py",
    "collections/__init__.py",
    "dataclasses.py",
    "functools.py",
    "heapq.py",
    "json/encoder.py",
    "string.py",
    "textwrap.py",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Per architecture: the class name and the extra tensors its attention layer carries.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", ()),
    "mistral": ("MistralForCausalLM", ()),
    "qwen2": ("Qwen2ForCausalLM", ("q_proj.bias", "k_proj.bias", "v_proj.bias")),
    "qwen3": ("Qwen3ForCausalLM", ("q_norm.weight", "k_norm.weight")),
}


def write_demo_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    hidden_size: int = 256,
    intermediate_size: int = 768,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int = 2048,
    max_position_embeddings: int = 2048,
    with_tokenizer: bool = True,
) -> list[Path]:
    """Write config.json, model.safetensors and (optionally) tokenizer files to ``out_dir``; return their paths."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(
            "hidden_size must be divisible by num_attention_heads, and num_attention_heads by num_key_value_heads"
        )
    if with_tokenizer and vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + special tokens)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [ARCHITECTURES[arch][0]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": hidden_size // num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
    }
    written = [out / "config.json", out / "model.safetensors"]
    written[0].write_text(json.dumps(config, indent=2) + "\n")
    save_file(_random_weights(config, ARCHITECTURES[arch][1], seed), written[1], metadata={"format": "pt"})
    if with_tokenizer:
        written += _write_tokenizer(out, vocab_size)
    return written


def _random_weights(config: dict, attn_extras: tuple[str, ...], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    extra_shapes = {"q_proj.bias": (q_dim,), "k_proj.bias": (kv_dim,), "v_proj.bias": (kv_dim,)}
    weights = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(q_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, q_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
        for name in attn_extras:
            # Norm weights start at one like a freshly initialised model; biases are random like the weights.
            shape = extra_shapes.get(name)
            weights[p + "self_attn." + name] = normal(*shape) if shape else torch.ones(head_dim)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden)
    return weights


def _write_tokenizer(out: Path, vocab_size: int) -> list[Path]:
    tokenizer = train_stdlib_tokenizer(vocab_size)
    tokenizer_path, config_path = out / "tokenizer.json", out / "tokenizer_config.json"
    tokenizer.save(str(tokenizer_path))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return [tokenizer_path, config_path]


def train_stdlib_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on a few standard-library modules (text every Python install ships with)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        (stdlib / name).read_text(encoding="utf-8")
        for name in STDLIB_TRAINING_FILES
        if (stdlib / name).exists()
    ]
    if not texts:
        raise FileNotFoundError(
            f"none of {STDLIB_TRAINING_FILES} found under {stdlib}; is the stdlib installed?"
        )
    return train_byte_level_bpe(texts, vocab_size, SPECIAL_TOKENS)
