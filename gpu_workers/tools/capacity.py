"""How many tokens of KV cache fit in accelerator memory next to a model's weights, per KV and weight format.

A model is a list of (tensor name, shape) in Hugging Face naming: read from a checkpoint's safetensors
headers, or generated from a published config.json (``NAMED_CONFIGS``). Weight bytes per format:
- ``bf16``: 2 bytes per element.
- ``fp8``: linear weights 1 byte per element plus one fp32 scale per output channel.
- ``int4``: linear weights packed two per byte, groups of 128 along the input dimension, each group with
  a bf16 scale and a bf16 zero point.
Embeddings, lm_head, norms, biases and MoE routers stay bf16 in every format.

KV bytes per token (``KVEntry``) come from the cache entry the engine allocates with: the model class's
own declaration (``cache_entry(config)``, a ``kv.KVSpec``) priced by ``KVSpec.page_bytes``, the KV cache's
own arithmetic. MHA/GQA caches K and V per KV head; MLA (DeepSeek-V3, Kimi K2) one latent vector plus the
rope part of the key per layer, in one tensor. ``fp8_e4m3`` costs 1 byte per element plus an fp32 scale
per stored tensor per (layer, page): K and V, or the latent's one; ``int8`` 1 byte per element plus a bf16
scale per entry (per token, layer, stored tensor and KV head). GLM-5 (``GlmMoeDsaForCausalLM``), which
the engine does not serve yet, is planned with a declared latent + rope + DSA indexer key entry.

Tensor parallelism over N GPUs: weights split evenly; KV heads split over GPUs up to the number of KV
heads (each GPU holds ``ceil(kv_heads / N)`` heads); MLA's single latent is replicated on every GPU. All
GPUs hold the same tokens, so the deployment's token capacity is one GPU's free memory over one GPU's
bytes per token. Not modelled: activations, CUDA graphs and allocator workspace (use ``reserve_gib``),
speculative-decoding (MTP) layers, vision towers, and sliding-window layers (cached in full here).
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gpu_workers.checkpoint import ModelConfig
from gpu_workers.formats.fp8 import FP8_DTYPE
from gpu_workers.kv import KVSpec
from gpu_workers.model.loader import MODEL_CLASSES
from gpu_workers.quant.config import QuantConfig

GIB = 2**30
KV_FORMATS = ("bf16", "int8", "fp8_e4m3")
# what the engine's KVCache stores
KV_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": FP8_DTYPE}
WEIGHT_FORMATS = ("bf16", "fp8", "int4")
INT4_GROUP = 128

# Published shapes (config.json of each model's official Hugging Face repository). Only the fields the
# memory model reads are kept.
NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B
    "Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-32B
    "Qwen3-32B": {
        "architectures": ["Qwen3ForCausalLM"],
        "max_position_embeddings": 40960,
        "vocab_size": 151936,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    # mistralai/Mixtral-8x7B-v0.1
    "Mixtral-8x7B": {
        "architectures": ["MixtralForCausalLM"],
        "max_position_embeddings": 32768,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "tie_word_embeddings": False,
    },
    # deepseek-ai/DeepSeek-V3 (main model; the checkpoint's extra MTP layer is not counted)
    "DeepSeek-V3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "max_position_embeddings": 163840,
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "tie_word_embeddings": False,
    },
    # moonshotai/Kimi-K2-Instruct; Kimi K2.5/K2.6 share this text backbone (their text_config)
    "Kimi-K2": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "max_position_embeddings": 131072,
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 1,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_attention_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "tie_word_embeddings": False,
    },
    # zai-org/GLM-5 (transformers' GlmMoeDsaConfig defaults): MLA plus a DSA indexer with its own key cache
    "GLM-5": {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "max_position_embeddings": 202752,
        "vocab_size": 154880,
        "hidden_size": 6144,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 78,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_attention_heads": 64,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True)
class KVEntry:
    """One token's cache entry: the ``KVSpec`` the engine allocates with, and what it holds, for people.

    ``served``: False for an architecture the engine does not serve yet, whose entry is declared here.
    ``rope_bf16``: MLA's other FP8 layout, the rope key kept in bf16 (``kv_rope_bf16`` on the model).
    """

    spec: KVSpec
    detail: str = ""
    served: bool = True
    rope_bf16: KVSpec | None = None

    @property
    def kind(self) -> str:
        return "mla" if self.spec.v_is_k else "gqa"

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def elements_per_layer(self) -> int:
        return self.spec.tensors * self.spec.num_kv_heads * self.spec.head_dim

    @property
    def shards(self) -> int:
        """How many ways tensor parallelism can split the entry: its KV heads (1 for MLA's latent)."""
        return self.spec.num_kv_heads

    def bytes_per_token(self, kv_format: str, gpus: int = 1, page_size: int = 16) -> float:
        """Bytes one token costs on one GPU of a ``gpus``-way tensor-parallel deployment: one page of
        the GPU's share of the KV heads (``KVSpec.page_bytes``, what ``KVCache`` allocates) per token."""
        if kv_format not in KV_FORMATS:
            raise ValueError(f"KV format must be one of {', '.join(KV_FORMATS)}, got {kv_format!r}")
        return _per_gpu_bytes(self.spec, KV_DTYPES[kv_format], gpus, page_size)

    def rope_bf16_bytes_per_token(self, gpus: int = 1, page_size: int = 16) -> float | None:
        """FP8 bytes per token of the rope-in-bf16 MLA layout; None for entries without one."""
        if self.rope_bf16 is None:
            return None
        return _per_gpu_bytes(self.rope_bf16, FP8_DTYPE, gpus, page_size)

    def summary(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_layers": self.num_layers,
            "elements_per_layer": self.elements_per_layer,
            "detail": self.detail,
            "served": self.served,
            "spec": asdict(self.spec),
            "fp8_e4m3_rope_bf16_bytes_per_token": self.rope_bf16_bytes_per_token(),
        }


def _per_gpu_bytes(spec: KVSpec, dtype: torch.dtype, gpus: int, page_size: int) -> float:
    per_gpu = replace(spec, num_kv_heads=_ceil_div(spec.num_kv_heads, gpus))
    return per_gpu.page_bytes(page_size, dtype) / page_size


@dataclass(frozen=True)
class ModelShapes:
    name: str
    tensors: dict[str, tuple[int, ...]]
    kv: KVEntry

    @property
    def num_params(self) -> int:
        return sum(_numel(shape) for shape in self.tensors.values())

    @property
    def has_routed_experts(self) -> bool:
        return any(is_quantizable(name, shape, "routed-experts") for name, shape in self.tensors.items())

    def weight_bytes(self, weight_format: str, only: str = "all") -> int:
        """Bytes of the weights in ``weight_format``, the linear layers ``only`` selects converted (what
        ``tessera quantize --only`` writes), every other tensor in bf16."""
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}"
            )
        return sum(_tensor_bytes(name, shape, weight_format, only) for name, shape in self.tensors.items())


