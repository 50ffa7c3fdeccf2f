"""``tessera bench integrity|prefix|kv-formats``: what the KV cache's features cost and buy, measured.

Each bench loads the checkpoint once and runs its variants on engines that share those weights,
interleaved in one run (alternating which goes first), so that load from other processes hits every
variant alike. Tables report medians with their spread over repetitions; ``--json`` prints the raw report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import date
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

FIRST_ID = 16  # below this the demo and most vocabularies keep special tokens
KV_FORMATS = ("bf16", "fp8_e4m3")


def add_commands(benches: argparse._SubParsersAction) -> None:
    """Register ``integrity``, ``prefix`` and ``kv-formats`` under ``tessera bench``."""
    from tessera.cli import parse_ids

    integrity = benches.add_parser(
        "integrity",
        help="KV integrity check on vs off: output tokens/s and p50/p95 step time",
        description="Same greedy requests on two engines, one checking page generations before every "
        "step and one not, stepped alternately so both see the same machine load.",
    )
    _common_args(integrity)
    integrity.add_argument(
        "--concurrency", type=parse_ids, default=[1, 8, 32], metavar="1,8,32", help="concurrent requests"
    )
    integrity.add_argument(
        "--prompt-tokens", type=int, default=256, help="longest prompt; prompts span half to all of it"
    )
    integrity.add_argument(
        "--max-tokens", type=int, default=32, help="output tokens per request (default 32)"
    )
    integrity.add_argument("--reps", type=int, default=5, help="repetitions per concurrency (default 5)")
    integrity.set_defaults(func=cmd_integrity)

    prefix = benches.add_parser(
        "prefix",
        help="prefix cache: time to first token, hit vs miss, on a long shared system prompt",
        description="One tenant sends a long system prompt with short different suffixes (first request "
        "misses, later ones hit), then another tenant sends the same system prompt (must miss).",
    )
    _common_args(prefix)
    prefix.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt (default 1024)")
    prefix.add_argument("--suffix-tokens", type=int, default=32, help="user part of each prompt (default 32)")
    prefix.add_argument("--rounds", type=int, default=10, help="rounds, each with fresh tenants (default 10)")
    prefix.set_defaults(func=cmd_prefix)

    formats = benches.add_parser(
        "kv-formats",
        help="FP8-e4m3 vs BF16 KV cache: decode tokens/s per concurrency under one KV budget",
        description="Both formats get the same kv_budget_bytes, sized so that BF16 runs out of pages "
        "below the highest concurrency while FP8, at half the bytes per token, keeps admitting.",
    )
    _common_args(formats, budget_help="bytes of KV cache for both formats (default: see --fit-requests)")
    formats.add_argument(
        "--concurrency",
        type=parse_ids,
        default=[1, 8, 16, 32, 64],
        metavar="1,8,16,32,64",
        help="concurrent requests",
    )
    formats.add_argument("--prompt-tokens", type=int, default=192, help="prompt length (default 192)")
    formats.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    formats.add_argument(
        "--fit-requests",
        type=int,
        default=40,
        help="without --kv-budget-bytes, size the budget so BF16 holds this many whole requests (default 40)",
    )
    formats.add_argument("--reps", type=int, default=2, help="repetitions per concurrency (default 2)")
    formats.set_defaults(func=cmd_kv_formats)


def _common_args(parser: argparse.ArgumentParser, budget_help: str = "bytes of KV cache (default 256 MiB)"):
    parser.add_argument("--model", required=True, type=Path, help="checkpoint folder (HF layout)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    parser.add_argument("--kv-budget-bytes", type=int, help=budget_help)
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's choice); on a small machine shared with other work, 1 "
        "avoids threads waiting on each other while one is descheduled",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


# -- the commands ---------------------------------------------------------------------------------


def cmd_integrity(args: argparse.Namespace) -> None:
    _require_positive(args, "concurrency", "prompt_tokens", "max_tokens", "reps")
    model, tokenizer, config = _load(args)
    with _progress(len(args.concurrency) * args.reps) as advance:
        results = measure_integrity(
            model,
            tokenizer,
            config,
            args.concurrency,
            args.prompt_tokens,
            args.max_tokens,
            args.reps,
            advance,
        )
    settings = {"prompt_tokens": [args.prompt_tokens // 2, args.prompt_tokens], "max_tokens": args.max_tokens}
    _report(args, "integrity", config, settings | {"reps": args.reps}, results, _integrity_table)


def cmd_prefix(args: argparse.Namespace) -> None:
    _require_positive(args, "system_tokens", "suffix_tokens", "rounds")
    model, tokenizer, config = _load(args)
    with _progress(args.rounds) as advance:
        results = measure_prefix(
            model, tokenizer, config, args.system_tokens, args.suffix_tokens, args.rounds, advance
        )
    settings = {"system_tokens": args.system_tokens, "suffix_tokens": args.suffix_tokens}
    _report(args, "prefix", config, settings | {"rounds": args.rounds}, results, _prefix_table)


def cmd_kv_formats(args: argparse.Namespace) -> None:
    _require_positive(args, "concurrency", "prompt_tokens", "max_tokens", "fit_requests", "reps")
    model, tokenizer, config = _load(args)
    if args.kv_budget_bytes is None:
        import torch

        per_request = _round_up(args.prompt_tokens + args.max_tokens, config.page_size)
        bytes_per_token = model.kv_spec.bytes_per_token(torch.bfloat16)
        config = replace(config, kv_budget_bytes=args.fit_requests * per_request * bytes_per_token)
    with _progress(len(args.concurrency) * args.reps * len(KV_FORMATS)) as advance:
        results = measure_kv_formats(
            model,
            tokenizer,
            config,
            args.concurrency,
            args.prompt_tokens,
            args.max_tokens,
            args.reps,
            advance,
        )
    settings = {
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "kv_budget_bytes": config.kv_budget_bytes,
        "reps": args.reps,
    }
    _report(args, "kv-formats", config, settings, results, _kv_formats_table)


# -- measurements (engines in, plain dicts out) ---------------------------------------------------


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
    _lockstep(engines, [_ids(rng, 16, vocab)], _greedy(4), 0, check_timer)  # one-off costs
    rows = []
    for n in concurrency:
        prompts = [_ids(rng, rng.randint(max(1, prompt_tokens // 2), prompt_tokens), vocab) for _ in range(n)]
        runs = []
        mismatches_before = engines[1].stats()["integrity_mismatches"]
        for rep in range(reps):
            runs.append(_lockstep(engines, prompts, _greedy(max_tokens), rep % 2, check_timer))
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
                "tokens_per_s_off": _median(tokens / sum(s) for s in off),
                "tokens_per_s_on": _median(tokens / sum(s) for s in on),
                "throughput_change_pct": _spread(
                    100 * (sum(a) / sum(b) - 1) for a, b in zip(off, on, strict=True)
                ),
                "p50_step_ms_off": _median(1e3 * _quantile(s, 0.5) for s in off),
                "p50_step_ms_on": _median(1e3 * _quantile(s, 0.5) for s in on),
                "p95_step_ms_off": _median(1e3 * _quantile(s, 0.95) for s in off),
                "p95_step_ms_on": _median(1e3 * _quantile(s, 0.95) for s in on),
                "p95_change_pct": _spread(
                    100 * (_quantile(b, 0.95) / _quantile(a, 0.95) - 1) for a, b in zip(off, on, strict=True)
                ),
                "paired_step_change_pct": _quartiles(paired),
                # The same pairing in CPU time: on a shared machine the steadiest estimate of the cost.
                "paired_step_cpu_change_pct": _quartiles(paired_cpu),
                # Time inside the tracker itself (the batched compare plus tagging new pages), and its
                # share of the step it ran in: the overhead with little of the machine's noise in it.
                "check_us_per_step": round(1e6 * _quantile(check, 0.5), 1),
                "check_us_per_step_p95": round(1e6 * _quantile(check, 0.95), 1),
                "check_share_pct": round(100 * _quantile(check_share, 0.5), 3),
                "integrity_mismatches": engines[1].stats()["integrity_mismatches"] - mismatches_before,
                "identical_outputs": all(r["identical"] for r in runs),
            }
        )
    return {"results": rows}


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
    system = _ids(rng, system_tokens, vocab)

    def request(tenant: str) -> dict:
        return _time_to_first_token(engine, system + _ids(rng, suffix_tokens, vocab), tenant)

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
        speedups.append(first["ttft_s"] / _median(h["ttft_s"] for h in hits))
        advance()
    stats = engine.stats()
    rows = [
        {
            "kind": kind,
            "requests": len(runs),
            "prompt_tokens": runs[0]["prompt_tokens"],
            "cached_tokens": sorted({r["cached_tokens"] for r in runs}),
            "ttft_ms": _spread(1e3 * r["ttft_s"] for r in runs),
        }
        for kind, runs in samples.items()
    ]
    return {
        "results": rows,
        "miss_over_hit_ttft": _spread(speedups),
        "prefix_cache_query_tokens": stats["prefix_cache_query_tokens"],
        "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
    }


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
        _run_batch(engine, [_ids(rng, 16, vocab)], _greedy(4))  # one-off costs
    rows = []
    for n in concurrency:
        prompts = [_ids(rng, prompt_tokens, vocab) for _ in range(n)]
        runs: list[list[dict]] = [[] for _ in engines]
        for rep in range(reps):
            order = range(len(engines)) if rep % 2 == 0 else reversed(range(len(engines)))
            for k in order:
                runs[k].append(_run_batch(engines[k], prompts, _greedy(max_tokens)))
                advance()
        row: dict = {"concurrency": n}
        for fmt, fmt_runs in zip(KV_FORMATS, runs, strict=True):
            row[fmt] = {
                "tokens_per_s": _median(r["tokens_per_s"] for r in fmt_runs),
                "decode_tokens_per_s": _median(r["decode_tokens_per_s"] for r in fmt_runs),
                "max_running": max(r["max_running"] for r in fmt_runs),
                "preemptions": _median(r["preemptions"] for r in fmt_runs),
            }
        row["fp8_over_bf16"] = _spread(
            f["tokens_per_s"] / b["tokens_per_s"] for b, f in zip(*runs, strict=True)
        )
        # Per CPU second: what the formats cost the processor, without the time other work took from us.
        row["fp8_over_bf16_cpu"] = _spread(
            f["tokens_per_cpu_s"] / b["tokens_per_cpu_s"] for b, f in zip(*runs, strict=True)
        )
        row["fp8_over_bf16_decode"] = _spread(
            f["decode_tokens_per_s"] / b["decode_tokens_per_s"] for b, f in zip(*runs, strict=True)
        )
        rows.append(row)
    capacity = {
        fmt: {k: e.stats()[k] for k in ("kv_capacity_tokens", "kv_cache_bytes", "kv_bytes_per_token")}
        for fmt, e in zip(KV_FORMATS, engines, strict=True)
    }
    peaks = {fmt: max(r[fmt]["tokens_per_s"] for r in rows) for fmt in KV_FORMATS}
    request_tokens = _round_up(prompt_tokens + max_tokens, config.page_size)  # whole pages per request
    return {
        "results": rows,
        "capacity": capacity,
        "requests_that_fit": {fmt: c["kv_capacity_tokens"] // request_tokens for fmt, c in capacity.items()},
        "peak_tokens_per_s": peaks,
        "peak_ratio_fp8_over_bf16": round(peaks["fp8_e4m3"] / peaks["bf16"], 3),
    }


# -- running requests --------------------------------------------------------------------------------


def _lockstep(engines: list, prompts: list[list[int]], params, first: int, timer: _CallTimer) -> dict:
    """The same requests on both engines, stepped in turn (who goes first alternates every step).

    Returns each engine's step times (wall clock, and this process's CPU time, which a process
    descheduled by other work does not accrue), the seconds ``timer`` counted inside each step of the
    second engine, and whether the two engines' greedy outputs agree.
    """
    outputs = [_collect(engine, prompts, params) for engine in engines]
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
    if len(steps[0]) != len(steps[1]):
        raise RuntimeError(f"the engines took different numbers of steps ({[len(s) for s in steps]})")
    return {
        "steps": steps,
        "cpu": cpu,
        "inner": inner,
        "output_tokens": sum(map(len, outputs[0].values())),
        "identical": outputs[0] == outputs[1],
    }


def _run_batch(engine, prompts: list[list[int]], params) -> dict:
    """Run a closed batch to completion, sampling the engine's counters after every step."""
    outputs = _collect(engine, prompts, params)
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
    tokens = sum(map(len, outputs.values()))
    return {
        "tokens_per_s": tokens / elapsed,
        "tokens_per_cpu_s": tokens / elapsed_cpu,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "max_running": max_running,
        "preemptions": previous["preemptions"] - before["preemptions"],
    }


