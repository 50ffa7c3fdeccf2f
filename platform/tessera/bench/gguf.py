"""``tessera bench gguf``: a GGUF checkpoint per weight format: load time (a fresh process's first load, then a
second load in the same process), resident memory (the process's growth from loading the engine and serving
one request, with a 16 MiB KV cache; imports excluded), and decode tokens/s at each concurrency; at one request, the decode step's median time against the time its
linear layers alone take in the same process (every linear the step calls, the output projection included,
on the inputs it gave them), on wall-clock time and on the thread's CPU time.

Every (format, repeat) runs in its own process, formats interleaved repeat by repeat, so each process's memory
is its own and a slow moment of the machine lands on every format alike. Ratios are paired by repeat against
the first format.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tessera.bench.stats import format_interval, mean_interval, ratio_interval

KV_BUDGET = 16 * 2**20  # the KV cache inside the resident reading: 16 MiB, whatever the format
_PROMPT = "Tell me a long story about a dragon who learns to bake bread."


def measure(model: Path, weights: str, dtype: str, concurrency: list[int], tokens: int) -> dict:
    """One process's numbers for one format (run by ``python -m tessera.bench.gguf``)."""
    import psutil
    import torch

    import gpu_workers.engine  # noqa: F401 - imported before the first reading: code is not the model
    from gpu_workers import Engine, EngineConfig, SamplingParams

    process = psutil.Process()
    # "<weights>+invariant": the same weights on a batch-invariant engine (engine/invariance.py)
    weights, _, mode = weights.partition("+")
    config = EngineConfig(
        dtype=dtype,
        weights=weights,
        prefix_cache=False,
        kv_budget_bytes=KV_BUDGET,
        batch_invariant=mode == "invariant",
    )
    rss_before = process.memory_info().rss
    started = time.perf_counter()
    engine = Engine.from_pretrained(model, config)
    cold = time.perf_counter() - started
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": _PROMPT}])
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    # One request first: kernels compiled and every lazily prepared weight (the CPU int4 pack) made, so the
    # reading holds what serving holds.
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0))
    resident = process.memory_info().rss - rss_before
    started = time.perf_counter()
    Engine.from_pretrained(model, config)
    warm = time.perf_counter() - started
    profile = step_profile(engine, prompt, tokens) if 1 in concurrency else {}
    rates = {}
    for n in concurrency:
        started = time.perf_counter()
        outputs = engine.generate([prompt] * n, params)
        rates[str(n)] = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started)
    return {
        "weights": weights,
        "dtype": str(engine.config.torch_dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cold_load_s": cold,
        "warm_load_s": warm,
        "resident_mib": resident / 2**20,
        "tok_s": rates,
        **profile,
    }


def step_profile(engine, prompt: list[int], tokens: int) -> dict:
    """One request's median decode step (``Engine.step``: scheduling, forward, sampling, detokenising), the
    median time of the step's linear layers alone (each linear module called once per decode step, recorded
    by a forward hook on one step, then called again on its recorded input, all of them in a row, after each
    step), and the median of their ratio step by step."""
    import statistics

    import torch

    from gpu_workers import SamplingParams
    from gpu_workers.kernels.packed_linear import PackedLinear
    from gpu_workers.quant.linear import Fp8Linear, Int4Linear

    engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    engine.step()  # the prompt
    calls: list[tuple[Callable, torch.Tensor]] = []
    kinds = (torch.nn.Linear, PackedLinear, Fp8Linear, Int4Linear)
    model = engine.runner.model
    hooks = [
        m.register_forward_hook(lambda m, args, out: calls.append((m, args[0].clone())))
        for m in model.modules()
        if isinstance(m, kinds) and m is not model.lm_head
    ]
    # The output projection through compute_logits (a tied embedding is no module of its own): one row.
    compute_logits = model.compute_logits

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        calls.append((compute_logits, hidden.clone()))
        return compute_logits(hidden)

    model.compute_logits = logits
    engine.step()
    for hook in hooks:
        hook.remove()
    del model.compute_logits
    # Each step followed by one pass of its linears: a busy machine slows both alike, and the ratio is taken
    # pair by pair; on wall-clock time and on the thread's own CPU time (what other processes' load moves
    # least: time spent waiting for a core is not counted).
    steps, linears, step_cpu, linear_cpu = [], [], [], []
    while engine.has_unfinished():
        started, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        steps.append(time.perf_counter() - started)
        step_cpu.append(time.thread_time() - cpu)
        started, cpu = time.perf_counter(), time.thread_time()
        with torch.inference_mode():
            for module, x in calls:
                module(x)
        linears.append(time.perf_counter() - started)
        linear_cpu.append(time.thread_time() - cpu)
    step, linear = statistics.median(steps), statistics.median(linears)
    ratio = statistics.median(s / x for s, x in zip(steps, linears, strict=True))
    ratio_cpu = statistics.median(s / x for s, x in zip(step_cpu, linear_cpu, strict=True) if x > 0)
    return {
        "step_ms": step * 1e3,
        "linear_ms": linear * 1e3,
        "step_vs_linear": ratio,
        "step_cpu_ms": statistics.median(step_cpu) * 1e3,
        "step_vs_linear_cpu": ratio_cpu,
        "linears": len(calls),
    }


def run_gguf_bench(
    model: Path,
    formats: list[str],
    dtype: str,
    concurrency: list[int],
    tokens: int,
    repeat: int,
    as_json: bool,
) -> dict:
    runs: dict[str, list[dict]] = {f: [] for f in formats}
    for r in range(repeat):
        for weights in formats if r % 2 == 0 else formats[::-1]:
            command = [sys.executable, "-m", "tessera.bench.gguf", str(model), weights, dtype, ",".join(map(str, concurrency)), str(tokens)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"bench process for {weights} failed:\n{done.stderr[-2000:]}")
            runs[weights].append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = formats[0]
    report: dict = {"model": str(model), "repeat": repeat, "tokens": tokens, "formats": {}}
    for weights, rows in runs.items():
        entry = {
            "dtype": rows[0]["dtype"],
            "threads": rows[0]["threads"],
            "cold_load_s": mean_interval([x["cold_load_s"] for x in rows]),
            "warm_load_s": mean_interval([x["warm_load_s"] for x in rows]),
            "resident_mib": mean_interval([x["resident_mib"] for x in rows]),
            "tok_s": {},
        }
        for n in map(str, concurrency):
            values = [x["tok_s"][n] for x in rows]
            entry["tok_s"][n] = {
                "mean": mean_interval(values),
                "runs": [round(v, 1) for v in values],
                f"vs_{base}": ratio_interval(values, [x["tok_s"][n] for x in runs[base]]),
            }
        if "step_ms" in rows[0]:
            entry["linears"] = rows[0]["linears"]
            for key in ("step_ms", "linear_ms", "step_vs_linear", "step_cpu_ms", "step_vs_linear_cpu"):
                entry[key] = {
                    "mean": mean_interval([x[key] for x in rows]),
                    "runs": [round(x[key], 2) for x in rows],
                }
        report["formats"][weights] = entry
    if as_json:
        print(json.dumps(report, indent=2))
        return report
    for weights, e in report["formats"].items():
        print(f"{weights} ({e['dtype']}, {e['threads']} threads): load cold {format_interval(e['cold_load_s'], '.2f', ' s')}, "
              f"warm {format_interval(e['warm_load_s'], '.2f', ' s')}; resident {format_interval(e['resident_mib'], '.0f', ' MiB')}")  # fmt: skip
        for n, t in e["tok_s"].items():
            ratio = t[f"vs_{base}"]
            print(f"  {n:>3} requests: {format_interval(t['mean'], '.1f', ' tok/s')}  x{format_interval(ratio, '.2f')} vs {base}  runs {t['runs']}")  # fmt: skip
        if "step_ms" in e:
            print(f"  decode step at 1 request: {format_interval(e['step_ms']['mean'], '.2f', ' ms')}, its linears alone "
                  f"{format_interval(e['linear_ms']['mean'], '.2f', ' ms')}: x{format_interval(e['step_vs_linear']['mean'], '.2f')}  "
                  f"runs {e['step_vs_linear']['runs']}; on thread CPU time x{format_interval(e['step_vs_linear_cpu']['mean'], '.2f')}  "
                  f"runs {e['step_vs_linear_cpu']['runs']}")  # fmt: skip
    return report


if __name__ == "__main__":
    path, weights, dtype, concurrency, tokens = sys.argv[1:6]
    result = measure(Path(path), weights, dtype, [int(c) for c in concurrency.split(",")], int(tokens))
    print(json.dumps(result))
