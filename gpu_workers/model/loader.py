"""Build a model from a Hugging Face checkpoint folder: config.json plus one or more safetensors shards."""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from safetensors import safe_open
from torch import nn

from gpu_workers.model.config import ModelConfig, read_json
from gpu_workers.model.errors import ModelLoadError
from gpu_workers.model.llama import LlamaForCausalLM
from gpu_workers.model.mixtral import MixtralForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
INDEX_FILE = "model.safetensors.index.json"


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> nn.Module:
    """The checkpoint at ``path`` as an eval-mode module with weights in ``dtype`` on ``device``.

    Raises ``ModelLoadError`` for an unsupported architecture, a missing config or weights file, and a
    missing or wrongly shaped tensor.
    """
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    files = safetensors_files(path)
    # Built on the meta device so no memory is allocated or initialised for weights about to be overwritten.
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config).to(dtype)
    model.to_empty(device=device)
    _load_weights(model, files, progress)
    return model.eval().requires_grad_(False)


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


def _load_weights(model: nn.Module, files: list[Path], progress: bool) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    # stderr, so that machine-readable stdout (``--json``) stays clean while a checkpoint loads.
    with Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar:
        task = bar.add_task("Loading weights", total=len(files))
        for file in files:
            bar.update(task, description=f"Loading {file.name}")
            with safe_open(file, framework="pt", device="cpu") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                    param = params.get(name)
                    if param is None:
                        _check_extra(name, model, file)
                        continue
                    tensor = shard.get_tensor(name)
                    if tensor.shape != param.shape:
                        raise ModelLoadError(
                            f"tensor {name} in {file.name} has shape {list(tensor.shape)}, expected "
                            f"{list(param.shape)} from config.json"
                        )
                    param.data.copy_(tensor)
                    loaded.add(name)
            bar.advance(task)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint is missing tensor {shown} (config.json says the model has it)")


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
