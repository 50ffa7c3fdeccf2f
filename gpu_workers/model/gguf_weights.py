"""A model from a GGUF file: each tensor as the file stores it where our formats hold it exactly.

- Q4_0 / Q4_1 linear weights become ``Int4Linear`` layers with groups of 32 and the file's own float16
  scales (and, for Q4_1, minimums): the codes are re-laid out, never re-rounded, so dequantising them gives
  exactly what llama.cpp's ``gguf`` reader gives.
- F32 / F16 / BF16 tensors load as they are (into the model's dtype).
- Everything else (Q8_0, the K-quants, ...) is dequantised at load by ``gguf`` into the model's dtype, with
  a log line naming the types. Q8_0 (SmolLM2's embedding and tied output) is dequantised rather than kept
  in 8 bits: torch's CPU int8 kernel takes one scale per output row, where Q8_0 has one per 32 weights, so
  an 8-bit copy would round the file's weights a second time (BENCHMARKS.md, "GGUF").
- Llama-architecture files store q/k rows permuted for llama.cpp's interleaved rotary; those rows are put
  back in HF's order (a row permutation: quantised rows move whole).

``weights``: "auto" (the above), "bf16" (every tensor dequantised), "int4" (the above, other linears
quantised to int4 at load), "fp8" (linears dequantised, then FP8 at load).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from torch import nn

from gpu_workers.checkpoint import ModelConfig, ModelLoadError
from gpu_workers.formats.weights import GGUF_SCALE_DTYPE, pack_int4
from gpu_workers.gguf_file import PERMUTED_QK, GGUFError, GGUFTensor, open_gguf
from gpu_workers.model.meta import on_meta
from gpu_workers.quant.config import DEFAULT_GROUP_SIZE, WEIGHT_FORMATS, QuantConfig
from gpu_workers.quant.linear import Fp8Linear, Int4Linear, quantized_linear

log = logging.getLogger(__name__)

GGUF_GROUP_SIZE = 32  # the block of Q4_0 / Q4_1
NATIVE_INT4 = ("Q4_0", "Q4_1")
AS_STORED = ("F32", "F16")


def load_gguf_model(
    model_class: type[nn.Module],
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    progress: bool,
    weights: str,
) -> nn.Module:
    """The GGUF file at ``path`` as an eval-mode ``model_class`` (see the module docstring)."""
    if weights not in ("auto", *WEIGHT_FORMATS):
        raise ModelLoadError(f"weights must be auto, {', '.join(WEIGHT_FORMATS)}; got {weights!r}")
    config = ModelConfig.from_pretrained(path)
    try:
        gguf = open_gguf(path)
        tensors = gguf.tensors()
        permuted = gguf.architecture in PERMUTED_QK
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
    with on_meta():
        model = model_class(config).to(dtype)
        native = _convert_linears(model, tensors, weights)
    model.to_empty(device=device)
    _load_tensors(model, tensors, path, progress, config if permuted else None)
    if native:
        model.quantization = QuantConfig(
            "int4", group_size=GGUF_GROUP_SIZE, modules_to_convert=tuple(sorted(native))
        )
    elif weights in ("fp8", "int4"):
        model.quantization = QuantConfig(
            weights, group_size=DEFAULT_GROUP_SIZE if weights == "int4" else None
        )
    else:
        model.quantization = None
    return model.eval().requires_grad_(False)


def _convert_linears(model: nn.Module, tensors: list[GGUFTensor], weights: str) -> set[str]:
    """Swap in the quantised layers ``weights`` asks for; returns the names of those holding the file's
    Q4_0 / Q4_1 blocks as they are."""
    by_name = {t.name: t for t in tensors}
    policy = QuantConfig("fp8")  # which linears a quantised format converts: never embeddings or lm_head
    native = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not policy.converts(name):
            continue
        stored = by_name.get(f"{name}.weight")
        parent_name, _, child = name.rpartition(".")
        if stored is not None and stored.type in NATIVE_INT4 and weights in ("auto", "int4"):
            bias_dtype = module.weight.dtype
            layer = Int4Linear(
                module.in_features,
                module.out_features,
                module.bias is not None,
                bias_dtype,
                GGUF_GROUP_SIZE,
                symmetric=stored.type == "Q4_0",
                minimums=stored.type == "Q4_1",
                scale_dtype=GGUF_SCALE_DTYPE,
            )
            native.add(name)
        elif weights in ("fp8", "int4"):
            group = DEFAULT_GROUP_SIZE if weights == "int4" else None
            layer = quantized_linear(module, QuantConfig(weights, group_size=group))
        else:
            continue
        setattr(model.get_submodule(parent_name), child, layer)
    return native


def _load_tensors(
    model: nn.Module, tensors: list[GGUFTensor], path: Path, progress: bool, permute: ModelConfig | None
) -> None:
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    dequantized: Counter[str] = Counter()
    with Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar:
        task = bar.add_task(f"Loading {path.name}", total=len(tensors))
        for t in tensors:
            module_name = t.name.removesuffix(".weight")
            module = modules.get(module_name) if t.name.endswith(".weight") else None
            rows = _row_order(t, permute)
            if isinstance(module, Int4Linear) and module.weight_scale.dtype == GGUF_SCALE_DTYPE:
                _expect_shape(t, [module.out_features, module.in_features], path)
                loaded |= _load_blocks(module, module_name, t, rows)
            elif isinstance(module, Fp8Linear | Int4Linear):
                _expect_shape(t, [module.out_features, module.in_features], path)
                module.load_dense(_dense(t, rows, dequantized))
                loaded |= {f"{module_name}.{name}" for name, _ in module.named_buffers()}
            elif t.name in params:
                param = params[t.name]
                _expect_shape(t, list(param.shape), path)
                param.data.copy_(_dense(t, rows, dequantized))
                loaded.add(t.name)
            elif not (t.name == "lm_head.weight" and model.config.tie_word_embeddings):
                raise ModelLoadError(
                    f"tensor {t.gguf_name} ({t.name}) in {path.name} has no place in a "
                    f"{model.config.architecture} built from the file's metadata"
                )
            bar.advance(task)
    if dequantized:
        log.info(
            "%s: dequantised %s at load",
            path.name,
            ", ".join(f"{n} {kind} tensor{'s' * (n > 1)}" for kind, n in sorted(dequantized.items())),
        )
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path.name} is missing tensor {shown} (its metadata says the model has it)")


def _expect_shape(t: GGUFTensor, expected: list[int], path: Path) -> None:
    if list(t.shape) != expected:
        raise ModelLoadError(
            f"tensor {t.gguf_name} in {path.name} has shape {list(t.shape)}, expected {expected} from its "
            "metadata"
        )


def _row_order(t: GGUFTensor, config: ModelConfig | None) -> np.ndarray | None:
    """The row gather that undoes llama.cpp's q/k permutation (``permute`` in its converter), or None.

    The converter stores head h's rows as [h, i, j] for HF's [h, j, i] (j: which half of the head, i: the
    position in it), so HF's row (h, j, i) is stored row (h, i, j)."""
    if config is None:
        return None
    heads = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
    kind = next((k for k in heads if f".{k}." in t.name), None)
    if kind is None:
        return None
    n_head = heads[kind]
    half = t.shape[0] // n_head // 2
    return np.arange(t.shape[0]).reshape(n_head, half, 2).transpose(0, 2, 1).reshape(-1)


