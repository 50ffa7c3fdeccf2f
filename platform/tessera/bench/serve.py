"""``tessera bench serve``: load a running server through its OpenAI streaming API and report serving metrics.

Closed loop (a fixed number of clients, each sending its next request when the last one ends) at each
concurrency, or open loop (arrivals at a request rate: Poisson, or gamma with a burstiness factor, as vLLM's
``bench serve``). Metrics follow vLLM's definitions: TTFT is the time to the first streamed token; TPOT is
``(latency - TTFT) / (output tokens - 1)`` per request; ITL pools every gap between streamed chunks; E2EL is
the whole request. Token counts are the server's own usage, never re-tokenised here.

Prompts are token ids (``/v1/completions`` takes them), so a prompt's length is exact on any tokenizer;
``ignore_eos`` makes every request generate exactly ``output_len`` tokens. Every level of every repeat sends
prompts of its own (a tenant's shared prefix aside), so no level hits pages an earlier one cached.

With ``repeats`` > 1 the levels run in turn once per repeat (1 8 16, 1 8 16, ...), so drift in the machine's
load hits every level alike; a level's fields then pool all its repeats' requests, its ``repeats`` list holds
each repeat's own summary, and ``stats`` the mean of each metric over repeats with a 95% Student-t interval.
The report's layout is ``schemas/serve.schema.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx

from tessera.bench.console import print_report, progress
from tessera.bench.stats import INTERVAL_METHOD, format_interval, mean_interval, quantile

SLO_METRICS = ("ttft", "tpot", "e2el")  # goodput SLOs, in milliseconds
PERCENTILES = (50, 95, 99)
DISTRIBUTIONS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
# What ``stats`` gives an interval for: a summary's field, or "distribution.statistic".
STAT_METRICS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "goodput",
    *(f"{d}.{s}" for d in DISTRIBUTIONS for s in ("mean", *(f"p{p}" for p in PERCENTILES))),
)


@dataclass
class Outcome:
    """One request as the client saw it: its status, timings (seconds) and the server's usage."""

    status: str  # "ok", an HTTP status, or an error class (timeout, disconnected, malformed_chunk, ...)
    latency: float
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    output_cost_usd: float = 0.0  # what the server billed for the output tokens (usage.cost_details)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Workload:
    model: str
    input_len: int
    output_len: int
    shared_prefix_len: int = 0
    vocab: int = 1000  # prompt token ids are drawn from [FIRST_ID, vocab)
    seed: int = 0


FIRST_ID = 10  # below this, ids are often special tokens (BOS, EOS, padding)


def prompts(workload: Workload, count: int, tenants: int) -> list[list[int]]:
    """``count`` prompts of ``input_len`` ids; request i belongs to tenant ``i % tenants``, and a tenant's
    prompts share their first ``shared_prefix_len`` ids (the prefix cache is per tenant)."""
    rng = random.Random(workload.seed)
    prefixes = [
        [rng.randrange(FIRST_ID, workload.vocab) for _ in range(workload.shared_prefix_len)]
        for _ in range(tenants)
    ]
    rest = workload.input_len - workload.shared_prefix_len
    return [
        prefixes[i % tenants] + [rng.randrange(FIRST_ID, workload.vocab) for _ in range(rest)]
        for i in range(count)
    ]


async def send(client: httpx.AsyncClient, api_key: str, workload: Workload, prompt: list[int]) -> Outcome:
    """One streamed completion; every failure becomes an Outcome, never an exception."""
    body = {
        "model": workload.model,
        "prompt": prompt,
        "max_tokens": workload.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    outcome = Outcome(status="ok", latency=0.0)
    last = start
    try:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}
        ) as response:
            if response.status_code != 200:
                await response.aread()
                outcome.status = str(response.status_code)
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        outcome.status = "stream_error"
                        break
                    now = time.perf_counter()
                    if any(choice.get("text") for choice in chunk.get("choices", [])):
                        if outcome.ttft is None:
                            outcome.ttft = now - start
                        else:
                            outcome.itls.append(now - last)
                        last = now
                    if usage := chunk.get("usage"):
                        outcome.prompt_tokens = usage["prompt_tokens"]
                        outcome.output_tokens = usage["completion_tokens"]
                        outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                            "cached_tokens", 0
                        )
                        outcome.output_cost_usd = (usage.get("cost_details") or {}).get("output", 0.0)
    except httpx.TimeoutException:
        outcome.status = "timeout"
    except httpx.TransportError:
        outcome.status = "disconnected"
    except json.JSONDecodeError:
        outcome.status = "malformed_chunk"
    outcome.latency = time.perf_counter() - start
    if outcome.status == "ok" and outcome.ttft is None:
        outcome.status = "no_tokens"
    return outcome