def _collect(engine, prompts: list[list[int]], params) -> dict[int, list[int]]:
    """Add the prompts as requests; the returned dict fills with each request's tokens as they arrive."""
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

    def on_event(event, out: list[int]) -> None:
        _check(event)
        out.extend(event.token_ids)

    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, on_event=lambda event, out=outputs[i]: on_event(event, out))
    return outputs


def _time_to_first_token(engine, prompt: list[int], tenant: str) -> dict:
    """From add_request to the event carrying the first token, on an otherwise idle engine."""
    first_token_at: list[float] = []

    def on_event(event) -> None:
        _check(event)
        if event.token_ids and not first_token_at:
            first_token_at.append(time.perf_counter())

    hits_before = engine.stats()["prefix_cache_hit_tokens"]
    start = time.perf_counter()
    engine.add_request(prompt, _greedy(2), tenant=tenant, on_event=on_event)
    while engine.has_unfinished():
        engine.step()
    return {
        "ttft_s": first_token_at[0] - start,
        "prompt_tokens": len(prompt),
        # The engine runs only this request, so its counter's growth is this request's cached_tokens.
        "cached_tokens": engine.stats()["prefix_cache_hit_tokens"] - hits_before,
    }


def _check(event) -> None:
    """A failed request would make its bench measure something else: stop with the engine's reason."""
    if event.error is not None:
        from tessera.cli import CliError

        raise CliError(f"a benchmark request failed ({event.error.code}): {event.error.message}")


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


