"""What a checkpoint folder declares: ``config.json`` as a ModelConfig, and the error a bad folder raises.

Torch-free, so the gateway can read a checkpoint's limits and stop tokens without importing torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_workers.gguf_file import GGUFError, is_gguf, open_gguf


class ModelLoadError(ValueError):
    """A checkpoint folder that cannot be loaded: what is wrong, where, and what was expected."""


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# MoE with a sigmoid router, shared experts and dense first layers (DeepSeek-V3 / Kimi K2, GLM-4.5).
_DEEPSEEK_MOE = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
# YaRN frequencies are computed only by these models' rotary code (``model.deepseek_v3.yarn_*``).
_YARN_ARCHITECTURES = _DEEPSEEK_MOE
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# HF's default theta when config.json names none (Mixtral's differs from the rest).
_DEFAULT_ROPE_THETA = {"MixtralForCausalLM": 1e6}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base ``theta`` and an optional frequency rescaling (``linear`` or ``llama3``)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (``type="yarn"``): ramp bounds, attention-scale correction, and whether the ramp is truncated.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-style MoE (DeepSeek-V3, Kimi K2, GLM-4.5): a sigmoid router with a correction bias and
    group-limited top-k, routed experts of ``intermediate_size``, shared experts, and dense MLPs in the
    first ``first_k_dense_replace`` layers."""

    intermediate_size: int
    num_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): q through an optional LoRA, K/V compressed to a
    ``kv_lora_rank`` latent plus one shared ``qk_rope_head_dim`` rope key per token."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only checkpoint's shape and features, normalised across architectures."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # one entry per layer; None means full causal attention
    num_experts: int = 0
    num_experts_per_tok: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None  # the dtype the checkpoint was saved in
    moe: MoEConfig | None = None  # DeepSeek-style MoE (see MoEConfig); Mixtral uses num_experts alone
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V3)
    partial_rotary_factor: float = 1.0  # share of each head's dims that RoPE rotates (GLM)
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers stored after the decoder's (skipped)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` when present) from a checkpoint folder, or
        the hyperparameters of a GGUF file."""
        path = Path(path)
        if is_gguf(path):
            return cls.from_dict(gguf_config(path))
        if not path.is_dir():
            raise ModelLoadError(
                f"model path {path} is neither a checkpoint folder nor a GGUF file; pass a folder with "
                "config.json and *.safetensors, or a .gguf file"
            )
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(
                f"{path} has no config.json; a checkpoint folder needs the Hugging Face config.json "
                "next to its *.safetensors files"
            )
        generation_file = path / "generation_config.json"
        generation = read_json(generation_file) if generation_file.is_file() else {}
        return cls.from_dict(read_json(config_file), generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Normalise a parsed ``config.json``; ``generation`` may add end-of-sequence tokens."""
        generation = generation or {}
        architecture = _architecture(raw)
        num_layers = required(raw, "num_hidden_layers")
        num_heads = required(raw, "num_attention_heads")
        hidden_size = required(raw, "hidden_size")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(
                f"hidden_act {raw['hidden_act']!r} in config.json is not supported; expected 'silu'"
            )
        attention_bias = bool(raw.get("attention_bias", False))
        moe = architecture in ("MixtralForCausalLM", *_DEEPSEEK_MOE)
        extra = _deepseek_fields(architecture, raw)
        eos = token_id_list(raw.get("eos_token_id")) + token_id_list(generation.get("eos_token_id"))
        bos = raw.get("bos_token_id")
        bos = generation.get("bos_token_id") if bos is None else bos
        return cls(
            architecture=architecture,
            vocab_size=required(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=required(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            # MLA's attention heads are qk_nope + qk_rope wide (its config.json's head_dim is the rope part).
            head_dim=(extra["mla"].qk_nope_head_dim + extra["mla"].qk_rope_head_dim)
            if "mla" in extra
            else raw.get("head_dim") or hidden_size // num_heads,
            max_position_embeddings=required(raw, "max_position_embeddings"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw, _DEFAULT_ROPE_THETA.get(architecture, 10000.0), architecture),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and never an o_proj bias, whatever attention_bias says.
            qkv_bias=architecture == "Qwen2ForCausalLM"
            or (attention_bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM", *_DEEPSEEK_MOE)),
            o_bias=attention_bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM"
            or (architecture == "Glm4MoeForCausalLM" and bool(raw.get("use_qk_norm", False))),
            sliding_windows=_sliding_windows(architecture, raw, num_layers),
            num_experts=raw.get("num_local_experts", raw.get("n_routed_experts", 0)) if moe else 0,
            num_experts_per_tok=raw.get("num_experts_per_tok", 0) if moe else 0,
            eos_token_ids=list(dict.fromkeys(eos)),
            bos_token_id=bos,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            **extra,
        )


def gguf_config(path: str | Path) -> dict[str, Any]:
    """A GGUF file's hyperparameters as a ``config.json`` dict (``gguf_file.GGUFFile.hf_config``), with
    llama.cpp's stored Llama 3 rope frequencies turned back into the ``rope_scaling`` they came from."""
    try:
        gguf = open_gguf(path)
        raw = gguf.hf_config()
        freqs = gguf.rope_freqs()
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
    if freqs is not None:
        raw["rope_scaling"] = _llama3_scaling(raw, freqs, Path(path).name)
    return raw


def _llama3_scaling(raw: dict[str, Any], freqs: Any, name: str) -> dict[str, Any]:
    """The Llama 3 ``rope_scaling`` whose frequency divisors are ``freqs`` (llama.cpp stores the divisors,
    not the parameters): its factor is the largest divisor; the rest are Llama 3.1's published values,
    checked by recomputing every divisor."""
    factor, low, high = float(max(freqs)), 1.0, 4.0
    original = int(raw.get("rope_scaling", {}).get("original_max_position_embeddings", 8192))
    head_dim = raw["head_dim"]
    expected = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * raw["rope_theta"] ** (i / head_dim)
        if wavelength < original / high:
            expected.append(1.0)
        elif wavelength > original / low:
            expected.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if len(expected) != len(freqs) or any(
        abs(a - b) > 1e-3 * b for a, b in zip(expected, freqs, strict=False)
    ):
        raise ModelLoadError(
            f"{name} stores rope frequency factors (rope_freqs) that are not Llama 3's scaling with factor "
            f"{factor:g}, low 1, high 4 and original context {original}; this rope scaling is not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    if not names:
        raise ModelLoadError(
            f"config.json has no 'architectures' entry; expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if names[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {names[0]!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return names[0]


def required(raw: dict[str, Any], key: str) -> int:
    """``config.json``'s integer ``key``; ModelLoadError when it is missing."""
    if raw.get(key) is None:
        raise ModelLoadError(f"config.json has no {key!r}; the model's shape cannot be known without it")
    return int(raw[key])


def token_id_list(value: int | list[int] | None) -> list[int]:
    """A ``*_token_id`` field of a HF config, which may be an id, a list of ids or null, as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _deepseek_fields(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's ``moe``/``mla``/partial-rotary fields of DeepSeek-V3 and GLM-4.5 MoE configs."""
    if architecture not in _DEEPSEEK_MOE:
        return {}
    n_group = int(raw.get("n_group") or 1)
    num_experts = int(raw.get("n_routed_experts") or 0)
    if num_experts % n_group:
        raise ModelLoadError(
            f"n_routed_experts {num_experts} in config.json is not a multiple of n_group {n_group}"
        )
    moe = MoEConfig(
        intermediate_size=required(raw, "moe_intermediate_size"),
        num_shared_experts=int(raw.get("n_shared_experts") or 0),
        n_group=n_group,
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
    )
    fields: dict[str, Any] = {
        "moe": moe,
        "num_nextn_predict_layers": int(
            raw.get("num_nextn_predict_layers") or raw.get("num_mtp_layers") or 0
        ),
    }
    if architecture == "DeepseekV3ForCausalLM":
        fields["mla"] = MLAConfig(
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=required(raw, "kv_lora_rank"),
            qk_nope_head_dim=required(raw, "qk_nope_head_dim"),
            qk_rope_head_dim=required(raw, "qk_rope_head_dim"),
            v_head_dim=required(raw, "v_head_dim"),
            rope_interleave=bool(raw.get("rope_interleave", True)),
        )
    else:
        params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
        fields["partial_rotary_factor"] = float(
            params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        )
    return fields


def _rope(raw: dict[str, Any], default_theta: float, architecture: str = "") -> RopeConfig:
    # transformers 5 writes one ``rope_parameters`` dict; older configs (most checkpoints in the wild)
    # have a top-level ``rope_theta`` and an optional ``rope_scaling`` that spells its kind ``type``.
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    supported = ROPE_TYPES if architecture in _YARN_ARCHITECTURES else ROPE_TYPES[:3]
    if rope_type not in supported:
        raise ModelLoadError(
            f"rope type {rope_type!r} in config.json is not supported; supported: {', '.join(supported)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise ModelLoadError(f"rope type {rope_type!r} in config.json needs a 'factor'")
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=float(params["factor"]))
    if rope_type == "yarn":
        optional = {
            k: float(params[k]) for k in ("mscale", "mscale_all_dim", "attention_factor") if params.get(k)
        }
        return RopeConfig(
            theta=theta,
            type="yarn",
            factor=float(params["factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
            ),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            **optional,
        )
    return RopeConfig(
        theta=theta,
        type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def _sliding_windows(architecture: str, raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window") or None
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window,) * num_layers
    if architecture in _QWEN and raw.get("use_sliding_window") and window:
        # Qwen slides only in the layers from max_window_layers on, unless layer_types says otherwise.
        first = raw.get("max_window_layers", 28)
        types = raw.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (None,) * num_layers
