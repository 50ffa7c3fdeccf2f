"""GGUF checkpoints (llama.cpp's one-file format), read with llama.cpp's own ``gguf`` package.

What a file declares, as Hugging Face names it: the config (``hf_config``: a config.json dict), the
tokenizer's parts and chat template (``metadata``), and each tensor under its HF name with its GGML type
(``tensors``). Torch-free (numpy only), so the gateway reads a GGUF's tokenizer and limits without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

# GGUF's ``general.architecture`` -> the HF architecture it is served as. llama.cpp writes Mistral's dense
# models (7B, Nemo) and SmolLM2 as "llama".
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp's converter permutes these architectures' q/k rows for its interleaved rotary (GPT-J style);
# HF's rotary rotates halves (GPT-NeoX style), so loading undoes it. Qwen's rows are stored as in HF.
PERMUTED_QK = ("llama",)
_MAGIC = b"GGUF"

# Per-layer tensors: GGUF's name after ``blk.N.`` -> the HF module name after ``model.layers.N.``.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Derivable tables some converters store: llama.cpp's Llama 3 rope frequency factors (checked against the
# config by ``checkpoint``) and rotary caches.
DERIVED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GGUFError(ValueError):
    """A GGUF file that cannot be served: what is wrong and what was expected."""


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes, whatever its name)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == _MAGIC


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file under its HF name: its GGML type name (``F32``, ``Q4_1``...), its shape
    as torch orders it ([out, in] for a linear's weight), and its bytes as the file stores them (a
    read-only view of the memory-mapped file: [rows, bytes per row] for block-quantised types)."""

    name: str
    gguf_name: str
    type: str
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """A GGUF file's metadata (every key but the tokenizer's large arrays parsed on demand) and tensors."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self._reader = GGUFReader(self.path, "r")
        except (ValueError, OSError) as e:
            raise GGUFError(f"{self.path} is not a readable GGUF file: {e}") from None
        self._fields = self._reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value.tolist() if isinstance(value, np.ndarray) else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path.name} has no {key!r}; the model's shape cannot be known without it")
        return value

    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFError(
                f"GGUF architecture {arch!r} in {self.path.name} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)}"
            )
        return arch

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self._reader.tensors}

    def tensors(self) -> list[GGUFTensor]:
        """Every tensor under its HF name, in file order; raises GGUFError for a name with no HF place."""
        out = []
        for t in self._reader.tensors:
            if t.name in DERIVED_TENSORS:
                continue
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            out.append(GGUFTensor(hf_name(t.name, self.path), t.name, t.tensor_type.name, shape, t.data))
        return out

    def hf_config(self) -> dict[str, Any]:
        """The file's hyperparameters as a Hugging Face ``config.json`` dict."""
        arch = self.architecture
        p = f"{arch}."
        num_heads = int(self.require(p + "attention.head_count"))
        hidden = int(self.require(p + "embedding_length"))
        names = self.tensor_names
        vocab = self.get(p + "vocab_size")
        if vocab is None:
            vocab = len(self._fields["tokenizer.ggml.tokens"].data)
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[arch]],
            "model_type": arch,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self.require(p + "feed_forward_length")),
            "num_hidden_layers": int(self.require(p + "block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self.get(p + "attention.head_count_kv", num_heads)),
            "head_dim": int(self.get(p + "attention.key_length", hidden // num_heads)),
            "max_position_embeddings": int(self.require(p + "context_length")),
            "rms_norm_eps": float(self.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.get(p + "rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "hidden_act": "silu",
        }
        scaling = self.get(p + "rope.scaling.type")
        if scaling not in (None, "none"):
            config["rope_scaling"] = {
                "rope_type": scaling,
                "factor": float(self.get(p + "rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": int(
                    self.get(p + "rope.scaling.original_context_length", config["max_position_embeddings"])
                ),
            }
        for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
            value = self.get(f"tokenizer.ggml.{key}")
            if value is not None:
                config[hf_key] = int(value)
        # Llama 3's instruct models end a turn with <|eot_id|>, which GGUF names apart from EOS.
        eot = self.get("tokenizer.ggml.eot_token_id")
        if eot is not None and eot != config.get("eos_token_id"):
            config["eos_token_id"] = [x for x in (config.get("eos_token_id"), int(eot)) if x is not None]
        return config

    def rope_freqs(self) -> np.ndarray | None:
        """llama.cpp's per-frequency rope divisors (Llama 3.1+), when the file stores them."""
        for t in self._reader.tensors:
            if t.name == "rope_freqs.weight":
                return np.asarray(t.data, dtype=np.float32)
        return None

    def vocabulary(self) -> tuple[list[str], list[int], list[str]]:
        """Tokens, their GGML token types (1 normal, 3 control, 4 user-defined...) and BPE merges."""
        tokens = self.require("tokenizer.ggml.tokens")
        types = self.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = self.get("tokenizer.ggml.merges") or []
        return tokens, types, merges


@lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file at ``path``, shared by its config, tokenizer and weights in one process (parsing a
    50k-token vocabulary's metadata takes seconds)."""
    path = Path(path).resolve()
    return _open(str(path), path.stat().st_mtime_ns)


def hf_name(gguf_name: str, path: Path | None = None) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    where = f" in {path.name}" if path else ""
    raise GGUFError(f"tensor {gguf_name!r}{where} has no place in the supported architectures' models")