async def closed_loop(
    url: str, keys: list[str], workload: Workload, batch: list[list[int]], concurrency: int, tick
) -> tuple[list[Outcome], float]:
    """``concurrency`` clients draining ``batch`` in order; request i uses key ``i % len(keys)``."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(batch)):
        queue.put_nowait(i)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(600, connect=30), limits=limits
    ) as client:

        async def client_loop() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                outcomes.append(await send(client, keys[i % len(keys)], workload, batch[i]))
                tick()

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return outcomes, time.perf_counter() - start


def arrival_gaps(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between arrivals at ``rate`` per second: gamma(shape=burstiness, scale=1/(rate*burstiness)),
    exponential (Poisson arrivals) at burstiness 1; burstier below 1, more regular above."""
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count)]


async def open_loop(
    url: str,
    keys: list[str],
    workload: Workload,
    batch: list[list[int]],
    rate: float,
    burstiness: float,
    tick,
) -> tuple[list[Outcome], float]:
    """Requests sent at their arrival times, however many are still in flight."""
    gaps = arrival_gaps(len(batch), rate, burstiness, workload.seed)
    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(600, connect=30), limits=httpx.Limits(max_connections=None)
    ) as client:

        async def at(delay: float, i: int) -> Outcome:
            await asyncio.sleep(delay)
            outcome = await send(client, keys[i % len(keys)], workload, batch[i])
            tick()
            return outcome

        start = time.perf_counter()
        arrivals, t = [], 0.0
        for i, gap in enumerate(gaps):
            t += gap
            arrivals.append(at(t, i))
        outcomes = await asyncio.gather(*arrivals)
        return list(outcomes), time.perf_counter() - start


def _distribution(values: list[float]) -> dict | None:
    """Mean and percentiles in milliseconds."""
    if not values:
        return None
    stats = {"mean": 1000 * sum(values) / len(values)}
    stats.update({f"p{p}": 1000 * quantile(values, p / 100) for p in PERCENTILES})
    return {k: round(v, 2) for k, v in stats.items()}


def summarize(outcomes: list[Outcome], duration_s: float, slo_ms: dict[str, float]) -> dict:
    """One load level's metrics, as vLLM's ``bench serve`` defines them."""
    ok = [o for o in outcomes if o.status == "ok"]
    failures: dict[str, int] = {}
    for o in outcomes:
        if o.status != "ok":
            failures[o.status] = failures.get(o.status, 0) + 1
    output = sum(o.output_tokens for o in ok)
    prompt = sum(o.prompt_tokens for o in ok)
    good = [o for o in ok if meets(o, slo_ms)]
    return {
        "requests": len(outcomes),
        "completed": len(ok),
        "failures": failures,
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(ok) / duration_s, 3),
        "output_throughput": round(output / duration_s, 2),
        "total_token_throughput": round((output + prompt) / duration_s, 2),
        "goodput": round(len(good) / duration_s, 3) if slo_ms else None,
        "prompt_tokens": prompt,
        "cached_tokens": sum(o.cached_tokens for o in ok),
        "output_tokens": output,
        "cached_token_share": round(sum(o.cached_tokens for o in ok) / prompt, 4) if prompt else 0.0,
        "ttft_ms": _distribution([o.ttft for o in ok if o.ttft is not None]),
        "tpot_ms": _distribution([o.tpot for o in ok if o.tpot is not None]),
        "itl_ms": _distribution([gap for o in ok for gap in o.itls]),
        "e2el_ms": _distribution([o.latency for o in ok]),
    }


