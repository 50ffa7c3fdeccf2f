"""``tessera bench integrity``: the KV integrity check on vs off, on identical greedy batches.

The two engines are stepped alternately, step by step, so both see the same machine load and step i of
one pairs with step i of the other; besides wall-clock throughput and step-time quantiles, the report
has the paired step change in CPU time and the time spent inside the tracker itself.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from tessera.bench import kv
from tessera.bench.console import print_report, progress
from tessera.bench.stats import format_pct, median, quantile, quartiles_pct, spread


def run_integrity(
    model_dir: Path,
    config,
    threads: int | None,
    concurrency: list[int],
    prompt_tokens: int,
    max_tokens: int,
    reps: int,
    as_json: bool,
) -> None:
    model, tokenizer = kv.load(model_dir, config, threads)
    with progress(len(concurrency) * reps) as advance:
        results = measure_integrity(
            model, tokenizer, config, concurrency, prompt_tokens, max_tokens, reps, advance
        )
    settings = {"prompt_tokens": [prompt_tokens // 2, prompt_tokens], "max_tokens": max_tokens}
    report = kv.report("integrity", model_dir, config, settings | {"reps": reps}, results)
    print_report(report, as_json, integrity_table)


def measure_integrity(
    model,
    tokenizer,
    config,
    concurrency: list[int],
    prompt_tokens: int,
    max_tokens: int,
    reps: int,
    advance: Callable[[], None] = lambda: None,
) -> dict:
    """Check on vs off on identical greedy batches, the two engines stepped alternately, step by step.

    Both engines see the same batches in the same order, so step i of one pairs with step i of the other.
    The prefix cache is off in both so that every repetition computes the same tokens.
    """
    from gpu_workers import Engine

    engines = [
        Engine(model, tokenizer, replace(config, integrity_check=check, prefix_cache=False))
        for check in (False, True)
    ]
    check_timer = _CallTimer(engines[1].pages.integrity, ("verify", "bump"))
    rng = random.Random(0)
    vocab = model.config.vocab_size
    _lockstep(engines, [kv.ids(rng, 16, vocab)], kv.greedy(4), 0, check_timer)  # one-off costs
    rows = []
    for n in concurrency:
        prompts = [
            kv.ids(rng, rng.randint(max(1, prompt_tokens // 2), prompt_tokens), vocab) for _ in range(n)
        ]
        runs = []
        mismatches_before = engines[1].stats()["integrity_mismatches"]
        for rep in range(reps):
            runs.append(_lockstep(engines, prompts, kv.greedy(max_tokens), rep % 2, check_timer))
            advance()
        off = [r["steps"][0] for r in runs]
        on = [r["steps"][1] for r in runs]
        tokens = runs[0]["output_tokens"]
        paired = [b / a - 1 for r in runs for a, b in zip(*r["steps"], strict=True)]
        paired_cpu = [b / a - 1 for r in runs for a, b in zip(*r["cpu"], strict=True) if a > 0]
        check = [c for r in runs for c in r["inner"]]
        check_share = [c / t for r in runs for c, t in zip(r["inner"], r["steps"][1], strict=True)]
        rows.append(
            {
                "concurrency": n,
                "steps": len(on[0]),
                "output_tokens": tokens,
                "tokens_per_s_off": median(tokens / sum(s) for s in off),
                "tokens_per_s_on": median(tokens / sum(s) for s in on),
                "throughput_change_pct": spread(
                    100 * (sum(a) / sum(b) - 1) for a, b in zip(off, on, strict=True)
                ),
                "p50_step_ms_off": median(1e3 * quantile(s, 0.5) for s in off),
                "p50_step_ms_on": median(1e3 * quantile(s, 0.5) for s in on),
                "p95_step_ms_off": median(1e3 * quantile(s, 0.95) for s in off),
                "p95_step_ms_on": median(1e3 * quantile(s, 0.95) for s in on),
                "p95_change_pct": spread(
                    100 * (quantile(b, 0.95) / quantile(a, 0.95) - 1) for a, b in zip(off, on, strict=True)
                ),
                "paired_step_change_pct": quartiles_pct(paired),
                # The same pairing in CPU time: on a shared machine the steadiest estimate of the cost.
                "paired_step_cpu_change_pct": quartiles_pct(paired_cpu),
                # Time inside the tracker itself (the batched compare plus tagging new pages), and its
                # share of the step it ran in: the overhead with little of the machine's noise in it.
                "check_us_per_step": round(1e6 * quantile(check, 0.5), 1),
                "check_us_per_step_p95": round(1e6 * quantile(check, 0.95), 1),
                "check_share_pct": round(100 * quantile(check_share, 0.5), 3),
                "integrity_mismatches": engines[1].stats()["integrity_mismatches"] - mismatches_before,
                "identical_outputs": all(r["identical"] for r in runs),
            }
        )
    return {"results": rows}


def _lockstep(engines: list, prompts: list[list[int]], params, first: int, timer: _CallTimer) -> dict:
    """The same requests on both engines, stepped in turn (who goes first alternates every step).

    Returns each engine's step times (wall clock, and this process's CPU time, which a process
    descheduled by other work does not accrue), the seconds ``timer`` counted inside each step of the
    second engine, and whether the two engines' greedy outputs agree.
    """
    outputs = [kv.collect(engine, prompts, params) for engine in engines]
    steps: list[list[float]] = [[] for _ in engines]
    cpu: list[list[float]] = [[] for _ in engines]
    inner: list[float] = []
    order = [1, 0] if first else [0, 1]
    while any(engine.has_unfinished() for engine in engines):
        for k in order:
            if engines[k].has_unfinished():
                counted = timer.seconds
                start, start_cpu = time.perf_counter(), time.process_time()
                engines[k].step()
                cpu[k].append(time.process_time() - start_cpu)
                steps[k].append(time.perf_counter() - start)
                if k == 1:
                    inner.append(timer.seconds - counted)
        order.reverse()
    for engine_outputs in outputs:
        engine_outputs.raise_failed()
    if len(steps[0]) != len(steps[1]):
        raise RuntimeError(f"the engines took different numbers of steps ({[len(s) for s in steps]})")
    return {
        "steps": steps,
        "cpu": cpu,
        "inner": inner,
        "output_tokens": sum(map(len, outputs[0].values())),
        "identical": outputs[0] == outputs[1],
    }


class _CallTimer:
    """Adds up the seconds an object spends in the named methods (wrapped on this instance only)."""

    def __init__(self, obj: object, names: Sequence[str]):
        self.seconds = 0.0
        for name in names:
            setattr(obj, name, self._timed(getattr(obj, name)))

    def _timed(self, method: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def integrity_table(report: dict) -> list:
    s = report["settings"]
    table = Table(
        title=f"integrity check off vs on: {report['model']}, {report['dtype']}, prompts "
        f"{s['prompt_tokens'][0]}-{s['prompt_tokens'][1]}, {s['max_tokens']} output tokens, {s['reps']} reps"
    )
    columns = [
        "concurrency",
        "tok/s off",
        "tok/s on",
        "tok/s Δ% [min, max]",
        "p50 step ms off/on",
        "p95 step ms off/on",
        "p95 Δ% [min, max]",
        "paired step CPU Δ% [p25, p75]",
        "check µs/step (share)",
        "mismatches",
    ]
    for col in columns:
        table.add_column(escape(col), justify="right")
    for r in report["results"]:
        paired = r["paired_step_cpu_change_pct"]
        table.add_row(
            str(r["concurrency"]),
            f"{r['tokens_per_s_off']:.1f}",
            f"{r['tokens_per_s_on']:.1f}",
            format_pct(r["throughput_change_pct"]),
            f"{r['p50_step_ms_off']:.1f} / {r['p50_step_ms_on']:.1f}",
            f"{r['p95_step_ms_off']:.1f} / {r['p95_step_ms_on']:.1f}",
            format_pct(r["p95_change_pct"]),
            f"{paired['median']:+.2f} [{paired['p25']:+.1f}, {paired['p75']:+.1f}]",
            f"{r['check_us_per_step']:.0f} ({r['check_share_pct']:.2f}%)",
            str(r["integrity_mismatches"]) + ("" if r["identical_outputs"] else " (outputs differ!)"),
        )
    return [
        table,
        "Δ: on vs off per repetition (wall clock); paired: step i on vs step i off in CPU time; "
        "check: time inside the tracker and its share of the step",
    ]
