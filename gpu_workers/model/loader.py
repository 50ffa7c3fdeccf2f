"""Build a model from a Hugging Face checkpoint folder: config.json plus one or more safetensors shards.

Weights load in the checkpoint's format: a ``quantization_config`` (written by ``tessera quantize``) makes
the converted linear layers fp8 or int4. ``weights="fp8"|"int4"`` quantises an unquantised checkpoint
while loading it, tensor by tensor, so one checkpoint can serve fp8 prefill and int4 decode.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from safetensors import safe_open
from torch import nn

from gpu_workers.checkpoint import ModelConfig, ModelLoadError, read_json
from gpu_workers.gguf_file import is_gguf
from gpu_workers.model.deepseek_v3 import DeepseekV3ForCausalLM
from gpu_workers.model.gguf_weights import load_gguf_model
from gpu_workers.model.glm4_moe import Glm4MoeForCausalLM
from gpu_workers.model.llama import LlamaForCausalLM
from gpu_workers.model.meta import on_meta
from gpu_workers.model.mixtral import MixtralForCausalLM
from gpu_workers.quant.config import DEFAULT_GROUP_SIZE, WEIGHT_FORMATS, QuantConfig
from gpu_workers.quant.linear import Fp8Linear, Int4Linear, convert_linears

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
}
INDEX_FILE = "model.safetensors.index.json"
log = logging.getLogger(__name__)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = False,
    weights: str = "auto",
    only: str = "all",
) -> nn.Module:
    """The checkpoint at ``path`` as an eval-mode module with weights in ``dtype`` on ``device``.

    ``weights``: "auto" keeps the checkpoint's format; "bf16" asks for unquantised weights (in ``dtype``);
    "fp8"/"int4" ask for that format, quantising an unquantised checkpoint as it loads (round to nearest,
    int4 in groups of 128), the layers ``only`` selects ("all" or "routed-experts"). A quantised
    checkpoint loads only as itself (its own selection). The model's ``quantization``
    attribute is the QuantConfig it runs with, or None.

    Raises ``ModelLoadError`` for an unsupported architecture, a missing config or weights file, a missing
    or wrongly shaped tensor, and a weight format the checkpoint cannot give.
    """
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    if is_gguf(path):
        if only != "all":
            raise ModelLoadError(
                f"only={only!r} selects layers of a safetensors checkpoint, not of a GGUF file"
            )
        return load_gguf_model(MODEL_CLASSES[config.architecture], path, dtype, device, progress, weights)
    stored = _stored_quantization(path)
    quant = _target_quantization(weights, stored, path, only)
    files = safetensors_files(path)
    # Built on the meta device so no memory is allocated or initialised for weights about to be overwritten.
    with on_meta():
        model = MODEL_CLASSES[config.architecture](config).to(dtype)
        if quant is not None:
            convert_linears(model, quant)
    model.to_empty(device=device)
    _load_weights(model, files, progress, quantize_dense=stored is None)
    model.quantization = quant
    return model.eval().requires_grad_(False)


def _stored_quantization(path: Path) -> QuantConfig | None:
    raw = read_json(path / "config.json").get("quantization_config")
    if raw is None:
        return None
    try:
        return QuantConfig.from_json(raw)
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"config.json in {path} has an invalid quantization_config: {e}") from None


def _target_quantization(
    weights: str, stored: QuantConfig | None, path: Path, only: str = "all"
) -> QuantConfig | None:
    if weights not in ("auto", *WEIGHT_FORMATS):
        raise ModelLoadError(f"weights must be auto, {', '.join(WEIGHT_FORMATS)}; got {weights!r}")
    if only != "all" and (weights in ("auto", "bf16") or stored is not None):
        raise ModelLoadError(
            f"only={only!r} selects layers to quantise while loading an unquantised checkpoint with "
            "weights='fp8' or 'int4'; a quantised checkpoint loads with the selection it was written with"
        )
    if weights == "auto":
        return stored
    if stored is None:
        if weights == "bf16":
            return None
        try:
            return QuantConfig.selecting(
                weights, only, group_size=DEFAULT_GROUP_SIZE if weights == "int4" else None
            )
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
    if weights != stored.format:
        raise ModelLoadError(
            f"{path} holds {stored.format} weights (quantised by `tessera quantize`), so it cannot load as "
            f"{weights}: the original weights are gone. Use weights='auto' (or '{stored.format}'), or point "
            f"at the unquantised checkpoint it was converted from to get {weights}"
        )
    return stored


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint: the shards its index names, else ``model.safetensors``."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map") or {}
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{INDEX_FILE} in {path} names shard {file.name}, which is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    hint = (
        " (pytorch_model.bin is not supported: convert it to safetensors)" if any(path.glob("*.bin")) else ""
    )
    raise ModelLoadError(f"{path} has no model.safetensors and no {INDEX_FILE}{hint}")


def _load_weights(model: nn.Module, files: list[Path], progress: bool, quantize_dense: bool) -> None:
    """Copy every checkpoint tensor into the model; with ``quantize_dense``, a quantised layer's unquantised
    ``weight`` is quantised into it."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    quantized = {
        name: module for name, module in model.named_modules() if isinstance(module, Fp8Linear | Int4Linear)
    }
    loaded: set[str] = set()
    skipped_mtp: set[str] = set()
    # stderr, so that machine-readable stdout (``--json``) stays clean while a checkpoint loads.
    with Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar:
        task = bar.add_task("Loading weights", total=len(files))
        for file in files:
            bar.update(task, description=f"Loading {file.name}")
            with safe_open(file, framework="pt", device="cpu") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                    module_name = name.removesuffix(".weight")
                    if quantize_dense and name.endswith(".weight") and module_name in quantized:
                        loaded |= _quantize_into(
                            quantized[module_name], module_name, shard.get_tensor(name), file
                        )
                        continue
                    param = params.get(name)
                    if param is None and _is_mtp_layer(name, model.config):
                        skipped_mtp.add(name)
                        continue
                    if param is None:
                        _check_extra(name, model, file)
                        continue
                    tensor = _stored_as(shard.get_tensor(name), param, name, file)
                    if tensor.shape != param.shape:
                        raise ModelLoadError(
                            f"tensor {name} in {file.name} has shape {list(tensor.shape)}, expected "
                            f"{list(param.shape)} from config.json"
                        )
                    param.data.copy_(tensor)
                    loaded.add(name)
            bar.advance(task)
    if skipped_mtp:
        log.info(
            "skipped the multi-token-prediction layer(s) model.layers.%d+ (%d tensors): not used for decoding",
            model.config.num_layers,
            len(skipped_mtp),
        )
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint is missing tensor {shown} (config.json says the model has it)")


