"""Static FP8 KV scales: run a model over sample text, record each layer's K and V amax, save amax / 448.

The model runs through the same paged attention it serves with into an unquantised cache, and K and V are
read back from it: K after RoPE and any q/k norm, exactly as it is written. Text is cut into windows that start
at position 0, at most ``window`` tokens each.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch
from rich.progress import Progress

from gpu_workers.engine.runner import forward_sequence, sequence_cache
from gpu_workers.kv.scales import KVScales

# Default sample text: Python source that ships with every interpreter (and is not the demo tokenizer's
# training text), so calibration runs offline and the same on every machine with the same Python.
DEFAULT_SAMPLE_FILES = ("difflib.py", "pprint.py", "shlex.py", "ast.py")
PAGE_SIZE = 16


@torch.inference_mode()
def measure_kv_amax(
    model: torch.nn.Module,
    sequences: Iterable[list[int]],
    window: int = 512,
    max_tokens: int | None = None,
    progress: bool = False,
) -> tuple[list[float], list[float], int]:
    """Per-layer K and V amax of ``model`` over token sequences; returns (k_amax, v_amax, tokens seen)."""
    spec = model.kv_spec
    window = min(window, model.config.max_position_embeddings)
    cache, pages = sequence_cache(model, window, PAGE_SIZE)
    k_amax = torch.zeros(spec.num_layers, device=cache.k.device)
    v_amax = torch.zeros(spec.num_layers, device=cache.k.device)
    chunks = [seq[i : i + window] for seq in sequences for i in range(0, len(seq), window)]
    if max_tokens is not None:
        chunks = _first_tokens(chunks, max_tokens)
    tokens = 0
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("Calibrating KV scales", total=sum(map(len, chunks)))
        for chunk in chunks:
            forward_sequence(model, cache, pages, chunk)
            for stored, amax in ((cache.k, k_amax), (cache.v, v_amax)):
                written = stored.view(spec.num_layers, -1, *stored.shape[3:])[:, : len(chunk)]
                torch.maximum(amax, written.abs().amax(dim=(1, 2, 3)).float(), out=amax)
            tokens += len(chunk)
            bar.advance(task, len(chunk))
    if tokens == 0:
        raise ValueError("calibration needs at least one token of sample text")
    return k_amax.tolist(), v_amax.tolist(), tokens


def _first_tokens(chunks: list[list[int]], max_tokens: int) -> list[list[int]]:
    kept, left = [], max_tokens
    for chunk in chunks:
        if left <= 0:
            break
        kept.append(chunk[:left])
        left -= len(kept[-1])
    return kept


def default_sample_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in DEFAULT_SAMPLE_FILES]


def calibrate(
    model_dir: str | Path,
    texts: list[str] | None = None,
    max_tokens: int = 8192,
    dtype: torch.dtype = torch.float32,
    window: int = 512,
    progress: bool = False,
) -> KVScales:
    """Static FP8 KV scales for the checkpoint at ``model_dir`` from ``texts`` (default: stdlib source)."""
    from gpu_workers.model import load_model
    from gpu_workers.tokenizer import load_tokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(
            f"{model_dir} has no tokenizer.json, so sample text cannot be tokenized; calibrate from token "
            "ids in Python with gpu_workers.tools.calibrate.measure_kv_amax"
        )
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype=dtype, progress=progress)
    sequences = [tokenizer.encode(text) for text in (texts if texts is not None else default_sample_texts())]
    k_amax, v_amax, tokens = measure_kv_amax(model, sequences, window, max_tokens, progress)
    return KVScales.from_amax(k_amax, v_amax, tokens, model=model_dir.name)