def _dense(t: GGUFTensor, rows: np.ndarray | None, dequantized: Counter[str]) -> torch.Tensor:
    """The tensor's values as a float torch tensor in HF's row order."""
    if t.type in AS_STORED:
        values = np.asarray(t.data).reshape(t.shape)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(np.asarray(t.data), GGMLQuantizationType[t.type]).reshape(t.shape)
        if t.type != "BF16":
            dequantized[t.type] += 1
    if rows is not None:
        values = values[rows]
    return torch.from_numpy(np.array(values))


def _load_blocks(module: Int4Linear, module_name: str, t: GGUFTensor, rows: np.ndarray | None) -> set[str]:
    """Q4_0 / Q4_1 blocks into ``module``'s codes, scales (and minimums), bit for bit.

    A block of 32 weights stores float16 d (and, Q4_1, float16 m) then 16 bytes whose low nibbles are
    weights 0-15 and high nibbles weights 16-31: W = d * (q - 8) (Q4_0) or d * q + m (Q4_1)."""
    out_features, in_features = t.shape
    blocks = np.asarray(t.data).reshape(out_features, in_features // GGUF_GROUP_SIZE, -1)
    if rows is not None:
        blocks = blocks[rows]
    blocks = torch.from_numpy(np.array(blocks))
    header = 4 if t.type == "Q4_1" else 2
    scale = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    qs = blocks[..., header:]
    codes = torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(out_features, in_features)
    module.weight_packed.copy_(pack_int4(codes))
    module.weight_scale.copy_(scale)
    names = {f"{module_name}.weight_packed", f"{module_name}.weight_scale"}
    if t.type == "Q4_1":
        module.weight_min.copy_(blocks[..., 2:4].contiguous().view(torch.float16)[..., 0])
        names.add(f"{module_name}.weight_min")
    return names