def _quantize_into(module: nn.Module, module_name: str, weight: torch.Tensor, file: Path) -> set[str]:
    expected = [module.out_features, module.in_features]
    if list(weight.shape) != expected:
        raise ModelLoadError(
            f"tensor {module_name}.weight in {file.name} has shape {list(weight.shape)}, expected {expected} "
            "from config.json"
        )
    module.load_dense(weight)
    return {f"{module_name}.{name}" for name, _ in module.named_buffers()}


def _stored_as(tensor: torch.Tensor, param: torch.Tensor, name: str, file: Path) -> torch.Tensor:
    """``tensor`` in a dtype that copies into ``param`` without changing its meaning.

    FP8 weights are stored as float8_e4m3fn and held as their uint8 bits; packed int4 must be uint8. Float
    tensors may change precision (a bf16 checkpoint loads into a float32 model).
    """
    if param.dtype == torch.uint8 and tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8)
    if (param.dtype == torch.uint8) != (tensor.dtype == torch.uint8):
        raise ModelLoadError(
            f"tensor {name} in {file.name} is {tensor.dtype}, but this model expects {param.dtype} there: the "
            "checkpoint's quantization_config and its tensors disagree"
        )
    return tensor


def _is_mtp_layer(name: str, config: ModelConfig) -> bool:
    """A tensor of the multi-token-prediction layers DeepSeek-V3 and GLM-4.5 checkpoints store after the
    decoder's layers."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return (
        match is not None
        and config.architecture in ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
        and config.num_layers <= int(match[1]) < config.num_layers + max(config.num_nextn_predict_layers, 1)
    )


def _check_extra(name: str, model: nn.Module, file: Path) -> None:
    # Old checkpoints store rotary tables, and some tied checkpoints still store lm_head; both are derivable.
    # Anything else means config.json and the weights disagree (e.g. biases the config does not declare).
    harmless = name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and model.config.tie_word_embeddings
    )
    if not harmless:
        raise ModelLoadError(
            f"tensor {name} in {file.name} has no place in a {model.config.architecture} built from config.json; "
            "the config and the weights disagree"
        )