@dataclass(frozen=True)
class CapacityRow:
    weight_format: str
    kv_format: str
    weight_gib_per_gpu: float
    free_gib_per_gpu: float  # negative: how far the weights and the reserve exceed the memory
    kv_bytes_per_token_per_gpu: float
    tokens: int  # KV tokens the whole deployment holds at once
    fits: bool  # the weights leave room for at least one token of KV cache
    page_size: int = 16  # KV page size the scales are counted for


def capacity(
    model: ModelShapes, memory_gib: float, gpus: int = 1, reserve_gib: float = 0.0, page_size: int = 16
) -> list[CapacityRow]:
    """Tokens that fit per (weight format, KV format) with ``memory_gib`` per GPU on ``gpus`` GPUs."""
    if gpus < 1 or memory_gib <= 0 or reserve_gib < 0:
        raise ValueError("need gpus >= 1, memory_gib > 0 and reserve_gib >= 0")
    rows = []
    for weight_format in WEIGHT_FORMATS:
        weights = model.weight_bytes(weight_format) / gpus
        free = memory_gib * GIB - reserve_gib * GIB - weights
        for kv_format in KV_FORMATS:
            per_token = model.kv.bytes_per_token(kv_format, gpus, page_size)
            tokens = max(0, int(free // per_token))
            rows.append(
                CapacityRow(
                    weight_format,
                    kv_format,
                    weights / GIB,
                    free / GIB,
                    per_token,
                    tokens,
                    tokens > 0,
                    page_size,
                )
            )
    return rows


def does_not_fit(
    model: ModelShapes, rows: list[CapacityRow], memory_gib: float, gpus: int, reserve_gib: float = 0.0
) -> str | None:
    """Why no weight format fits (the smallest one's need), or None when at least one does."""
    if any(row.fits for row in rows):
        return None
    smallest = min(rows, key=lambda row: row.weight_gib_per_gpu)
    reserve = f" plus {reserve_gib:g} GiB reserved" if reserve_gib else ""
    return (
        f"{model.name} does not fit in {gpus} GPU(s) x {memory_gib:g} GiB in any weight format: the "
        f"smallest, {smallest.weight_format}, needs "
        f"{smallest.weight_gib_per_gpu:.1f} GiB per GPU{reserve} and leaves no room for KV cache; "
        "give it more GPUs (--gpus) or more memory (--memory-gib)"
    )


def named_model(name: str) -> ModelShapes:
    """A model of ``NAMED_CONFIGS`` by name (case-insensitive)."""
    for known, config in NAMED_CONFIGS.items():
        if known.lower() == name.lower():
            return ModelShapes(known, hf_tensor_shapes(config), kv_entry(config))
    raise ValueError(f"unknown model config {name!r}; known: {', '.join(NAMED_CONFIGS)}")


def checkpoint_model(path: str | Path) -> ModelShapes:
    """Shapes of a checkpoint folder: config.json for the KV layout, safetensors headers for the tensors."""
    from gpu_workers.checkpoint import read_json
    from gpu_workers.model.loader import safetensors_files

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; pass a Hugging Face checkpoint folder")
    config = read_json(path / "config.json")
    tensors: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(path):
        for name, shape in _safetensors_shapes(file).items():
            # A checkpoint's own quantisation scales and zeros are replaced by the target format's; packed
            # int4 weights ([out, in/2] bytes) count as the [out, in] weight they hold.
            if name.endswith("_packed"):
                tensors[name.removesuffix("_packed")] = (*shape[:-1], shape[-1] * 2)
            elif not name.endswith(("_scale_inv", "_scale", "_zero")):
                tensors[name] = shape
    return ModelShapes(path.name, tensors, kv_entry(config))


def _safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def kv_entry(config: dict[str, Any]) -> KVEntry:
    """What one token's cache entry is for a config.json: the model class's own declaration."""
    architecture = (config.get("architectures") or [""])[0]
    if architecture == "GlmMoeDsaForCausalLM":
        return _planned_dsa_entry(config)
    model_config = ModelConfig.from_dict(config)  # ModelLoadError (a ValueError) names what is wrong
    model_class = MODEL_CLASSES[architecture]
    spec = model_class.cache_entry(model_config)
    if model_config.mla is None:
        return KVEntry(spec, f"K and V x {spec.num_kv_heads} KV heads x {spec.head_dim}")
    detail = f"latent {model_config.mla.kv_lora_rank} + rope key {model_config.mla.qk_rope_head_dim}"
    return KVEntry(spec, detail, rope_bf16=model_class.cache_entry(model_config, rope_bf16=True))


def _planned_dsa_entry(config: dict[str, Any]) -> KVEntry:
    """GLM-5's entry, declared here until the engine serves it: MLA's latent and rope key plus the DSA
    indexer's key, one tensor per layer."""
    parts = {
        "latent": config["kv_lora_rank"],
        "rope key": config["qk_rope_head_dim"],
        "indexer key": config["index_head_dim"],
    }
    detail = " + ".join(f"{name} {n}" for name, n in parts.items()) + " (not served yet)"
    spec = KVSpec(int(config["num_hidden_layers"]), 1, sum(parts.values()), v_is_k=True)
    return KVEntry(spec, detail, served=False)


def hf_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight of a decoder from its config.json, named as in the model's Hugging Face checkpoint."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = (hidden,)
        tensors[p + "post_attention_layernorm.weight"] = (hidden,)
        attention = _mla_attention if config.get("kv_lora_rank") else _gqa_attention
        tensors.update({p + "self_attn." + k: v for k, v in attention(config).items()})
        tensors.update({p + k: v for k, v in _feed_forward(config, i).items()})
    tensors["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = (vocab, hidden)
    return tensors


def _gqa_attention(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    architecture = config["architectures"][0]
    sizes = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
    tensors = {f"{name}.weight": (size, hidden) for name, size in sizes.items()}
    tensors["o_proj.weight"] = (hidden, heads * head_dim)
    # Qwen2 always has q/k/v biases; attention_bias adds them (and o_proj's) elsewhere.
    if architecture == "Qwen2ForCausalLM" or config.get("attention_bias"):
        tensors.update({f"{name}.bias": (size,) for name, size in sizes.items()})
    if config.get("attention_bias") and architecture != "Qwen2ForCausalLM":
        tensors["o_proj.bias"] = (hidden,)
    if architecture == "Qwen3ForCausalLM":
        tensors.update({"q_norm.weight": (head_dim,), "k_norm.weight": (head_dim,)})
    return tensors


def _mla_attention(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_lora, kv_lora = config.get("q_lora_rank"), config["kv_lora_rank"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    tensors: dict[str, tuple[int, ...]] = {}
    if q_lora:
        tensors["q_a_proj.weight"] = (q_lora, hidden)
        tensors["q_a_layernorm.weight"] = (q_lora,)
        tensors["q_b_proj.weight"] = (heads * (nope + rope), q_lora)
    else:
        tensors["q_proj.weight"] = (heads * (nope + rope), hidden)
    tensors["kv_a_proj_with_mqa.weight"] = (kv_lora + rope, hidden)
    tensors["kv_a_layernorm.weight"] = (kv_lora,)
    tensors["kv_b_proj.weight"] = (heads * (nope + v_dim), kv_lora)
    tensors["o_proj.weight"] = (hidden, heads * v_dim)
    if config.get("index_head_dim"):  # DSA indexer (GLM-5, DeepSeek-V3.2)
        index_heads, index_dim = config["index_n_heads"], config["index_head_dim"]
        tensors["indexer.wq_b.weight"] = (index_heads * index_dim, q_lora)
        tensors["indexer.wk.weight"] = (index_dim, hidden)
        tensors["indexer.k_norm.weight"] = (index_dim,)
        tensors["indexer.k_norm.bias"] = (index_dim,)
        tensors["indexer.weights_proj.weight"] = (index_heads, hidden)
    return tensors


def _feed_forward(config: dict[str, Any], layer: int) -> dict[str, tuple[int, ...]]:
    hidden = config["hidden_size"]
    if config.get("num_local_experts"):  # Mixtral: every layer is a sparse MoE
        size = config["intermediate_size"]
        tensors = {"block_sparse_moe.gate.weight": (config["num_local_experts"], hidden)}
        for e in range(config["num_local_experts"]):
            p = f"block_sparse_moe.experts.{e}."
            tensors.update({p + "w1.weight": (size, hidden), p + "w3.weight": (size, hidden)})
            tensors[p + "w2.weight"] = (hidden, size)
        return tensors
    if not config.get("n_routed_experts") or layer < config.get("first_k_dense_replace", 0):
        tensors = _swiglu("mlp.", hidden, config["intermediate_size"])
        if config.get("mlp_bias"):
            tensors.update({name.replace(".weight", ".bias"): shape[:1] for name, shape in tensors.items()})
        return tensors
    experts, size = config["n_routed_experts"], config["moe_intermediate_size"]
    tensors = {"mlp.gate.weight": (experts, hidden), "mlp.gate.e_score_correction_bias": (experts,)}
    for e in range(experts):
        tensors.update(_swiglu(f"mlp.experts.{e}.", hidden, size))
    tensors.update(_swiglu("mlp.shared_experts.", hidden, size * config.get("n_shared_experts", 0)))
    return tensors


def _swiglu(prefix: str, hidden: int, size: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (size, hidden),
        prefix + "up_proj.weight": (size, hidden),
        prefix + "down_proj.weight": (hidden, size),
    }


def is_quantizable(name: str, shape: tuple[int, ...], only: str = "all") -> bool:
    """Whether a quantisation converts this tensor: a linear weight that ``quant.config`` (the rule
    ``tessera quantize`` and the loader apply) converts under the selection ``only``; embeddings, lm_head,
    norms, biases and MoE routers stay bf16."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    return QuantConfig.selecting("int4", only, group_size=INT4_GROUP).converts(name.removesuffix(".weight"))


def _tensor_bytes(name: str, shape: tuple[int, ...], weight_format: str, only: str = "all") -> int:
    numel = _numel(shape)
    if weight_format == "bf16" or not is_quantizable(name, shape, only):
        return 2 * numel
    rows, cols = numel // shape[-1], shape[-1]
    if weight_format == "fp8":
        return numel + 4 * rows
    return rows * _ceil_div(cols, 2) + rows * _ceil_div(cols, INT4_GROUP) * (2 + 2)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def report(
    model: ModelShapes, rows: list[CapacityRow], memory_gib: float, gpus: int, reserve_gib: float = 0.0
) -> dict[str, Any]:
    """A JSON-ready summary: the model, the deployment, one row per (weight format, KV format)."""
    return {
        "model": model.name,
        "params": model.num_params,
        "kv_layout": model.kv.summary(),
        "memory_gib_per_gpu": memory_gib,
        "reserve_gib_per_gpu": reserve_gib,
        "gpus": gpus,
        "weight_bytes": {fmt: model.weight_bytes(fmt) for fmt in WEIGHT_FORMATS},
        # `tessera quantize --only routed-experts`: the routed experts converted, everything else bf16
        "weight_bytes_routed_experts_only": {
            fmt: model.weight_bytes(fmt, "routed-experts") for fmt in ("fp8", "int4")
        }
        if model.has_routed_experts
        else None,
        "rows": [asdict(row) for row in rows],
    }


def format_table(
    model: ModelShapes, rows: list[CapacityRow], memory_gib: float, gpus: int, reserve_gib: float = 0.0
) -> str:
    kv = model.kv
    reserve = f", {reserve_gib:g} GiB reserved" if reserve_gib else ""
    lines = [
        f"{model.name}: {model.num_params / 1e9:,.2f}B parameters; KV per token: {kv.num_layers} layers x "
        f"{kv.elements_per_layer} elements ({kv.kind}: {kv.detail})",
        f"{gpus} GPU(s) x {memory_gib:g} GiB{reserve}, tensor parallel; "
        "tokens = KV tokens the deployment holds at once",
        "",
        f"{'weights':<8}{'weights/GPU':>13}{'free/GPU':>11}{'bf16 KV tokens':>17}{'int8 KV tokens':>17}"
        f"{'fp8_e4m3 KV tokens':>21}{'fp8/bf16':>10}",
    ]
    by_format = {(r.weight_format, r.kv_format): r for r in rows}
    for fmt in WEIGHT_FORMATS:
        bf16, int8, fp8 = (by_format[fmt, kv] for kv in KV_FORMATS)
        if not (bf16.fits or fp8.fits):
            short = -bf16.free_gib_per_gpu
            lines.append(
                f"{fmt:<8}{bf16.weight_gib_per_gpu:>9.1f} GiB   does not fit"
                + (f" ({short:.1f} GiB/GPU short)" if short > 0 else " (no room for KV cache)")
            )
            continue
        ratio = f"{fp8.tokens / bf16.tokens:.3f}" if bf16.tokens else "-"
        lines.append(
            f"{fmt:<8}{bf16.weight_gib_per_gpu:>9.1f} GiB{bf16.free_gib_per_gpu:>7.1f} GiB"
            f"{bf16.tokens:>17,}{int8.tokens:>17,}{fp8.tokens:>21,}{ratio:>10}"
        )
    bf16_row, int8_row, fp8_row = (by_format["bf16", kv] for kv in KV_FORMATS)
    lines.append(
        f"KV bytes per token per GPU: bf16 {bf16_row.kv_bytes_per_token_per_gpu:,.1f}, "
        f"int8 {int8_row.kv_bytes_per_token_per_gpu:,.1f} (incl. a bf16 scale per entry), "
        f"fp8_e4m3 {fp8_row.kv_bytes_per_token_per_gpu:,.1f} (incl. fp32 scales per layer and page)"
    )
    rope_bf16 = kv.rope_bf16_bytes_per_token(gpus, bf16_row.page_size)
    if rope_bf16 is not None:
        lines.append(
            f"MLA's fp8_e4m3 layout with the rope key in bf16 (model option kv_rope_bf16): {rope_bf16:,.2f}"
        )
    if model.has_routed_experts:
        only = {fmt: model.weight_bytes(fmt, "routed-experts") / gpus / GIB for fmt in ("int4", "fp8")}
        lines.append(
            f"routed experts only converted (tessera quantize --only routed-experts): int4 "
            f"{only['int4']:.1f} GiB/GPU, fp8 {only['fp8']:.1f} GiB/GPU"
        )
    return "\n".join(lines)
