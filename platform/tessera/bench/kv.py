"""What the KV-cache benches (``tessera bench integrity|prefix|kv-formats``) share: the checkpoint loaded
once, greedy requests of random token ids, and the report around their measurements.

Each bench loads the checkpoint once and runs its variants on engines that share those weights,
interleaved in one run (alternating which goes first), so that load from other processes hits every
variant alike. Tables report medians with their spread over repetitions; ``--json`` prints the raw report.
"""

from __future__ import annotations

import os
import random
from datetime import date
from pathlib import Path

from tessera.bench import BenchError

FIRST_ID = 16  # below this the demo and most vocabularies keep special tokens


def load(model_dir: Path, config, threads: int | None):
    """Model and tokenizer, loaded once for every engine of a bench, with ``threads`` torch CPU threads."""
    import torch

    from gpu_workers.model import load_model
    from gpu_workers.tokenizer import load_tokenizer

    if threads is not None:
        torch.set_num_threads(threads)
    model = load_model(model_dir, dtype=config.torch_dtype, device=config.device, progress=True)
    return model, load_tokenizer(model_dir)


def report(bench: str, model_dir: Path, config, settings: dict, measured: dict) -> dict:
    """A bench's measurements with what reproduces them: model, formats, machine, date and settings."""
    import torch

    return {
        "bench": bench,
        "date": date.today().isoformat(),
        "model": str(model_dir),
        "dtype": config.dtype,
        "page_size": config.page_size,
        "machine": f"{os.cpu_count()}-core CPU, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "device": torch.cuda.get_device_name(config.device) if config.device == "cuda" else "cpu",
        "settings": settings,
        **measured,
    }


def ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]


def greedy(max_tokens: int):
    from gpu_workers import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def round_up(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


def collect(engine, prompts: list[list[int]], params) -> dict[int, list[int]]:
    """Add the prompts as requests; the returned dict fills with each request's tokens as they arrive."""
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

    def on_event(event, out: list[int]) -> None:
        check(event)
        out.extend(event.token_ids)

    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, on_event=lambda event, out=outputs[i]: on_event(event, out))
    return outputs


def check(event) -> None:
    """A failed request would make its bench measure something else: stop with the engine's reason."""
    if event.error is not None:
        raise BenchError(f"a benchmark request failed ({event.error.code}): {event.error.message}")
