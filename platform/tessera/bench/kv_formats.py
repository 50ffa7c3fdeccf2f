"""``tessera bench kv-formats``: FP8-e4m3 vs BF16 KV cache, decode tokens/s per concurrency, one budget.

Both formats get the same ``kv_budget_bytes``, sized by default so that BF16 runs out of pages below the
highest concurrency while FP8, at half the bytes per token, keeps admitting.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from tessera.bench import kv
from tessera.bench.console import print_report, progress
from tessera.bench.stats import format_ratio, median, spread

KV_FORMATS = ("bf16", "fp8_e4m3")


def run_kv_formats(
    model_dir: Path,
    config,
    threads: int | None,
    concurrency: list[int],
    prompt_tokens: int,
    max_tokens: int,
    fit_requests: int | None,
    reps: int,
    as_json: bool,
) -> None:
    """With ``fit_requests``, the KV budget is sized to hold that many whole BF16 requests; without, both
    formats get ``config.kv_budget_bytes``."""
    model, tokenizer = kv.load(model_dir, config, threads)
    if fit_requests is not None:
        import torch

        per_request = kv.round_up(prompt_tokens + max_tokens, config.page_size)
        bytes_per_token = model.kv_spec.bytes_per_token(torch.bfloat16)
        config = replace(config, kv_budget_bytes=fit_requests * per_request * bytes_per_token)
    with progress(len(concurrency) * reps * len(KV_FORMATS)) as advance:
        results = measure_kv_formats(
            model, tokenizer, config, concurrency, prompt_tokens, max_tokens, reps, advance
        )
    settings = {
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "kv_budget_bytes": config.kv_budget_bytes,
        "reps": reps,
    }
    print_report(kv.report("kv-formats", model_dir, config, settings, results), as_json, kv_formats_table)


def measure_kv_formats(
    model,
    tokenizer,
    config,
    concurrency: list[int],
    prompt_tokens: int,
    max_tokens: int,
    reps: int,
    advance: Callable[[], None] = lambda: None,
) -> dict:
    """Each format's engine, same budget and requests, runs a closed batch of n requests to completion.

    tokens/s counts everything the batch costs (prefill, and recompute after preemption); decode tokens/s
    counts only steps in which every sequence computed exactly one token, the attention read that FP8
    pays dequantisation for.
    """
    from gpu_workers import Engine

    engines = [Engine(model, tokenizer, replace(config, kv_cache_dtype=fmt)) for fmt in KV_FORMATS]
    rng = random.Random(0)
    vocab = model.config.vocab_size
    for engine in engines:
        _run_batch(engine, [kv.ids(rng, 16, vocab)], kv.greedy(4))  # one-off costs
    rows = []
    for n in concurrency:
        prompts = [kv.ids(rng, prompt_tokens, vocab) for _ in range(n)]
        runs: list[list[dict]] = [[] for _ in engines]
        for rep in range(reps):
            order = range(len(engines)) if rep % 2 == 0 else reversed(range(len(engines)))
            for k in order:
                runs[k].append(_run_batch(engines[k], prompts, kv.greedy(max_tokens)))
                advance()
        row: dict = {"concurrency": n}
        for fmt, fmt_runs in zip(KV_FORMATS, runs, strict=True):
            row[fmt] = {
                "tokens_per_s": median(r["tokens_per_s"] for r in fmt_runs),
                "decode_tokens_per_s": median(r["decode_tokens_per_s"] for r in fmt_runs),
                "max_running": max(r["max_running"] for r in fmt_runs),
                "preemptions": median(r["preemptions"] for r in fmt_runs),
            }
        row["fp8_over_bf16"] = spread(
            f["tokens_per_s"] / b["tokens_per_s"] for b, f in zip(*runs, strict=True)
        )
        # Per CPU second: what the formats cost the processor, without the time other work took from us.
        row["fp8_over_bf16_cpu"] = spread(
            f["tokens_per_cpu_s"] / b["tokens_per_cpu_s"] for b, f in zip(*runs, strict=True)
        )
        row["fp8_over_bf16_decode"] = spread(
            f["decode_tokens_per_s"] / b["decode_tokens_per_s"] for b, f in zip(*runs, strict=True)
        )
        rows.append(row)
    capacity = {
        fmt: {k: e.stats()[k] for k in ("kv_capacity_tokens", "kv_cache_bytes", "kv_bytes_per_token")}
        for fmt, e in zip(KV_FORMATS, engines, strict=True)
    }
    peaks = {fmt: max(r[fmt]["tokens_per_s"] for r in rows) for fmt in KV_FORMATS}
    request_tokens = kv.round_up(prompt_tokens + max_tokens, config.page_size)  # whole pages per request
    return {
        "results": rows,
        "capacity": capacity,
        "requests_that_fit": {fmt: c["kv_capacity_tokens"] // request_tokens for fmt, c in capacity.items()},
        "peak_tokens_per_s": peaks,
        "peak_ratio_fp8_over_bf16": round(peaks["fp8_e4m3"] / peaks["bf16"], 3),
    }


def _run_batch(engine, prompts: list[list[int]], params) -> dict:
    """Run a closed batch to completion, sampling the engine's counters after every step."""
    outputs = kv.collect(engine, prompts, params)
    before = engine.stats()
    previous = before
    max_running = 0  # admitted requests holding pages, sampled after every step
    decode_tokens, decode_s = 0, 0.0
    start, start_cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        step_start = time.perf_counter()
        engine.step()
        step_s = time.perf_counter() - step_start
        now = engine.stats()
        max_running = max(max_running, now["running"])
        generated = now["generated_tokens"] - previous["generated_tokens"]
        if generated and generated == now["computed_tokens"] - previous["computed_tokens"]:
            decode_tokens += generated
            decode_s += step_s
        previous = now
    elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    outputs.raise_failed()
    tokens = sum(map(len, outputs.values()))
    return {
        "tokens_per_s": tokens / elapsed,
        "tokens_per_cpu_s": tokens / elapsed_cpu,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "max_running": max_running,
        "preemptions": previous["preemptions"] - before["preemptions"],
    }


