"""``tessera bench engine``: this engine vs HF transformers ``generate`` on one checkpoint, in one run.

Both run the same greedy requests with mixed prompt and output lengths: the engine as concurrent requests,
HF as one left-padded batch that runs until its longest request is done. Reported: useful output tokens/s,
interleaved per repeat (median and range of each, and of the per-repeat ratio); and how close a decode step
of the largest batch comes to torch's own GEMM speed on the model's linear shapes.
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
from tessera.bench.stats import format_ratio, format_spread, median, spread

MIN_PROMPT, MAX_PROMPT = 16, 192
FIRST_ID = 16  # below this the demo and most vocabularies keep special tokens
T = TypeVar("T")


def run_engine_bench(
    model_dir: Path,
    config,
    concurrency: list[int],
    max_tokens: int,
    repeat: int,
    as_json: bool,
    min_tokens: int | None = None,
) -> None:
    """Both systems on the same requests at each concurrency; the median of ``repeat`` runs counts.

    Output lengths are drawn from [min_tokens, max_tokens] (default max_tokens / 4); equal bounds give
    every request the same length, HF's best case.
    """
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
    min_tokens = min_tokens or max(1, max_tokens // 4)
    prompts, out_lens = make_requests(max(concurrency), hf.config.vocab_size, max_tokens, min_tokens)

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
            results.append(summarise(n, batch, outs, hf_ids, engine_s, hf_s))
    efficiency = decode_efficiency(engine, torch, prompts[: max(concurrency)])
    report = {
        "date": date.today().isoformat(),
        "model": str(model_dir),
        "dtype": str(engine.config.torch_dtype).removeprefix("torch."),
        "min_tokens": min_tokens,
        "max_tokens": max_tokens,
        "prompt_lengths": [MIN_PROMPT, MAX_PROMPT],
        "repeat": repeat,
        "machine": f"{os.cpu_count()}-core CPU, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "transformers": transformers.__version__,
        "results": results,
        "decode_efficiency": efficiency,
    }
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


def make_requests(
    n: int, vocab_size: int, max_tokens: int, min_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """Deterministic random prompts of mixed lengths, and output lengths in [min_tokens, max_tokens]."""
    rng = random.Random(0)
    prompts = [
        [rng.randrange(FIRST_ID, vocab_size) for _ in range(rng.randint(MIN_PROMPT, MAX_PROMPT))]
        for _ in range(n)
    ]
    return prompts, [rng.randint(min_tokens, max_tokens) for _ in range(n)]


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


def summarise(n: int, batch, outs, hf_ids, engine_s: list[float], hf_s: list[float]) -> dict:
    """Rates from the median times; spreads over the repeats, the ratio paired per repeat."""
    output_tokens = sum(len(o.token_ids) for o in outs)
    hf_tokens = sum(map(len, hf_ids))  # useful tokens only: HF rows past their length are waste
    engine_rate = output_tokens / median(engine_s, ndigits=None)
    hf_rate = hf_tokens / median(hf_s, ndigits=None)
    return {
        "concurrency": n,
        "prompt_tokens": sum(map(len, batch)),
        "output_tokens": output_tokens,
        "engine_tokens_per_s": round(engine_rate, 1),
        "hf_tokens_per_s": round(hf_rate, 1),
        "speedup": round(engine_rate / hf_rate, 2),
        "engine_tokens_per_s_spread": spread(output_tokens / s for s in engine_s),
        "hf_tokens_per_s_spread": spread(hf_tokens / s for s in hf_s),
        "speedup_spread": spread(h / e for e, h in zip(engine_s, hf_s, strict=True)),
        "greedy_match": sum(o.token_ids == h for o, h in zip(outs, hf_ids, strict=True)),
    }


def decode_efficiency(engine, torch, prompts: list[list[int]], steps: int = 8) -> dict:
    """A decode step of ``len(prompts)`` requests vs torch's GEMMs alone on the model's linear shapes.

    The step's linear FLOPs (2 * rows * in * out per linear, the output projection included) over its
    median wall time is the engine's achieved rate; the same linears run back to back by ``F.linear`` on
    the same rows and dtype is torch's. Their ratio is the share of a step spent in GEMMs.
    """
    import torch.nn.functional as F

    n = len(prompts)
    before = engine.stats()["generated_tokens"]
    ids = [engine.add_request(p, greedy(steps + 2)) for p in prompts]
    while engine.stats()["generated_tokens"] < before + n:  # every prompt prefilled: decode steps follow
        engine.step()
    step_s = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort(request_id)
    from gpu_workers.kernels.packed_linear import PackedLinear

    # Torch's own GEMM on each linear's shape and dtype, on a plain weight: packed layers (oneDNN's
    # blocked layout, kernels.packed_linear) are measured against what F.linear does with their shape.
    weights = []
    for m in engine.model.modules():
        if isinstance(m, torch.nn.Linear) and m is not engine.model:
            weights.append(m.weight)
        elif isinstance(m, PackedLinear):
            weights.append(torch.randn(m.out_features, m.in_features, device=m.packed.device).to(m.dtype))
    if engine.model.lm_head is None:  # tied: compute_logits multiplies by the embedding
        weights.append(engine.model.model.embed_tokens.weight)
    x = {w.shape[1]: torch.randn(n, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    gemm_s = []
    with torch.inference_mode():
        for _ in range(steps):
            start = time.perf_counter()
            for w in weights:
                F.linear(x[w.shape[1]], w)
            gemm_s.append(time.perf_counter() - start)
    flops = sum(2 * n * w.shape[0] * w.shape[1] for w in weights)
    step, gemm = median(step_s, ndigits=None), median(gemm_s, ndigits=None)
    return {
        "requests": n,
        "linears": len(weights),
        "step_ms": spread(1e3 * s for s in step_s),
        "gemm_ms": spread(1e3 * s for s in gemm_s),
        "engine_linear_gflops": round(flops / step / 1e9, 2),
        "torch_gemm_gflops": round(flops / gemm / 1e9, 2),
        "gemm_share_of_step": round(gemm / step, 3),
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
            format_spread(r["engine_tokens_per_s_spread"], ".1f", ".0f"),
            format_spread(r["hf_tokens_per_s_spread"], ".1f", ".0f"),
            format_ratio(r["speedup_spread"]),
            f"{r['greedy_match']}/{r['concurrency']}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"{report['model']}, {report['dtype']}, prompts {MIN_PROMPT}-{MAX_PROMPT} tokens, outputs "
        f"{report['min_tokens']}-{report['max_tokens']} tokens, median [min, max] of {report['repeat']} "
        f"interleaved runs; {report['machine']}, transformers {report['transformers']}, {report['date']}"
    )
    e = report["decode_efficiency"]
    console.print(
        f"decode step of {e['requests']} requests: {format_spread(e['step_ms'], '.2f')} ms, "
        f"{e['engine_linear_gflops']} linear GFLOP/s vs torch GEMMs alone {e['torch_gemm_gflops']} GFLOP/s "
        f"({format_spread(e['gemm_ms'], '.2f')} ms): GEMMs are {100 * e['gemm_share_of_step']:.0f}% of the step"
    )
