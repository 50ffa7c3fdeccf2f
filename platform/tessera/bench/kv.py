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


class Outputs(dict):
    """Each request's tokens (request index -> token ids) as they arrive, and what failed.

    The engine only logs an exception raised in an event callback (a caller's bug must not stop it), so a
    bench records failures here and calls ``raise_failed`` once it has stepped its requests through."""

    def __init__(self, num_requests: int = 0):
        super().__init__({i: [] for i in range(num_requests)})
        self.failures: list[str] = []

    def record(self, index: int, event) -> None:
        if event.error is not None:
            self.failures.append(f"{event.error.code}: {event.error.message}")
        self.setdefault(index, []).extend(event.token_ids)

    def raise_failed(self) -> None:
        """A failed request would make its bench measure something else: stop with the engine's reason."""
        if self.failures:
            raise BenchError(
                f"{len(self.failures)} benchmark request(s) failed; the first ({self.failures[0]})"
            )


def collect(engine, prompts: list[list[int]], params) -> Outputs:
    """Add the prompts as requests; the returned ``Outputs`` fills with each request's tokens as they arrive."""
    outputs = Outputs(len(prompts))
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, on_event=lambda event, i=i: outputs.record(i, event))
    return outputs
