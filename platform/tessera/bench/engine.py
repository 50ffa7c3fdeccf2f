"""``tessera bench engine``: this engine vs HF transformers ``generate`` on one checkpoint, in one run.

Both run the same greedy requests with mixed prompt and output lengths: the engine as concurrent requests,
HF as one left-padded batch that runs until its longest request is done. Reported: useful output tokens/s.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.table import Table

from tessera.bench import BenchError
from tessera.bench.console import progress
from tessera.bench.stats import median

MIN_PROMPT, MAX_PROMPT = 16, 192
FIRST_ID = 16  # below this the demo and most vocabularies keep special tokens
T = TypeVar("T")


def run_engine_bench(
    model_dir: Path, config, concurrency: list[int], max_tokens: int, repeat: int, as_json: bool
) -> None:
    """Both systems on the same requests at each concurrency; the median of ``repeat`` runs counts."""
    try:
        import transformers
    except ImportError:
        raise BenchError(
            "`tessera bench engine` compares against HF transformers, which is not installed: "
            "pip install transformers (or pip install -e '.[test]')"
        ) from None
    import torch

    from gpu_workers import Engine

    # The progress bar goes to stderr: stdout carries only results.
    engine = Engine.from_pretrained(model_dir, config, progress=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to(engine.config.torch_dtype).eval()
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    prompts, out_lens = make_requests(max(concurrency), hf.config.vocab_size, max_tokens)

    # Warm-up: the first call of each pays one-off costs (allocations, lazy init) that are not throughput.
    engine.generate([prompts[0]], greedy(2))
    hf_generate(hf, torch, [prompts[0]], [2], pad_id)

    results = []
    with progress(len(concurrency) * repeat) as advance:
        for n in concurrency:
            batch, lens = prompts[:n], out_lens[:n]
            params = [greedy(k) for k in lens]
            engine_s, hf_s = [], []
            for _ in range(repeat):
                outs = timed(engine_s, engine.generate, batch, params)
                hf_ids = timed(hf_s, hf_generate, hf, torch, batch, lens, pad_id)
                advance()
            errors = [o.error.message for o in outs if o.error]
            if errors:
                raise BenchError(f"the engine failed a benchmark request: {errors[0]}")
            results.append(
                summarise(n, batch, outs, hf_ids, median(engine_s, ndigits=None), median(hf_s, ndigits=None))
            )
    report = {
        "date": date.today().isoformat(),
        "model": str(model_dir),
        "dtype": engine.dtype.name,
        "max_tokens": max_tokens,
        "prompt_lengths": [MIN_PROMPT, MAX_PROMPT],
        "repeat": repeat,
        "machine": f"{os.cpu_count()}-core CPU, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "transformers": transformers.__version__,
        "results": results,
    }
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


def make_requests(n: int, vocab_size: int, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Deterministic random prompts of mixed lengths, and output lengths in [max_tokens/4, max_tokens]."""
    rng = random.Random(0)
    prompts = [
        [rng.randrange(FIRST_ID, vocab_size) for _ in range(rng.randint(MIN_PROMPT, MAX_PROMPT))]
        for _ in range(n)
    ]
    return prompts, [rng.randint(max(1, max_tokens // 4), max_tokens) for _ in range(n)]


def greedy(max_tokens: int):
    from gpu_workers import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def timed(times: list[float], fn: Callable[..., T], *args) -> T:
    """``fn(*args)``, appending its wall time to ``times``."""
    start = time.perf_counter()
    result = fn(*args)
    times.append(time.perf_counter() - start)
    return result


def hf_generate(hf, torch, prompts: list[list[int]], out_lens: list[int], pad_id: int) -> list[list[int]]:
    """Greedy HF generate over one left-padded batch; returns each request's first ``out_lens[i]`` new tokens."""
    max_tokens = max(out_lens)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,  # like ignore_eos: no row ends early on EOS
            do_sample=False,
            pad_token_id=pad_id,
        )
    return [row[:n] for row, n in zip(out[:, width:].tolist(), out_lens, strict=True)]


def summarise(n: int, batch, outs, hf_ids, engine_s: float, hf_s: float) -> dict:
    output_tokens = sum(len(o.token_ids) for o in outs)
    engine_rate = output_tokens / engine_s
    hf_rate = sum(map(len, hf_ids)) / hf_s  # useful tokens only: HF rows past their length are waste
    return {
        "concurrency": n,
        "prompt_tokens": sum(map(len, batch)),
        "output_tokens": output_tokens,
        "engine_tokens_per_s": round(engine_rate, 1),
        "hf_tokens_per_s": round(hf_rate, 1),
        "speedup": round(engine_rate / hf_rate, 2),
        "greedy_match": sum(o.token_ids == h for o, h in zip(outs, hf_ids, strict=True)),
    }


def print_table(report: dict) -> None:
    table = Table(title="engine vs HF transformers generate, useful output tokens/s")
    for col in [
        "requests",
        "prompt tok",
        "output tok",
        "engine tok/s",
        "HF tok/s",
        "engine/HF",
        "same greedy",
    ]:
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(
            str(r["concurrency"]),
            str(r["prompt_tokens"]),
            str(r["output_tokens"]),
            f"{r['engine_tokens_per_s']:.1f}",
            f"{r['hf_tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['greedy_match']}/{r['concurrency']}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"{report['model']}, {report['dtype']}, prompts {MIN_PROMPT}-{MAX_PROMPT} tokens, outputs "
        f"{max(1, report['max_tokens'] // 4)}-{report['max_tokens']} tokens, median of {report['repeat']} runs; "
        f"{report['machine']}, transformers {report['transformers']}, {report['date']}"
    )