def meets(outcome: Outcome, slo_ms: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (a request too short to have a TPOT meets that one)."""
    values = {"ttft": outcome.ttft, "tpot": outcome.tpot, "e2el": outcome.latency}
    return all(values[name] is None or 1000 * values[name] <= limit for name, limit in slo_ms.items())


def metric(summary: dict, name: str) -> float | None:
    """A summary's figure by ``STAT_METRICS`` name: ``output_throughput``, or ``ttft_ms.p95``."""
    field, _, statistic = name.partition(".")
    value = summary.get(field)
    if statistic:
        return None if value is None else value.get(statistic)
    return value


def repeat_stats(summaries: list[dict], names: tuple[str, ...] = STAT_METRICS) -> dict[str, dict | None]:
    """Per metric, the mean over repeats' summaries with its 95% t-interval (``stats.mean_interval``)."""
    return {name: mean_interval([metric(s, name) for s in summaries]) for name in names}


def run_serve(
    url: str,
    keys: list[str],
    workload: Workload,
    concurrency: list[int] | None,
    request_rate: float | None,
    burstiness: float,
    num_requests: int,
    slo_ms: dict[str, float],
    json_path: Path | None,
    plot_path: Path | None,
    repeats: int = 1,
) -> dict:
    """Every load level in turn against ``url``, ``repeats`` times over; prints the report and returns it."""
    levels = concurrency if concurrency else [None]
    # One draw for every (repeat, level): fresh prompts each time, a tenant's shared prefix the same in all.
    batch = prompts(workload, num_requests * len(levels) * repeats, len(keys))
    runs: dict[int, list[tuple[list[Outcome], float]]] = {i: [] for i in range(len(levels))}
    with progress(num_requests * len(levels) * repeats) as tick:
        for r in range(repeats):
            for i, level in enumerate(levels):
                start = (r * len(levels) + i) * num_requests
                # Prompt j belongs to tenant j % tenants: rotate the keys so the slice's first is its tenant's.
                turn = start % len(keys)
                slice_keys = keys[turn:] + keys[:turn]
                part = batch[start : start + num_requests]
                if level is None:
                    coro = open_loop(url, slice_keys, workload, part, request_rate, burstiness, tick)
                else:
                    coro = closed_loop(url, slice_keys, workload, part, level, tick)
                runs[i].append(asyncio.run(coro))
    results = []
    for i, level in enumerate(levels):
        load = (
            {"concurrency": level}
            if level is not None
            else {"request_rate": request_rate, "burstiness": burstiness}
        )
        summaries = [summarize(outcomes, duration, slo_ms) for outcomes, duration in runs[i]]
        pooled = summarize(
            [o for outcomes, _ in runs[i] for o in outcomes], sum(d for _, d in runs[i]), slo_ms
        )
        results.append({**load, **pooled, "repeats": summaries, "stats": repeat_stats(summaries)})
    report = {
        "url": url,
        "workload": asdict(workload),
        "tenants": len(keys),
        "num_requests": num_requests,
        "repeats": repeats,
        "interval": INTERVAL_METHOD,
        "slo_ms": slo_ms,
        "levels": results,
        "machine": f"client: {os.cpu_count()}-core CPU, Python {sys.version.split()[0]}",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }
    print_report(report, as_json=False, render=_tables)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    if plot_path is not None:
        plot(report, plot_path)
    return report


def _tables(report: dict) -> list:
    from rich.table import Table

    table = Table(title=f"tessera bench serve: {report['url']} {report['workload']['model']}")
    figures = (
        ("req/s", "request_throughput", ".2f"),
        ("out tok/s", "output_throughput", ".1f"),
        ("goodput", "goodput", ".2f"),
        ("TTFT p50 ms", "ttft_ms.p50", ".1f"),
        ("TTFT p95 ms", "ttft_ms.p95", ".1f"),
        ("TTFT p99 ms", "ttft_ms.p99", ".1f"),
        ("TPOT p50 ms", "tpot_ms.p50", ".1f"),
        ("TPOT p95 ms", "tpot_ms.p95", ".1f"),
        ("ITL p95 ms", "itl_ms.p95", ".1f"),
        ("E2EL p95 ms", "e2el_ms.p95", ".1f"),
    )
    for column in ("load", "done", "failed", "cached", *(label for label, _, _ in figures)):
        table.add_column(column, justify="right")
    for level in report["levels"]:
        load = f"c={level['concurrency']}" if "concurrency" in level else f"{level['request_rate']}/s"
        table.add_row(
            load,
            str(level["completed"]),
            ", ".join(f"{k}: {v}" for k, v in level["failures"].items()) or "0",
            f"{100 * level['cached_token_share']:.0f}%",
            *(format_interval(level["stats"][name], fmt) for _, name, fmt in figures),
        )
    w = report["workload"]
    notes = (
        f"input {w['input_len']} tokens (shared prefix {w['shared_prefix_len']}), output {w['output_len']}, "
        f"{report['num_requests']} requests per level and repeat, {report['repeats']} repeat(s), "
        f"{report['tenants']} tenant key(s); done/failed/cached: every repeat's requests"
        + (f"; figures: {report['interval']}" if report["repeats"] > 1 else "")
    )
    return [table, notes]


def plot(report: dict, path: Path) -> None:
    """Throughput and latency against load, two panels, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(
            "--plot needs matplotlib: pip install -e '.[train]' (or pip install matplotlib)"
        ) from e
    levels = report["levels"]
    closed = "concurrency" in levels[0]
    x = [level["concurrency"] if closed else level["request_rate"] for level in levels]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(x, [level["output_throughput"] for level in levels], marker="o")
    left.set_ylabel("output tokens/s")
    for metric in ("ttft_ms", "tpot_ms"):
        for p, style in (("p50", "-"), ("p95", "--")):
            right.plot(
                x,
                [(level[metric] or {}).get(p) for level in levels],
                style,
                marker="o",
                label=f"{metric[:4].upper()} {p}",
            )
    right.set_ylabel("ms")
    right.legend()
    for axis in (left, right):
        axis.set_xlabel("concurrent requests" if closed else "requests/s")
        axis.grid(alpha=0.3)
    figure.suptitle(f"{report['workload']['model']}: {report['date']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
