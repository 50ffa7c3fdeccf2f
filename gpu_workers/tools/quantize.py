"""``tessera quantize``: convert a checkpoint folder's weights to bf16, fp8 or int4, once.

Shard by shard, so memory holds one shard at a time (as read, and as converted). Linear weights become the
format's tensors (``quant.formats``), rounded to nearest; every other floating-point tensor (embeddings,
lm_head, norms, biases, MoE routers) is stored in bf16, as ``kv.capacity`` counts them. config.json gains
``quantization_config``; tokenizer and other files are copied unchanged.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from safetensors import safe_open
from safetensors.torch import save_file

from gpu_workers.checkpoint import ModelConfig, read_json
from gpu_workers.formats.fp8 import FP8_DTYPE
from gpu_workers.formats.weights import quantize_fp8_weight, quantize_int4
from gpu_workers.model.loader import INDEX_FILE, safetensors_files
from gpu_workers.quant.config import SELECTIONS, WEIGHT_FORMATS, QuantConfig, validate_group_size

STORED_DTYPE = torch.bfloat16  # unquantised tensors


@dataclass(frozen=True)
class ConversionReport:
    weights: str
    source_dtype: str  # what the source checkpoint stores (config.json), e.g. float32
    source_bytes: int  # safetensors files of the source
    output_bytes: int  # safetensors files written
    converted_tensors: int  # linear weights in the new format
    kept_tensors: int  # stored in bf16
    converted_bf16_bytes: int  # what the converted weights take in bf16
    converted_bytes: int  # what they take in the new format, scales and zeros included

    @property
    def ratio(self) -> float:
        return self.output_bytes / self.source_bytes


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    weights: str,
    group_size: int = 128,
    symmetric: bool = False,
    progress: bool = False,
    only: str = "all",
) -> ConversionReport:
    """Write ``src`` converted to ``weights`` (round to nearest) into the new folder ``dst``; ``only``
    ("all" or "routed-experts", ``quant.config.SELECTIONS``) picks the linear layers converted.

    Raises ValueError for a bad request (unknown format or selection, already quantised source, non-empty
    ``dst``, a routed-experts selection on a model without routed experts).
    """
    src, dst = Path(src), Path(dst)
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    model_config = ModelConfig.from_pretrained(src)  # raises if src is not a checkpoint we can serve
    config = read_json(src / "config.json")
    if config.get("quantization_config") is not None:
        raise ValueError(
            f"{src} is already quantised ({config['quantization_config'].get('format')}); convert the "
            "unquantised checkpoint it came from"
        )
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} already exists and is not an empty folder; choose a new output folder")
    if weights == "int4":
        validate_group_size(group_size)
    if only not in SELECTIONS:
        raise ValueError(f"--only must be one of {', '.join(SELECTIONS)}, got {only!r}")
    if only != "all" and weights == "bf16":
        raise ValueError(f"--only {only} selects layers to quantise; it needs --weights int4 or fp8")
    if only == "routed-experts" and not model_config.num_experts:
        raise ValueError(
            f"--only routed-experts: {src} ({model_config.architecture}) has no routed experts; "
            "use --only all"
        )
    quant = None
    if weights != "bf16":
        quant = QuantConfig.selecting(
            weights,
            only,
            group_size=group_size if weights == "int4" else None,
            symmetric=symmetric if weights == "int4" else False,
        )
    files = safetensors_files(src)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    counts = [0, 0]
    converted_bytes = [0, 0]  # [as bf16, as stored]
    with Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar:
        task = bar.add_task(f"Converting to {weights}", total=_count_tensors(files))
        for file in files:
            out: dict[str, torch.Tensor] = {}
            with safe_open(file, framework="pt", device="cpu") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensor = shard.get_tensor(name)
                    converted = _convert(name, tensor, quant)
                    if _is_converted(name, tensor, quant):
                        counts[0] += 1
                        converted_bytes[0] += tensor.numel() * 2
                        converted_bytes[1] += sum(t.numel() * t.element_size() for t in converted.values())
                    else:
                        counts[1] += 1
                    out.update(converted)
                    bar.advance(task)
            save_file(out, dst / file.name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(out, file.name))
    if (src / INDEX_FILE).is_file():
        total = sum((dst / f.name).stat().st_size for f in files)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    _write_config(config, quant, dst)
    _copy_other_files(src, dst, {f.name for f in files})
    return ConversionReport(
        weights=weights,
        source_dtype=model_config.torch_dtype or "unknown dtype",
        source_bytes=sum(f.stat().st_size for f in files),
        output_bytes=sum((dst / f.name).stat().st_size for f in files),
        converted_tensors=counts[0],
        kept_tensors=counts[1],
        converted_bf16_bytes=converted_bytes[0],
        converted_bytes=converted_bytes[1],
    )


def _count_tensors(files: list[Path]) -> int:
    total = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as shard:
            total += len(shard.keys())
    return total


def _is_converted(name: str, tensor: torch.Tensor, quant: QuantConfig | None) -> bool:
    """A linear layer's weight that ``quant`` converts (the same rule the loader applies to modules)."""
    return (
        quant is not None
        and tensor.ndim == 2
        and name.endswith(".weight")
        and quant.converts(name.removesuffix(".weight"))
    )


def _convert(name: str, tensor: torch.Tensor, quant: QuantConfig | None) -> dict[str, torch.Tensor]:
    if not _is_converted(name, tensor, quant):
        return {name: tensor.to(STORED_DTYPE) if tensor.is_floating_point() else tensor}
    module = name.removesuffix(".weight")
    if quant.format == "fp8":
        q = quantize_fp8_weight(tensor)
        return {name: q.weight.view(FP8_DTYPE), f"{module}.weight_scale": q.weight_scale}
    if tensor.shape[1] % 2:
        raise ValueError(f"{name} has {tensor.shape[1]} input features; int4 packing needs an even number")
    q = quantize_int4(tensor, quant.group_size, quant.symmetric)
    out = {f"{module}.weight_packed": q.weight_packed, f"{module}.weight_scale": q.weight_scale}
    if q.weight_zero is not None:
        out[f"{module}.weight_zero"] = q.weight_zero
    return out


def _write_config(config: dict, quant: QuantConfig | None, dst: Path) -> None:
    config = dict(config)
    # transformers 5 writes "dtype", older versions "torch_dtype"; keep whichever the source used.
    dtype_key = "dtype" if "dtype" in config else "torch_dtype"
    config[dtype_key] = "bfloat16"
    if quant is not None:
        config["quantization_config"] = quant.to_json()
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _copy_other_files(src: Path, dst: Path, weight_files: set[str]) -> None:
    """Tokenizer, generation config and anything else that is not the weights or config.json."""
    skip = weight_files | {"config.json", INDEX_FILE}
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in skip and path.suffix not in (".safetensors", ".bin", ".pt"):
            shutil.copy2(path, dst / path.name)
