"""``tessera bench grammar-engine``: what a grammar costs inside the engine's decode step, on a real model.

Per batch size: a batch of unconstrained rows, a batch whose rows all follow a grammar (a JSON object's string that never
closes) and a batch of half and half; each decodes a fixed number of steps with every row alive throughout
(end-of-sequence ignored). Reported: the engine's
mask per step (``Grammars.mask``: the matchers' masks, unpacked and applied, timed as the engine calls it),
the decode step's median time, and each variant's step time over the unconstrained batch's, paired by
repeat; variants are interleaved, so machine load lands on all alike.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from tessera.bench.stats import format_interval, mean_interval, ratio_interval

VARIANTS = ("none", "half", "all")
# A JSON object's opening and one string that never closes: the row stays constrained (and alive) for every
# measured step, its mask the one a JSON string's content has.
OPENING = json.dumps('{"story": "')
GRAMMAR = "\n".join(["%llguidance {}", "start: " + OPENING + " TEXT", r'TEXT: /[^"\\\n]*/'])


def run_grammar_engine_bench(
    model: Path, rows: list[int], steps: int = 48, repeat: int = 3, weights: str = "auto"
) -> dict:
    from gpu_workers import Engine, EngineConfig, SamplingParams
    from gpu_workers.protocol import Grammar

    engine = Engine.from_pretrained(model, EngineConfig(weights=weights, max_num_seqs=max(rows)))
    grammar = Grammar("lark", GRAMMAR)
    masks: list[tuple[int, float]] = []  # (constrained rows, seconds) per engine call
    mask = engine.grammars.mask

    def timed_mask(logits, matchers):
        start = time.perf_counter()
        out = mask(logits, matchers)
        constrained = sum(m is not None for m in matchers)
        if constrained:
            masks.append((constrained, time.perf_counter() - start))
        return out

    engine.grammars.mask = timed_mask

    def run(n: int, variant: str) -> float:
        """Median decode-step time (seconds) of ``n`` rows, the first ``constrained`` under the schema."""
        constrained = {"none": 0, "half": n // 2, "all": n}[variant]
        for i in range(n):
            params = SamplingParams(
                max_tokens=steps + 1, temperature=0.8, seed=i, ignore_eos=True,
                grammar=grammar if i < constrained else None,
            )  # fmt: skip
            engine.add_request(f"Tell a long story about a lighthouse keeper, number {i}.", params)
        times = []
        engine.step()  # the prefill step
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:-1])

    engine.generate(["warm up"], SamplingParams(max_tokens=4, grammar=grammar))
    report: dict = {"model": str(model), "steps": steps, "repeat": repeat, "weights": weights, "rows": {}}
    for n in rows:
        variants = [v for v in VARIANTS if not (v == "half" and n < 2)]
        step: dict[str, list[float]] = {v: [] for v in variants}
        mask_s: list[float] = []
        for r in range(repeat):
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                masks.clear()
                step[v].append(run(n, v))
                if v == "all":
                    mask_s.append(statistics.median(t for k, t in masks if k == n))
        report["rows"][n] = {
            "mask_ms": mean_interval([1000 * t for t in mask_s]),
            "step_ms": {v: mean_interval([1000 * t for t in step[v]]) for v in variants},
            "vs_none": {v: ratio_interval(step[v], step["none"]) for v in variants if v != "none"},
        }
    return report


def format_report(report: dict) -> str:
    lines = [
        f"{report['model']} ({report['weights']} weights), {report['steps']} steps, {report['repeat']} repeats"
    ]
    for n, r in report["rows"].items():
        lines.append(f"{n} rows: mask per step {format_interval(r['mask_ms'], '.3f', ' ms')}")
        for v, s in r["step_ms"].items():
            ratio = r["vs_none"].get(v)
            vs = f", {format_interval(ratio, '.3f')}x of none" if ratio else ""
            lines.append(f"  step, grammar rows {v}: {format_interval(s, '.1f', ' ms')}{vs}")
    return "\n".join(lines)
