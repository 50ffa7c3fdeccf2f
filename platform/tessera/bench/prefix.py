"""``tessera bench prefix``: time to first token with the prefix cache, hit vs miss.

One tenant sends a long system prompt with short different suffixes (its first request misses, later
ones hit), then another tenant sends the same system prompt, which must miss: the cache is per tenant.
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


def run_prefix(
    model_dir: Path,
    config,
    threads: int | None,
    system_tokens: int,
    suffix_tokens: int,
    rounds: int,
    as_json: bool,
) -> None:
    model, tokenizer = kv.load(model_dir, config, threads)
    with progress(rounds) as advance:
        results = measure_prefix(model, tokenizer, config, system_tokens, suffix_tokens, rounds, advance)
    settings = {"system_tokens": system_tokens, "suffix_tokens": suffix_tokens}
    report = kv.report("prefix", model_dir, config, settings | {"rounds": rounds}, results)
    print_report(report, as_json, prefix_table)


def measure_prefix(
    model,
    tokenizer,
    config,
    system_tokens: int,
    suffix_tokens: int,
    rounds: int,
    advance: Callable[[], None] = lambda: None,
) -> dict:
    """TTFT of single requests on an idle engine: a tenant's first request, its later ones, another tenant.

    Every round uses fresh tenant names, so its first request is a true miss; misses and hits alternate.
    """
    from gpu_workers import Engine

    engine = Engine(model, tokenizer, replace(config, prefix_cache=True))
    rng = random.Random(0)
    vocab = model.config.vocab_size
    system = kv.ids(rng, system_tokens, vocab)

    def request(tenant: str) -> dict:
        return _time_to_first_token(engine, system + kv.ids(rng, suffix_tokens, vocab), tenant)

    request("warm-up")  # one-off costs (allocation, first kernels) are not a miss's cost
    samples: dict[str, list[dict]] = {"miss_first": [], "hit_same_tenant": [], "miss_other_tenant": []}
    speedups = []
    for r in range(rounds):
        first = request(f"tenant-a-{r}")
        hits = [request(f"tenant-a-{r}")]
        other = request(f"tenant-b-{r}")
        hits += [request(f"tenant-a-{r}"), request(f"tenant-b-{r}")]
        samples["miss_first"].append(first)
        samples["miss_other_tenant"].append(other)
        samples["hit_same_tenant"] += hits
        speedups.append(first["ttft_s"] / median(h["ttft_s"] for h in hits))
        advance()
    stats = engine.stats()
    rows = [
        {
            "kind": kind,
            "requests": len(runs),
            "prompt_tokens": runs[0]["prompt_tokens"],
            "cached_tokens": sorted({r["cached_tokens"] for r in runs}),
            "ttft_ms": spread(1e3 * r["ttft_s"] for r in runs),
        }
        for kind, runs in samples.items()
    ]
    return {
        "results": rows,
        "miss_over_hit_ttft": spread(speedups),
        "prefix_cache_query_tokens": stats["prefix_cache_query_tokens"],
        "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
    }


def _time_to_first_token(engine, prompt: list[int], tenant: str) -> dict:
    """From add_request to the event carrying the first token, on an otherwise idle engine."""
    first_token_at: list[float] = []
    outputs = kv.Outputs()

    def on_event(event) -> None:
        outputs.record(0, event)
        if event.token_ids and not first_token_at:
            first_token_at.append(time.perf_counter())

    hits_before = engine.stats()["prefix_cache_hit_tokens"]
    start = time.perf_counter()
    engine.add_request(prompt, kv.greedy(2), tenant=tenant, on_event=on_event)
    while engine.has_unfinished():
        engine.step()
    outputs.raise_failed()
    return {
        "ttft_s": first_token_at[0] - start,
        "prompt_tokens": len(prompt),
        # The engine runs only this request, so its counter's growth is this request's cached_tokens.
        "cached_tokens": engine.stats()["prefix_cache_hit_tokens"] - hits_before,
    }


def prefix_table(report: dict) -> list:
    s = report["settings"]
    table = Table(
        title=f"prefix cache TTFT: {report['model']}, {report['dtype']}, {s['system_tokens']}-token system "
        f"prompt + {s['suffix_tokens']}-token suffix, {s['rounds']} rounds"
    )
    for col in ["request", "requests", "prompt tokens", "cached tokens", "TTFT ms (median [min, max])"]:
        table.add_column(escape(col), justify="right")
    labels = {
        "miss_first": "tenant's first (miss)",
        "hit_same_tenant": "same tenant again (hit)",
        "miss_other_tenant": "other tenant, same prompt (miss)",
    }
    for r in report["results"]:
        ttft = r["ttft_ms"]
        table.add_row(
            labels[r["kind"]],
            str(r["requests"]),
            str(r["prompt_tokens"]),
            ", ".join(map(str, r["cached_tokens"])),
            f"{ttft['median']:.1f} [{ttft['min']:.1f}, {ttft['max']:.1f}]",
        )
    ratio = report["miss_over_hit_ttft"]
    return [
        table,
        f"miss/hit TTFT per round: {format_ratio(ratio)}; the prefix cache served "
        f"{report['prefix_cache_hit_tokens']} of {report['prefix_cache_query_tokens']} prompt tokens",
    ]
