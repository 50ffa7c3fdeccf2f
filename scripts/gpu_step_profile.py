"""Where a decode step's time goes on a GPU: wall time per step against the time the GPU spends in kernels.

For each KV format and concurrency: n requests of random prompt ids are prefilled, a few decode steps warm
up, then ``--steps`` decode steps are timed (wall, perf_counter around ``Engine.step``, which returns after
the step's tokens reach the host) and the same number are run under torch.profiler, whose CUDA kernel
records give the GPU's busy time per step and the number of kernels launched. A step whose kernels keep
the GPU busy for a small share of its wall time is bound by the host (Python, launches): that is the
case CUDA graphs (one replay instead of hundreds of launches) are for.

With ``--cuda-graphs both`` every row is measured twice, decode steps eager and replayed from CUDA graphs
(``EngineConfig.cuda_graphs``), alternating.

Usage: python scripts/gpu_step_profile.py MODEL_DIR [--concurrency 1,32,64] [--kv bf16,fp8_e4m3]
       [--steps 20] [--device cuda] [--cuda-graphs off|on|both] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from tessera.bench import kv
from torch.profiler import ProfilerActivity, profile

from gpu_workers import Engine, EngineConfig
from gpu_workers.model import load_model
from gpu_workers.tokenizer import load_tokenizer

PROMPT_TOKENS = 192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--concurrency", default="1,32,64")
    parser.add_argument("--kv", default="bf16,fp8_e4m3")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cuda-graphs", choices=("off", "on", "both"), default="off")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model = load_model(args.model, dtype=getattr(torch, dtype), device=args.device)
    tokenizer = load_tokenizer(args.model)
    rows = []
    graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graphs]
    for fmt in args.kv.split(","):
        engines = {
            flag: Engine(
                model,
                tokenizer,
                EngineConfig(
                    device=args.device,
                    dtype=dtype,
                    kv_cache_dtype=fmt,
                    kv_budget_bytes=4 * 2**30,
                    prefix_cache=False,
                    cuda_graphs=flag,
                ),
            )
            for flag in graphs
        }
        for n in map(int, args.concurrency.split(",")):
            for flag, engine in engines.items():
                row = {
                    "kv": fmt,
                    "concurrency": n,
                    "cuda_graphs": flag,
                    **measure(engine, n, args.steps, args.device),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        del engines
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "results": rows}, indent=2) + "\n")


def measure(engine: Engine, n: int, steps: int, device: str) -> dict:
    rng = random.Random(n)
    vocab = engine.model.config.vocab_size
    prompts = [kv.ids(rng, PROMPT_TOKENS, vocab) for _ in range(n)]
    outputs = kv.collect(engine, prompts, kv.greedy(3 * steps + 16))
    # Every prompt prefilled: from here on each step is one decode token a row.
    while not all(outputs.values()) and not outputs.failures:
        engine.step()
    outputs.raise_failed()
    for _ in range(5):
        engine.step()
    wall = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - start)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # Kernels and copies on the one stream the engine uses: their durations add up without overlap.
    busy_us = sum(e.time_range.elapsed_us() for e in kernels) / steps
    while engine.has_unfinished():
        engine.step()
    step_ms = statistics.median(wall) * 1e3
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    print(
        f"-- {engine.config.kv_cache_dtype} x {n}: top ops by host time over {steps} profiled steps\n{table}"
    )
    return {
        "step_ms": round(step_ms, 3),
        "step_ms_spread": [round(min(wall) * 1e3, 3), round(max(wall) * 1e3, 3)],
        "tokens_per_s": round(n / statistics.median(wall), 1),
        "gpu_busy_ms": round(busy_us / 1e3, 3),
        "gpu_busy_share": round(busy_us / 1e3 / step_ms, 3),
        "device_ops_per_step": len(kernels) / steps,
    }


if __name__ == "__main__":
    main()
