"""Build a sentence encoder from a Hugging Face / sentence-transformers folder: config.json, model.safetensors
(or shards), the pooling config; every tensor's name and shape checked, as ``loader.load_model`` checks a
decoder's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from gpu_workers.checkpoint import ModelLoadError
from gpu_workers.encoder_checkpoint import EncoderConfig
from gpu_workers.model.bert import BertModel
from gpu_workers.model.loader import safetensors_files

# Stored by BertModel checkpoints, not needed for sentence embeddings: the position-id table (derivable) and
# the pooler (sentence-transformers pools the hidden states itself).
_UNUSED_PREFIXES = ("embeddings.position_ids", "pooler.")
# Checkpoints saved from a task model (BertForMaskedLM, ...) hold the encoder under this prefix.
_ENCODER_PREFIX = "bert."


def load_encoder(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> BertModel:
    """The encoder at ``path`` in eval mode, its matmul weights in ``dtype`` (the rest fp32), q/k/v fused.

    Raises ``ModelLoadError`` for a folder that is not an encoder checkpoint, an unsupported pooling, and a
    missing, unexpected or wrongly shaped tensor.
    """
    path = Path(path)
    config = EncoderConfig.from_pretrained(path)
    files = safetensors_files(path)
    with torch.device("meta"):
        model = BertModel(config)
    model.to_empty(device=device)
    _load_weights(model, files)
    model.to_compute_dtype(dtype)
    model.fuse_projections()
    return model.eval().requires_grad_(False)


def _load_weights(model: BertModel, files: list[Path]) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as shard:
            for stored in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = stored.removeprefix(_ENCODER_PREFIX)
                param = params.get(name)
                if param is None:
                    if name.startswith(_UNUSED_PREFIXES) or not stored.startswith(
                        ("embeddings.", "encoder.", "bert.")
                    ):
                        continue  # a task head (cls.*, classifier.*) or a derivable table: not an encoder tensor
                    raise ModelLoadError(
                        f"tensor {stored} in {file.name} has no place in a {model.config.architecture} built from "
                        "config.json; the config and the weights disagree"
                    )
                tensor = shard.get_tensor(stored)
                if tensor.shape != param.shape:
                    raise ModelLoadError(
                        f"tensor {stored} in {file.name} has shape {list(tensor.shape)}, expected "
                        f"{list(param.shape)} from config.json"
                    )
                if not tensor.is_floating_point():
                    raise ModelLoadError(f"tensor {stored} in {file.name} is {tensor.dtype}; expected floats")
                param.data.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint is missing tensor {shown} (config.json says the model has it)")