def kv_formats_table(report: dict) -> list:
    s = report["settings"]
    table = Table(
        title=f"KV formats under one {s['kv_budget_bytes'] / 2**20:.1f} MiB budget: {report['model']}, "
        f"{report['dtype']}, {s['prompt_tokens']} prompt + {s['max_tokens']} output tokens, {s['reps']} reps"
    )
    columns = [
        "concurrency",
        "bf16 tok/s",
        "fp8 tok/s",
        "fp8/bf16 [min, max]",
        "fp8/bf16 per CPU s",
        "decode tok/s bf16 / fp8",
        "decode fp8/bf16",
        "max running bf16 / fp8",
        "preemptions bf16 / fp8",
    ]
    for col in columns:
        table.add_column(escape(col), justify="right")
    for r in report["results"]:
        b, f = r["bf16"], r["fp8_e4m3"]
        table.add_row(
            str(r["concurrency"]),
            f"{b['tokens_per_s']:.1f}",
            f"{f['tokens_per_s']:.1f}",
            format_ratio(r["fp8_over_bf16"]),
            format_ratio(r["fp8_over_bf16_cpu"]),
            f"{b['decode_tokens_per_s']:.1f} / {f['decode_tokens_per_s']:.1f}",
            format_ratio(r["fp8_over_bf16_decode"]),
            f"{b['max_running']} / {f['max_running']}",
            f"{b['preemptions']:g} / {f['preemptions']:g}",
        )
    cap, fit = report["capacity"], report["requests_that_fit"]
    return [
        table,
        "KV capacity: "
        + ", ".join(
            f"{fmt} {cap[fmt]['kv_capacity_tokens']} tokens ({fit[fmt]} whole requests)" for fmt in cap
        )
        + f"; peak tok/s fp8/bf16 = {report['peak_ratio_fp8_over_bf16']:.2f}x",
    ]
