"""Tiny GGUF files written with llama.cpp's own ``gguf`` writer, as its converter would write them.

A random HF model (tests.hf_models' wide weights) goes into a GGUF with every linear weight in one GGML
type, norms in F32, llama's q/k rows permuted as llama.cpp permutes them, and a byte-level BPE tokenizer
with control tokens and a ChatML template, so both the loader and the tokenizer are exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from gpu_workers.tokenizer import train_byte_level_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# 64 wide, so every linear's input is whole 32-weight blocks; heads of 16.
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
ARCHES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tiny_tokenizer():
    """A 320-token byte-level BPE over some English, its first ids the control tokens."""
    text = (Path(json.__file__).parent / "decoder.py").read_text()
    return train_byte_level_bpe([text] * 4, 320, SPECIALS)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf.LlamaModel.permute: HF's rotate-halves rows to interleaved pairs.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path, arch: str, ggml_type: str, seed: int = 0, tie: bool = False
) -> transformers.PreTrainedModel:
    """A random ``arch`` model written to ``path`` with its linear weights in ``ggml_type``; returns the HF
    model it was written from (its weights before the GGUF's rounding)."""
    tokenizer = tiny_tokenizer()
    vocab = tokenizer.get_vocab_size()
    torch.manual_seed(seed)
    config = ARCHES[arch](**SHAPE, vocab_size=vocab, tie_word_embeddings=tie, rope_theta=10000.0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_context_length(SHAPE["max_position_embeddings"])
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(SHAPE["num_attention_heads"])
    writer.add_head_count_kv(SHAPE["num_key_value_heads"])
    writer.add_key_length(SHAPE["head_dim"])
    writer.add_value_length(SHAPE["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = [tokenizer.id_to_token(i) for i in range(vocab)]
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.token_to_id("<|im_start|>"))
    writer.add_eos_token_id(tokenizer.token_to_id("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    qtype = GGMLQuantizationType[ggml_type]
    for name, p in hf_model.state_dict().items():
        if tie and name == "lm_head.weight":
            continue
        data = p.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = _llama_cpp_permute(data, SHAPE["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            data = _llama_cpp_permute(data, SHAPE["num_key_value_heads"])
        if (
            data.ndim == 1 or qtype == GGMLQuantizationType.F32
        ):  # norms and biases stay F32, as llama.cpp keeps them
            writer.add_tensor(gguf_name(name), data)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name), data.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_model