# -- helpers ------------------------------------------------------------------------------------------


def _load(args: argparse.Namespace):
    """Model and tokenizer, loaded once for every engine, and the engine config the flags describe."""
    import torch

    from gpu_workers import EngineConfig
    from gpu_workers.model import load_model, load_tokenizer
    from tessera.cli import CliError

    if args.threads is not None:
        if args.threads < 1:
            raise CliError(f"--threads needs a positive integer, got {args.threads}", exit_code=2)
        torch.set_num_threads(args.threads)
    given = {"dtype": args.dtype, "page_size": args.page_size, "kv_budget_bytes": args.kv_budget_bytes}
    try:
        config = EngineConfig(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise CliError(str(exc), exit_code=2) from None
    model = load_model(args.model, dtype=config.torch_dtype, device=config.device, progress=True)
    return model, load_tokenizer(args.model), config


def _require_positive(args: argparse.Namespace, *names: str) -> None:
    from tessera.cli import CliError

    for name in names:
        value = getattr(args, name)
        values = value if isinstance(value, list) else [value]
        if not values or min(values) < 1:
            flag = "--" + name.replace("_", "-")
            raise CliError(f"{flag} needs positive integers, got {value!r}", exit_code=2)


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]


def _greedy(max_tokens: int):
    from gpu_workers import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _round_up(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _quartiles(changes: Sequence[float]) -> dict:
    """Median and quartiles of relative changes, in percent."""
    return {
        name: round(100 * _quantile(changes, q), 2)
        for name, q in (("median", 0.5), ("p25", 0.25), ("p75", 0.75))
    }


def _median(values) -> float:
    return round(statistics.median(list(values)), 3)


def _spread(values) -> dict:
    values = list(values)
    return {"median": _median(values), "min": round(min(values), 3), "max": round(max(values), 3)}


@contextlib.contextmanager
def _progress(total: int):
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("benchmarking", total=total)
        yield lambda: progress.advance(task)


def _report(args, bench: str, config, settings: dict, measured: dict, render: Callable[[dict], list]) -> None:
    import torch

    report = {
        "bench": bench,
        "date": date.today().isoformat(),
        "model": str(args.model),
        "dtype": config.dtype,
        "page_size": config.page_size,
        "machine": f"{os.cpu_count()}-core CPU, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "settings": settings,
        **measured,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    # Piped into a file (as for BENCHMARKS.md) the table keeps its rows whole instead of wrapping at 80.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    for renderable in render(report):
        console.print(renderable)
    console.print(f"{report['machine']}, {report['date']}")


def _pct(spread: dict) -> str:
    return f"{spread['median']:+.2f} [{spread['min']:+.1f}, {spread['max']:+.1f}]"


def _ratio(spread: dict) -> str:
    return f"{spread['median']:.2f}x [{spread['min']:.2f}, {spread['max']:.2f}]"


def _integrity_table(report: dict) -> list:
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
            _pct(r["throughput_change_pct"]),
            f"{r['p50_step_ms_off']:.1f} / {r['p50_step_ms_on']:.1f}",
            f"{r['p95_step_ms_off']:.1f} / {r['p95_step_ms_on']:.1f}",
            _pct(r["p95_change_pct"]),
            f"{paired['median']:+.2f} [{paired['p25']:+.1f}, {paired['p75']:+.1f}]",
            f"{r['check_us_per_step']:.0f} ({r['check_share_pct']:.2f}%)",
            str(r["integrity_mismatches"]) + ("" if r["identical_outputs"] else " (outputs differ!)"),
        )
    return [
        table,
        "Δ: on vs off per repetition (wall clock); paired: step i on vs step i off in CPU time; "
        "check: time inside the tracker and its share of the step",
    ]


def _prefix_table(report: dict) -> list:
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
        f"miss/hit TTFT per round: {_ratio(ratio)}; the prefix cache served "
        f"{report['prefix_cache_hit_tokens']} of {report['prefix_cache_query_tokens']} prompt tokens",
    ]


def _kv_formats_table(report: dict) -> list:
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
            _ratio(r["fp8_over_bf16"]),
            _ratio(r["fp8_over_bf16_cpu"]),
            f"{b['decode_tokens_per_s']:.1f} / {f['decode_tokens_per_s']:.1f}",
            _ratio(r["fp8_over_bf16_decode"]),
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
