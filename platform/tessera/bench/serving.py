"""``tessera bench serving``: output tok/s through the API against the offline engine, in one run.

Starts ``tessera up`` (embedded Redis, SQLite, the API, one prefill and one decode worker of the default
deployment) in a temporary data dir, then drives it with the OpenAI async client: ``concurrency`` streamed
completions at once (greedy, ``max_tokens`` each), and one stream alone. The offline engine runs the same
prompts with the decode pool's settings in this process while the stack idles. Rounds alternate the two
sides, so load from other processes hits both alike; each round yields one API / offline ratio.

Besides wall-clock tok/s, each side reports tokens per CPU second: the stack's processes (API, workers,
supervisor; not the embedded Redis, which runs detached) against this process's own CPU time offline. On
a machine shared with other work, wall-clock speed follows each process's share of the cores; CPU time
says what serving a token costs.

Each side also reports its decode engine's mean batch at ``concurrency`` streams: tokens generated per engine
step (the decode worker's from its heartbeats, read through ``/admin/pools``). Offline, all requests start
at once; through the API they reach the decode worker one by one, through the gateway, the task queue and
prefill, so its first steps run small batches.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from datetime import date, datetime
from pathlib import Path

from gpu_workers.protocol import HEARTBEAT_INTERVAL_S
from tessera.bench import BenchError
from tessera.bench.stats import format_ratio, format_spread, spread
from tessera.launcher import DEFAULT_MODEL  # the deployment `tessera up` serves disaggregated

PROMPT = "def parse_config(path):\n    "
READY_TIMEOUT_S = 240.0


def run_serving(
    concurrency: int,
    max_tokens: int,
    rounds: int,
    threads: int | None,
    as_json: bool,
    local_prefill_max_tokens: int | None = None,
) -> None:
    """``threads``: torch CPU threads of every engine (the workers' and the offline one); None: torch's
    choice. On a small machine shared with other work, 1 keeps a descheduled thread from stalling a step.
    ``local_prefill_max_tokens``: set on the deployment (admin API) before measuring; None keeps its own."""
    with tempfile.TemporaryDirectory(prefix="tessera-bench-serving-") as tmp:
        data_dir = Path(tmp)
        port = _free_port()
        env = {**os.environ, "TESSERA_DATA_DIR": str(data_dir), "TESSERA_PORT": str(port)}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)  # torch in the worker processes starts with this many
            import torch

            torch.set_num_threads(threads)
        env.pop("TESSERA_REDIS_URL", None)  # the embedded Redis: nothing shared with other runs
        log = (data_dir / "up.log").open("w+")
        up = subprocess.Popen(
            [sys.executable, "-m", "tessera.cli", "up"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            key = _wait_for_key(up, data_dir / "up.log")
            url = f"http://127.0.0.1:{port}/v1"
            if local_prefill_max_tokens is not None:
                _configure(url, key, {"local_prefill_max_tokens": local_prefill_max_tokens})
            report = _measure(url, key, data_dir, up.pid, concurrency, max_tokens, rounds)
        finally:
            up.terminate()
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
            log.close()
    if as_json:
        print(json.dumps(report, indent=2))
        return
    _print(report)


def _configure(base_url: str, key: str, changes: dict) -> None:
    """Change the deployment through the admin API, then wait out the gateway's catalog cache. Routing
    fields only: the workers' spec is unchanged, so they keep running."""
    import httpx

    from tessera.api.catalog import ROW_TTL_S

    reply = httpx.patch(
        f"{base_url.removesuffix('/v1')}/admin/deployments/{DEFAULT_MODEL}",
        headers={"Authorization": f"Bearer {key}"},
        json=changes,
    )
    if reply.status_code != 200:
        raise BenchError(f"could not change the deployment ({reply.status_code}): {reply.text[:300]}")
    time.sleep(ROW_TTL_S + 1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_key(up: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text()
        if "Tessera is up" in text:
            found = re.search(r"export TESSERA_KEY=(\S+)", text)
            if found is None:
                raise BenchError("tessera up started without printing a key")
            return found.group(1)
        if up.poll() is not None:
            raise BenchError(f"tessera up exited with {up.returncode}:\n{text[-2000:]}")
        time.sleep(0.5)
    raise BenchError(f"tessera up was not ready within {READY_TIMEOUT_S:.0f}s")


def _offline_engine(data_dir: Path):
    """An engine with the default deployment's decode settings, as its decode worker builds it."""
    from gpu_workers import Engine
    from gpu_workers.pools.worker import engine_config
    from tessera import db, deployments
    from tessera.settings import Settings

    settings = Settings(data_dir=data_dir)
    engine = db.make_engine(settings.database_url)
    try:
        with db.session_factory(engine)() as session:
            row = deployments.get_deployment(session, DEFAULT_MODEL)
            spec, local_prefill = row.to_spec(), row.local_prefill_max_tokens
    finally:
        engine.dispose()
    return (
        Engine.from_pretrained(spec.checkpoint, engine_config(spec, "decode", b"bench")),
        spec,
        local_prefill,
    )


def _measure(
    base_url: str, key: str, data_dir: Path, stack_pid: int, concurrency: int, max_tokens: int, rounds: int
):
    import psutil
    import torch
    from openai import AsyncOpenAI

    from gpu_workers import SamplingParams

    engine, spec, local_prefill = _offline_engine(data_dir)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    stack = psutil.Process(stack_pid)
    root = base_url.removesuffix("/v1")
    tokens_per_step: dict[str, list[float]] = {"api": [], "offline": []}

    def decode_counters() -> tuple[int, int]:
        """(generated tokens, engine steps) of the deployment's decode workers, from heartbeats sent after
        this call: the counters include everything done before it."""
        import httpx

        asked = time.time()
        deadline = time.monotonic() + 3 * HEARTBEAT_INTERVAL_S
        while True:
            reply = httpx.get(
                f"{root}/admin/pools", headers={"Authorization": f"Bearer {key}"}, params={"limit": 200}
            )
            if reply.status_code != 200:
                raise BenchError(f"/admin/pools answered {reply.status_code}: {reply.text[:200]}")
            workers = [
                w
                for pool in reply.json()["data"]
                if pool["deployment"] == DEFAULT_MODEL and pool["pool"] == "decode"
                for w in pool["workers"]
            ]
            if workers and all(datetime.fromisoformat(w["last_seen"]).timestamp() > asked for w in workers):
                return sum(w["generated_tokens"] for w in workers), sum(w["steps"] for w in workers)
            if time.monotonic() > deadline:
                raise BenchError("the decode workers sent no heartbeat in time to read their counters")
            time.sleep(0.2)

    def stack_cpu_s() -> dict[str, float]:
        """CPU seconds so far per part of the stack: api, prefill, decode, supervisor."""
        parts: dict[str, float] = {}
        for process in [stack, *stack.children(recursive=True)]:
            try:
                times, cmdline = process.cpu_times(), process.cmdline()
            except psutil.NoSuchProcess:
                continue
            part = next((p for p in ("prefill", "decode", "api") if p in cmdline), "supervisor")
            parts[part] = parts.get(part, 0.0) + times.user + times.system
        return parts

    def offline(n: int) -> tuple[float, float]:
        before = engine.stats()
        start, cpu = time.perf_counter(), time.process_time()
        outputs = engine.generate([prompt_ids] * n, params)
        tokens = sum(len(o.token_ids) for o in outputs)
        if n == concurrency:
            after = engine.stats()
            tokens_per_step["offline"].append(
                (after["generated_tokens"] - before["generated_tokens"]) / (after["steps"] - before["steps"])
            )
        return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)

    async def api(n: int) -> tuple[float, float]:
        client = AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)

        async def one() -> int:
            stream = await client.completions.create(
                model=DEFAULT_MODEL,
                prompt=PROMPT,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            tokens = 0
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens

        counted = decode_counters() if n == concurrency else None
        start, before = time.perf_counter(), stack_cpu_s()
        tokens = sum(await asyncio.gather(*(one() for _ in range(n))))
        elapsed = time.perf_counter() - start
        after = stack_cpu_s()
        await client.close()
        if counted is not None:
            generated, steps = (b - a for a, b in zip(counted, decode_counters(), strict=True))
            tokens_per_step["api"].append(generated / steps)
        for part, cpu_s in after.items():
            cpu_ms_per_token.setdefault(f"{part}_{n}", []).append(
                1000 * (cpu_s - before.get(part, 0.0)) / tokens
            )
        return tokens / elapsed, tokens / (sum(after.values()) - sum(before.values()))

    cpu_ms_per_token: dict[str, list[float]] = {}
    offline(2)  # warm-up: one-off costs on both sides
    asyncio.run(api(2))
    cpu_ms_per_token.clear()
    tokens_per_step["api"].clear()
    tokens_per_step["offline"].clear()
    names = [f"{side}_{n}" for side in ("api", "offline") for n in (concurrency, 1)]
    sides: dict[str, list[float]] = {name: [] for name in names}
    per_cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = [("offline", offline), ("api", lambda n: asyncio.run(api(n)))]
        for side, run in order if r % 2 == 0 else order[::-1]:
            for n in (concurrency, 1):
                wall, cpu = run(n)
                sides[f"{side}_{n}"].append(wall)
                per_cpu[f"{side}_{n}"].append(cpu)

    def ratios(values: dict[str, list[float]]) -> dict[str, dict]:
        return {
            str(n): spread([a / o for a, o in zip(values[f"api_{n}"], values[f"offline_{n}"], strict=True)])
            for n in (concurrency, 1)
        }

    return {
        "date": date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core CPU, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "deployment": {
            "name": spec.name,
            "mode": spec.mode,
            "dtype": engine.dtype.name if hasattr(engine, "dtype") else spec.dtype,
            "decode_kv": spec.decode_kv,
            "decode_weights": spec.decode_weights,
            "local_prefill_max_tokens": local_prefill,
        },
        "prompt_tokens": len(prompt_ids),
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "rounds": rounds,
        "tok_s": {name: spread(values) for name, values in sides.items()},
        "api_vs_offline": ratios(sides),
        "tok_per_cpu_s": {name: spread(values) for name, values in per_cpu.items()},
        "api_vs_offline_per_cpu_s": ratios(per_cpu),
        "stack_cpu_ms_per_token": {name: spread(values) for name, values in sorted(cpu_ms_per_token.items())},
        "decode_tokens_per_step": {
            f"{side}_{concurrency}": spread(values) for side, values in tokens_per_step.items()
        },
    }


def _print(report: dict) -> None:
    d = report["deployment"]
    print(
        f"{report['date']}, {report['machine']}; {d['name']} ({d['mode']}, {d['dtype']}, decode KV "
        f"{d['decode_kv']}, weights {d['decode_weights']}, prompts up to {d['local_prefill_max_tokens']} "
        f"tokens prefilled on decode); {report['prompt_tokens']}-token prompt, "
        f"max_tokens {report['max_tokens']}, greedy; {report['rounds']} rounds: median [min, max]"
    )
    for unit, values, ratios in (
        ("tok/s", report["tok_s"], report["api_vs_offline"]),
        ("tok/CPU-s", report["tok_per_cpu_s"], report["api_vs_offline_per_cpu_s"]),
    ):
        print(f"{'streams':>8}{'API ' + unit:>24}{'offline ' + unit:>24}{'API / offline':>24}")
        for n in (report["concurrency"], 1):
            api, offline = (
                format_spread(values[f"api_{n}"], ".0f"),
                format_spread(values[f"offline_{n}"], ".0f"),
            )
            print(f"{n:>8}{api:>24}{offline:>24}{format_ratio(ratios[str(n)]):>24}")
    parts = ", ".join(
        f"{name} {format_spread(value, '.2f')}" for name, value in report["stack_cpu_ms_per_token"].items()
    )
    print(f"stack CPU ms per output token (part_streams): {parts}")
    batches = ", ".join(
        f"{name} {format_spread(value, '.1f')}" for name, value in report["decode_tokens_per_step"].items()
    )
    print(f"decode engine tokens per step at {report['concurrency']} streams (mean batch): {batches}")
