"""``tessera bench gguf``: a GGUF checkpoint per weight format: load time (a fresh process's first load, then a
second load in the same process), resident memory (the process's growth from loading the engine and serving
one request, with a 16 MiB KV cache; imports excluded), and decode tokens/s at each concurrency.

Every (format, repeat) runs in its own process, formats interleaved repeat by repeat, so each process's memory
is its own and a slow moment of the machine lands on every format alike. Ratios are paired by repeat against
the first format.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
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
    config = EngineConfig(dtype=dtype, weights=weights, prefix_cache=False, kv_budget_bytes=KV_BUDGET)
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
    return report


if __name__ == "__main__":
    path, weights, dtype, concurrency, tokens = sys.argv[1:6]
    result = measure(Path(path), weights, dtype, [int(c) for c in concurrency.split(",")], int(tokens))
    print(json.dumps(result))
