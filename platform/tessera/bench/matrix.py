"""``tessera bench matrix``: the same closed-loop load against a deployment's configurations, side by side.

For each configuration of the chosen axes (decode KV format, weight format, integrity check, prefix cache,
serving mode), under one fixed ``kv_budget_bytes`` per worker: PATCH the deployment through the admin API, wait until every
live worker reports the new config version and none is draining, then run ``tessera bench serve``'s closed
loop at each concurrency while ``/admin/pools`` is sampled. The deployment's original config is put back at
the end, also after an error or Ctrl-C.

A level is *held* when every request completed and the pool whose KV holds requests to their end (decode, or
serve when colocated) neither preempted a sequence (the ``preemptions`` counter of its heartbeats, before vs
after) nor kept a request waiting for memory (a sample with ``waiting > 0`` while fewer pages were free than
a prompt needs, or every batch slot taken). A request that waits one step for its hand-off to be imported is
not queueing. A configuration's *held concurrency* is the highest level held with every lower level held.

A deployment's mode cannot change live (its workers' pools would no longer exist), so the mode axis compares
two deployments of one checkpoint on the same server, one per mode (``mode_deployment`` is the second, its
workers started by whoever runs the matrix): both get the same config, the same load and the same repeats.

Cost per million output tokens: ``--worker-usd-per-hour`` times the deployment's live workers times the
level's duration, over its output tokens, at the configuration's peak level; beside it what the server billed
per million output tokens (``usage.cost_details`` in its responses: the price book, rounded per request).

With ``repeats`` > 1 every configuration runs once per repeat, in turn (A B C, A B C, ...), so drift in the
machine's load hits them alike; each repeat sends prompts of its own. A run's levels pool its repeats (held:
held in every repeat), ``repeats`` keeps each repeat's report, ``stats`` the mean of each figure with a 95%
Student-t interval, and each axis' ``ratios`` the interval of variant / baseline over the per-repeat ratios.
The report's layout is ``schemas/matrix.schema.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from tessera.bench import BenchError
from tessera.bench.console import print_report, progress
from tessera.bench.serve import Outcome, Workload, closed_loop, metric, prompts, summarize
from tessera.bench.stats import INTERVAL_METHOD, format_interval, mean_interval, ratio_interval

# A round placeholder, not a market price: pass your accelerator's hourly price.
DEFAULT_WORKER_USD_PER_HOUR = 2.0
RELOAD_TIMEOUT_S = 300.0
SAMPLE_INTERVAL_S = 0.5
FRESH_HEARTBEAT_TIMEOUT_S = 10.0  # workers heartbeat every 2 s
PREFILL_CONCURRENCY = 4
MODE_NEEDS_A_SECOND_DEPLOYMENT = (
    "the mode axis needs --mode-deployment NAME: the same checkpoint deployed in the other mode on this "
    "server, with its workers running (a live mode change cannot be benchmarked: a config change restarts "
    "each worker on its own pool, and a worker refuses a pool its deployment's mode does not have, so after "
    "a mode change no worker would serve it). See BENCHMARKS.md for a colocated deployment beside `tessera up`"
)
# What must be equal in the two deployments of the mode axis besides CONFIG_FIELDS (which the matrix sets).
MODE_SAME_FIELDS = ("checkpoint", "page_size", "max_num_seqs", "max_model_len", "prefill_kv")
# Figures of each level that get an interval over repeats (``serve.metric`` names), keyed "name@concurrency".
LEVEL_STAT_METRICS = (
    "output_throughput",
    "request_throughput",
    "ttft_ms.p50",
    "ttft_ms.p95",
    "tpot_ms.p50",
    "tpot_ms.p95",
    "itl_ms.p95",
    "e2el_ms.p95",
)
RUN_STAT_METRICS = ("peak_output_throughput", "cost_per_mtok_usd", "prefill_throughput")
CONFIG_FIELDS = (
    "dtype",
    "kv_budget_bytes",
    "decode_kv",
    "prefill_weights",
    "decode_weights",
    "integrity_check",
    "prefix_cache",
)


@dataclass(frozen=True)
class Variant:
    name: str
    changes: dict[str, Any]


@dataclass(frozen=True)
class Axis:
    name: str
    title: str
    variants: tuple[Variant, ...]  # the first is the baseline of its ratios
    shared_prefix: bool = False  # its load shares a system prompt (the prefix cache's workload)
    prefill_probe: bool = False  # also measure prefill tok/s (prompt-only requests)
    by_mode: bool = False  # its variants are the deployments serving each mode, not config changes


AXES: dict[str, Axis] = {
    axis.name: axis
    for axis in (
        Axis(
            "kv",
            "decode KV format",
            (
                Variant("bf16", {"decode_kv": "bf16"}),
                Variant("int8", {"decode_kv": "int8"}),
                Variant("fp8_e4m3", {"decode_kv": "fp8_e4m3"}),
            ),
        ),
        Axis(
            "weights",
            "weight format (prefill and decode pools)",
            tuple(Variant(w, {"prefill_weights": w, "decode_weights": w}) for w in ("bf16", "fp8", "int4")),
            prefill_probe=True,
        ),
        Axis(
            "integrity",
            "KV integrity check",
            (Variant("off", {"integrity_check": False}), Variant("on", {"integrity_check": True})),
        ),
        Axis(
            "prefix",
            "prefix cache (shared system prompt)",
            (Variant("off", {"prefix_cache": False}), Variant("on", {"prefix_cache": True})),
            shared_prefix=True,
        ),
        Axis(
            "mode",
            "serving mode (one deployment per mode, one checkpoint)",
            (Variant("disaggregated", {}), Variant("colocated", {})),
            by_mode=True,
        ),
    )
}
AXIS_NAMES = tuple(AXES)


@dataclass
class MatrixSpec:
    url: str
    admin_key: str
    api_key: str
    deployment: str
    axes: list[str]
    concurrency: list[int]
    input_len: int
    output_len: int
    requests_per_client: int = 4
    shared_prefix_len: int | None = None  # default: 3/4 of input_len
    prefill_len: int | None = None  # default: input_len
    prefill_requests: int = 8
    kv_budget_bytes: int | None = None  # default: the deployment's own
    dtype: str | None = None  # default: the deployment's own; "auto" measures the CPU in each new worker
    worker_usd_per_hour: float = DEFAULT_WORKER_USD_PER_HOUR
    vocab: int = 1000
    seed: int | None = None  # default: a new one per run, so no prompt hits a cache an earlier run filled
    reload_timeout_s: float = RELOAD_TIMEOUT_S
    repeats: int = 1
    mode_deployment: str | None = None  # the mode axis' second deployment: same checkpoint, the other mode


# --- arithmetic ----------------------------------------------------------------------------------------------


def cost_per_million(
    usd_per_hour: float, workers: int, duration_s: float, output_tokens: int
) -> float | None:
    """USD per million output tokens when ``workers`` workers, each ``usd_per_hour``, spend ``duration_s``
    producing ``output_tokens``; None without tokens."""
    if output_tokens <= 0:
        return None
    return usd_per_hour * workers * duration_s / 3600 / output_tokens * 1e6


def held_concurrency(levels: list[dict]) -> int | None:
    """The highest concurrency held with every lower level held too; None if the lowest was not held."""
    held = None
    for level in sorted(levels, key=lambda lv: lv["concurrency"]):
        if not level["held"]:
            break
        held = level["concurrency"]
    return held


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def queued(worker: dict, pages_needed: int, max_num_seqs: int) -> bool:
    """Whether a heartbeat shows a request waiting for memory or a batch slot (not merely for the next step)."""
    if worker["waiting"] <= 0:
        return False
    free = worker["kv_pages_total"] - worker["kv_pages_used"]
    return free < pages_needed or worker["running"] >= max_num_seqs


# --- the admin API -------------------------------------------------------------------------------------------


class Admin:
    """The admin routes the matrix drives, raising BenchError with the server's message on a refusal."""

    def __init__(self, url: str, key: str):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kwargs) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise BenchError(f"{method} {path}: cannot reach the server ({e!r}); is it running?") from None
        if response.status_code in (401, 403):
            raise BenchError(
                f"{method} {path}: {response.status_code}: --admin-key must be an admin-scoped key"
            )
        if response.status_code != 200:
            raise BenchError(f"{method} {path}: {response.status_code}: {_message(response)}")
        return response.json()

    def deployment(self, name: str) -> dict:
        return self._call("GET", f"/admin/deployments/{name}")

    def update(self, name: str, changes: dict) -> dict:
        return self._call("PATCH", f"/admin/deployments/{name}", json=changes)

    def version(self, name: str) -> int:
        """The config version workers report: the number of audited changes (its creation included)."""
        count, cursor = 0, None
        while True:
            params = {"limit": 200, **({"cursor": cursor} if cursor else {})}
            page = self._call("GET", f"/admin/deployments/{name}/audit", params=params)
            count += len(page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return count

    def pools(self, name: str) -> list[dict]:
        return _pools_of(self._call, name)


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


def _pools_of(call: Callable[..., Any], name: str) -> list[dict]:
    cursor = None
    while True:
        page = call("GET", "/admin/pools", params={"limit": 200, **({"cursor": cursor} if cursor else {})})
        found = [p for p in page["data"] if p["deployment"] == name]
        cursor = page.get("next_cursor")
        if found or not cursor:
            return found


def _workers(pools: list[dict]) -> dict[str, dict]:
    return {w["worker_id"]: {**w, "pool": p["pool"]} for p in pools for w in p["workers"]}


def wait_for_config(admin: Admin, name: str, version: int, pools: set[str], timeout_s: float) -> list[dict]:
    """Until every live worker of ``name`` reports ``version`` and none is draining, with each of ``pools``
    served; the pools then."""
    deadline = time.monotonic() + timeout_s
    found: list[dict] = []
    while time.monotonic() < deadline:
        found = admin.pools(name)
        workers = [w for p in found for w in p["workers"]]
        if {p["pool"] for p in found if p["live_workers"]} >= pools and all(
            w["config_version"] == version and not w["draining"] for w in workers
        ):
            return found
        time.sleep(0.5)
    seen = [
        f"{p['pool']}: "
        + ", ".join(f"v{w['config_version']}{' draining' if w['draining'] else ''}" for w in p["workers"])
        for p in found
    ]
    raise BenchError(
        f"the workers of {name} did not all reach config version {version} within {timeout_s:.0f}s "
        f"({'; '.join(seen) or 'no live workers'}); see the workers' logs, or raise --reload-timeout"
    )


# --- one configuration ---------------------------------------------------------------------------------------


@dataclass
class LevelWatch:
    """What ``/admin/pools`` showed about one level: heartbeats before, during and after it."""

    before: dict[str, dict] = field(default_factory=dict)
    samples: list[dict[str, dict]] = field(default_factory=list)
    after: dict[str, dict] = field(default_factory=dict)


async def _sample(http: httpx.AsyncClient, name: str) -> dict[str, dict]:
    async def call(method: str, path: str, **kwargs) -> Any:
        response = await http.request(method, path, **kwargs)
        response.raise_for_status()
        return response.json()

    cursor = None
    while True:  # _pools_of, asynchronously
        params = {"limit": 200, **({"cursor": cursor} if cursor else {})}
        page = await call("GET", "/admin/pools", params=params)
        found = [p for p in page["data"] if p["deployment"] == name]
        cursor = page.get("next_cursor")
        if found or not cursor:
            return _workers(found)


async def _fresh(http: httpx.AsyncClient, name: str, after: dict[str, dict]) -> dict[str, dict]:
    """The first snapshot in which every worker of ``after`` has heartbeated again (counters include the
    level's end); the last one seen if that takes too long."""
    deadline = time.monotonic() + FRESH_HEARTBEAT_TIMEOUT_S
    while True:
        now = await _sample(http, name)
        if time.monotonic() > deadline or all(
            wid in now and now[wid]["last_seen"] != w["last_seen"] for wid, w in after.items()
        ):
            return now
        await asyncio.sleep(SAMPLE_INTERVAL_S)


async def watched_level(
    url: str,
    admin_key: str,
    name: str,
    api_key: str,
    workload: Workload,
    batch: list[list[int]],
    concurrency: int,
    tick: Callable[[], None],
) -> tuple[list[Outcome], float, LevelWatch]:
    """``closed_loop`` at ``concurrency`` while the deployment's heartbeats are sampled."""
    watch = LevelWatch()
    headers = {"Authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        watch.before = await _sample(http, name)
        done = asyncio.Event()

        async def sampler() -> None:
            while not done.is_set():
                # A missed sample is no loss: the counters before and after still tell preemptions.
                with contextlib.suppress(httpx.HTTPError):
                    watch.samples.append(await _sample(http, name))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(done.wait(), SAMPLE_INTERVAL_S)

        task = asyncio.create_task(sampler())
        try:
            outcomes, duration = await closed_loop(url, [api_key], workload, batch, concurrency, tick)
        finally:
            done.set()
            await task
        end = await _sample(http, name)
        watch.after = await _fresh(http, name, end)
    return outcomes, duration, watch


def level_report(
    concurrency: int,
    outcomes: list[Outcome],
    duration: float,
    watches: list[LevelWatch],
    kv_pools: set[str],
    pages_needed: int,
    max_num_seqs: int,
    worker_seconds: float,
    usd_per_hour: float,
) -> dict:
    """One level (of one repeat, or pooled over repeats: their outcomes, total duration, every watch):
    ``summarize``'s metrics, what the KV pool showed, and its cost."""
    summary = summarize(outcomes, duration, {})
    preemptions = [
        w["preemptions"] - watch.before[wid]["preemptions"]
        for watch in watches
        for wid, w in watch.after.items()
        if wid in watch.before and w["pool"] in kv_pools
    ]
    seen: set[tuple[str, Any]] = set()
    queued_heartbeats, max_waiting = 0, 0
    for sample in (sample for watch in watches for sample in watch.samples):
        for wid, w in sample.items():
            if w["pool"] not in kv_pools or (wid, w["last_seen"]) in seen:
                continue
            seen.add((wid, w["last_seen"]))
            max_waiting = max(max_waiting, w["waiting"])
            queued_heartbeats += queued(w, pages_needed, max_num_seqs)
    kv_used = [w["kv_pages_used"] / w["kv_pages_total"] for watch in watches for s in watch.samples
               for w in s.values() if w["pool"] in kv_pools and w["kv_pages_total"]]  # fmt: skip
    billed = sum(o.output_cost_usd for o in outcomes if o.status == "ok")
    return {
        "concurrency": concurrency,
        **summary,
        "preemptions": sum(preemptions),
        "heartbeats_seen": len(seen),
        "queued_heartbeats": queued_heartbeats,
        "max_waiting": max_waiting,
        "max_kv_pages_used_share": round(max(kv_used), 3) if kv_used else None,
        "held": summary["completed"] == summary["requests"]
        and not sum(preemptions)
        and not queued_heartbeats,
        "worker_seconds": round(worker_seconds, 3),
        "cost_per_mtok_usd": _round(
            cost_per_million(usd_per_hour, 1, worker_seconds, summary["output_tokens"]), 4
        ),
        "billed_output_usd": round(billed, 6),
    }


def _round(value: float | None, ndigits: int) -> float | None:
    return None if value is None else round(value, ndigits)


@dataclass
class Measured:
    """One repeat of one run: its report, and what pooling the repeats takes (outcomes, durations, watches)."""

    report: dict
    levels: list[tuple[list[Outcome], float, LevelWatch]]
    prefill: tuple[list[Outcome], float] | None
    kv_pools: set[str]
    pages_needed: int
    max_num_seqs: int


@dataclass
class Run:
    """One configuration under one workload: what the matrix measures once per repeat, whatever axes share it."""

    config: dict[str, Any]
    shared_prefix: bool
    deployment: str
    prefill_probe: bool = False
    mode: str | None = None  # the deployment's, once measured
    measured: list[Measured] = field(default_factory=list)
    report: dict | None = None

    def key(self) -> tuple:
        return (tuple(sorted(self.config.items())), self.shared_prefix, self.deployment)


def plan(
    spec: MatrixSpec, original: dict, modes: dict[str, str] | None = None
) -> tuple[list[Run], dict[tuple[str, str], int]]:
    """The distinct runs the axes need (each shared configuration once) and, per (axis, variant), its run.
    ``modes``: the deployment serving each mode, for the mode axis."""
    base = {k: original[k] for k in CONFIG_FIELDS}
    if spec.kv_budget_bytes is not None:
        base["kv_budget_bytes"] = spec.kv_budget_bytes
    if spec.dtype is not None:
        base["dtype"] = spec.dtype
    runs: list[Run] = []
    index: dict[tuple, int] = {}
    of: dict[tuple[str, str], int] = {}
    for name in spec.axes:
        axis = AXES[name]
        for variant in axis.variants:
            deployment = modes[variant.name] if axis.by_mode else spec.deployment
            run = Run({**base, **variant.changes}, axis.shared_prefix, deployment)
            i = index.setdefault(run.key(), len(runs))
            if i == len(runs):
                runs.append(run)
            runs[i].prefill_probe |= axis.prefill_probe
            of[(name, variant.name)] = i
    # The config the deployment already serves goes first (no reload), and runs of one config (two
    # workloads) follow each other (one reload).
    current = {k: original[k] for k in CONFIG_FIELDS}
    first = {}
    for i, run in enumerate(runs):
        first.setdefault((tuple(sorted(run.config.items())), run.deployment), i)
    order = sorted(
        range(len(runs)),
        key=lambda i: (
            (runs[i].config, runs[i].deployment) != (current, spec.deployment),
            first[(tuple(sorted(runs[i].config.items())), runs[i].deployment)],
        ),
    )
    renumber = {old: new for new, old in enumerate(order)}
    return [runs[i] for i in order], {k: renumber[i] for k, i in of.items()}


def _served(pools: list[dict]) -> dict:
    """What the workers themselves report serving, per pool."""
    return {
        p["pool"]: {
            "live_workers": p["live_workers"],
            "kv_formats": p["kv_formats"],
            "kv_pages_total": sorted({w["kv_pages_total"] for w in p["workers"]}),
            "integrity_check": sorted({w["integrity_check"] for w in p["workers"]}, key=str),
            "config_versions": sorted({w["config_version"] for w in p["workers"]}, key=str),
        }
        for p in pools
    }


class Matrix:
    def __init__(self, spec: MatrixSpec):
        self.spec = spec
        self.admin = Admin(spec.url, spec.admin_key)
        self.seed = spec.seed if spec.seed is not None else random.randrange(2**31)
        self.all_outcomes: list[Outcome] = []
        self.restored: dict[str, dict] = {}  # deployment -> its config after the restore
        self.started = time.monotonic()

    def apply(self, name: str, config: dict, expected_pools: set[str]) -> tuple[int, list[dict]]:
        """PATCH ``config`` into deployment ``name`` and wait for every worker to serve it; (version, pools)."""
        self.admin.update(name, config)
        version = self.admin.version(name)
        pools = wait_for_config(self.admin, name, version, expected_pools, self.spec.reload_timeout_s)
        return version, pools

    def send_once(self, workload: Workload, prompt: list[int], what: str) -> None:
        outcomes, _ = asyncio.run(
            closed_loop(self.spec.url, [self.spec.api_key], workload, [prompt], 1, _noop)
        )
        self.all_outcomes += outcomes
        status = outcomes[0].status
        if status in ("401", "403"):
            raise BenchError(
                f"the {what} request was refused ({status}): --api-key must be a valid inference key"
            )
        if status != "ok":
            raise BenchError(
                f"the {what} request failed ({status}): check --input-len/--output-len against the model's "
                "context and the deployment's max_tokens_limit, and --kv-budget-bytes against one request"
            )

    def workload(self, run: Run, repeat: int) -> Workload:
        s = self.spec
        return Workload(
            run.deployment,
            s.input_len,
            s.output_len,
            shared_prefix_len=(s.shared_prefix_len or s.input_len * 3 // 4) if run.shared_prefix else 0,
            vocab=s.vocab,
            seed=self.seed + 2 * repeat,  # the prefill probe's is seed + 1: every repeat's prompts are fresh
        )

    def measure(self, run: Run, repeat: int, tick: Callable[[], None]) -> Measured:
        s = self.spec
        started = time.monotonic() - self.started
        deployment = self.admin.deployment(run.deployment)
        run.mode = deployment["mode"]
        colocated = deployment["mode"] == "colocated"
        expected = {"serve"} if colocated else {"prefill", "decode"}
        version, pools = self.apply(run.deployment, run.config, expected)
        workers = sum(p["live_workers"] for p in pools)
        kv_pools = {"serve"} if colocated else {"decode"}
        workload = self.workload(run, repeat)
        sizes = [c * s.requests_per_client for c in s.concurrency]
        batch = prompts(workload, 1 + sum(sizes), tenants=1)  # one shared prefix, every prompt unique
        self.send_once(workload, batch[0], "warm-up")  # also puts the shared prefix in the cache
        pages_needed = pages_for(s.input_len + 1, deployment["page_size"])
        measured, levels, start = [], [], 1
        for c, size in zip(s.concurrency, sizes, strict=True):
            outcomes, duration, watch = asyncio.run(
                watched_level(
                    s.url,
                    s.admin_key,
                    run.deployment,
                    s.api_key,
                    workload,
                    batch[start : start + size],
                    c,
                    tick,
                )
            )
            start += size
            self.all_outcomes += outcomes
            measured.append((outcomes, duration, watch))
            levels.append(
                level_report(
                    c,
                    outcomes,
                    duration,
                    [watch],
                    kv_pools,
                    pages_needed,
                    deployment["max_num_seqs"],
                    workers * duration,
                    s.worker_usd_per_hour,
                )
            )
        prefill = self.prefill(workload, tick) if run.prefill_probe else None
        report = {
            "repeat": repeat,
            "seed": workload.seed,
            "started_s": round(started, 3),
            "config_version": version,
            "served": _served(pools),
            "workers": workers,
            "levels": levels,
            **config_summary(levels),
            "prefill": None if prefill is None else prefill_report(*prefill),
        }
        report["served_after"] = _served(self.admin.pools(run.deployment))
        report["ended_s"] = round(time.monotonic() - self.started, 3)
        return Measured(report, measured, prefill, kv_pools, pages_needed, deployment["max_num_seqs"])

    def prefill(self, workload: Workload, tick: Callable[[], None]) -> tuple[list[Outcome], float]:
        """Prompt-only requests (one output token), a few at once: their outcomes and duration."""
        s = self.spec
        probe = replace(workload, input_len=s.prefill_len or s.input_len, output_len=1, shared_prefix_len=0,
                        seed=workload.seed + 1)  # fmt: skip
        batch = prompts(probe, s.prefill_requests, tenants=1)
        outcomes, duration = asyncio.run(
            closed_loop(s.url, [s.api_key], probe, batch, PREFILL_CONCURRENCY, tick)
        )
        self.all_outcomes += outcomes
        return outcomes, duration

    def restore(self, originals: dict[str, dict]) -> None:
        """Put each deployment's original config back (the first error is raised after trying them all)."""
        self.restored = {}
        failed: BenchError | None = None
        for name, original in originals.items():
            wanted = {k: original[k] for k in CONFIG_FIELDS}
            try:
                current = self.admin.deployment(name)
                expected = {"serve"} if current["mode"] == "colocated" else {"prefill", "decode"}
                if {k: current[k] for k in CONFIG_FIELDS} != wanted:
                    print(f"restoring the original config of {name}", file=sys.stderr)
                    self.apply(name, wanted, expected)
                self.restored[name] = {k: self.admin.deployment(name)[k] for k in CONFIG_FIELDS}
            except BenchError as e:
                failed = failed or e
        if failed is not None:
            raise failed


def mode_deployments(first: dict, second: dict) -> dict[str, str]:
    """Mode -> deployment for the mode axis: two deployments of one checkpoint (and paging), one per mode."""
    if first["mode"] == second["mode"]:
        raise BenchError(
            f"--mode-deployment {second['name']} serves {second['mode']}, as {first['name']} does: the mode axis "
            "needs one deployment per mode"
        )
    differ = [k for k in MODE_SAME_FIELDS if first[k] != second[k]]
    if differ:
        shown = ", ".join(f"{k} {first[k]!r} vs {second[k]!r}" for k in differ)
        raise BenchError(
            f"{first['name']} and {second['name']} differ in more than their mode ({shown}): set "
            f"{', '.join(differ)} alike (tessera deployments update) so the mode axis compares modes only"
        )
    return {first["mode"]: first["name"], second["mode"]: second["name"]}


def prefill_report(outcomes: list[Outcome], duration: float) -> dict:
    """Prefill tok/s: fresh (uncached) prompt tokens over the probe's duration."""
    ok = [o for o in outcomes if o.status == "ok"]
    fresh = sum(o.prompt_tokens - o.cached_tokens for o in ok)
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    return {
        "input_len": ok[0].prompt_tokens if ok else None,
        "requests": len(outcomes),
        "completed": len(ok),
        "concurrency": PREFILL_CONCURRENCY,
        "duration_s": round(duration, 3),
        "prompt_tokens": sum(o.prompt_tokens for o in ok),
        "fresh_prompt_tokens": fresh,
        "prefill_throughput": round(fresh / duration, 1),
        "ttft_ms_mean": round(1000 * sum(ttfts) / len(ttfts), 2) if ttfts else None,
    }


def figures(report: dict) -> dict[str, float | None]:
    """One repeat's figures that get intervals: ``LEVEL_STAT_METRICS`` per level, ``RUN_STAT_METRICS``."""
    out = {
        f"{name}@{lv['concurrency']}": metric(lv, name)
        for lv in report["levels"]
        for name in LEVEL_STAT_METRICS
    }
    out["peak_output_throughput"] = report["peak_output_throughput"]
    out["cost_per_mtok_usd"] = report["cost_per_mtok_usd"]
    if report["prefill"] is not None:
        out["prefill_throughput"] = report["prefill"]["prefill_throughput"]
    return out


def pooled_run(run: Run, workload: dict, usd_per_hour: float) -> dict:
    """A run's report: its levels pooled over repeats (held in all of them is held pooled: counts add up), each
    repeat's report, and the figures' intervals."""
    first = run.measured[0]
    levels = []
    for i, c in enumerate(lv["concurrency"] for lv in first.report["levels"]):
        parts = [m.levels[i] for m in run.measured]
        worker_seconds = sum(m.report["levels"][i]["worker_seconds"] for m in run.measured)
        levels.append(
            level_report(
                c,
                [o for outcomes, _, _ in parts for o in outcomes],
                sum(d for _, d, _ in parts),
                [w for _, _, w in parts],
                first.kv_pools,
                first.pages_needed,
                first.max_num_seqs,
                worker_seconds,
                usd_per_hour,
            )
        )
    prefill = None
    if run.prefill_probe:
        outcomes = [o for m in run.measured for o in m.prefill[0]]
        prefill = prefill_report(outcomes, sum(m.prefill[1] for m in run.measured))
    per_repeat = [figures(m.report) for m in run.measured]
    return {
        "deployment": run.deployment,
        "mode": run.mode,
        "config": run.config,
        "workload": workload,
        "workers": first.report["workers"],
        "levels": levels,
        **config_summary(levels),
        "prefill": prefill,
        "stats": {name: mean_interval([f.get(name) for f in per_repeat]) for name in per_repeat[0]},
        "repeats": [m.report for m in run.measured],
    }


def axis_ratios(runs: list[dict], baseline: int, variant: int) -> dict[str, dict | None]:
    """Per figure, the interval of variant / baseline over repeats, each repeat's pair run back to back."""
    per = [[figures(r) for r in runs[i]["repeats"]] for i in (variant, baseline)]
    return {
        name: ratio_interval([f.get(name) for f in per[0]], [f.get(name) for f in per[1]])
        for name in per[1][0]
    }


def config_summary(levels: list[dict]) -> dict:
    """Peak output throughput (and its level), held concurrency, cost at the peak, billed output price."""
    peak = max(levels, key=lambda lv: lv["output_throughput"])
    output = sum(lv["output_tokens"] for lv in levels)
    billed = sum(lv["billed_output_usd"] for lv in levels)
    return {
        "peak_output_throughput": peak["output_throughput"],
        "peak_concurrency": peak["concurrency"],
        "held_concurrency": held_concurrency(levels),
        "cost_per_mtok_usd": peak["cost_per_mtok_usd"],
        "billed_output_usd_per_mtok": round(billed / output * 1e6, 4) if output and billed else None,
    }


def _noop() -> None:
    pass


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (``timeout``, a supervisor) unwinds like Ctrl-C, so the original config is still restored."""

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_matrix(spec: MatrixSpec, as_json: bool = False, json_path: Path | None = None,
               plot_path: Path | None = None) -> dict:  # fmt: skip
    """Every run in turn, the original config restored at the end; prints the report and returns it."""
    if "mode" in spec.axes and spec.mode_deployment is None:
        raise BenchError(MODE_NEEDS_A_SECOND_DEPLOYMENT)
    matrix = Matrix(spec)
    with _sigterm_interrupts():
        try:
            original = matrix.admin.deployment(spec.deployment)
            originals = {spec.deployment: original}
            modes = None
            if "mode" in spec.axes:
                other = originals[spec.mode_deployment] = matrix.admin.deployment(spec.mode_deployment)
                modes = mode_deployments(original, other)
            runs, of = plan(spec, original, modes)
            total = len(runs) * sum(c * spec.requests_per_client for c in spec.concurrency) + sum(
                spec.prefill_requests for r in runs if r.prefill_probe
            )
            try:
                with progress(total * spec.repeats) as tick:
                    for repeat in range(spec.repeats):  # A B C, A B C: drift hits every configuration alike
                        for run in runs:
                            run.measured.append(matrix.measure(run, repeat, tick))
            finally:
                matrix.restore(originals)
        finally:
            matrix.admin.close()
    for run in runs:
        run.report = pooled_run(run, asdict(matrix.workload(run, 0)), spec.worker_usd_per_hour)
    reports = [run.report for run in runs]
    ok = [o for o in matrix.all_outcomes if o.status == "ok"]
    report = {
        "url": spec.url,
        "deployment": spec.deployment,
        "original_config": {k: original[k] for k in CONFIG_FIELDS},
        "restored_config": matrix.restored.get(spec.deployment),
        "mode_deployment": None
        if spec.mode_deployment is None
        else {
            "name": spec.mode_deployment,
            "original_config": {k: originals[spec.mode_deployment][k] for k in CONFIG_FIELDS},
            "restored_config": matrix.restored.get(spec.mode_deployment),
        },
        "kv_budget_bytes": runs[0].config["kv_budget_bytes"],
        "dtype": runs[0].config["dtype"],
        "mode": original["mode"],
        "concurrency": spec.concurrency,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "requests_per_client": spec.requests_per_client,
        "repeats": spec.repeats,
        "interval": INTERVAL_METHOD,
        "seed": matrix.seed,
        "worker_usd_per_hour": spec.worker_usd_per_hour,
        "axes": {
            name: {
                "title": AXES[name].title,
                "baseline": AXES[name].variants[0].name,
                "variants": {v.name: of[(name, v.name)] for v in AXES[name].variants},
                "ratios": {
                    v.name: axis_ratios(reports, of[(name, AXES[name].variants[0].name)], of[(name, v.name)])
                    for v in AXES[name].variants[1:]
                },
            }
            for name in spec.axes
        },
        "runs": reports,
        "totals": {  # everything sent, warm-ups and prefill probes included: what the ledger should hold
            "requests": len(matrix.all_outcomes),
            "completed": len(ok),
            "prompt_tokens": sum(o.prompt_tokens for o in ok),
            "cached_tokens": sum(o.cached_tokens for o in ok),
            "output_tokens": sum(o.output_tokens for o in ok),
        },
        "machine": f"client: {os.cpu_count()}-core CPU, Python {sys.version.split()[0]}",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }
    print_report(report, as_json=as_json, render=tables)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    if plot_path is not None:
        plot(report, plot_path)
    return report


# --- tables --------------------------------------------------------------------------------------------------


# A table row: its label, then a ``stats`` key (printed "mean (low–high)", its ratio paired by repeat) or a
# function of a pooled run (held concurrency, counts: figures with no interval), then its format.
Row = tuple[str, str | Callable[[dict], float | None], str]


def axis_rows(report: dict, axis: str) -> list[Row]:
    """The rows of one axis' table."""
    concurrency = report["concurrency"]
    top = max(concurrency)

    def at(run: dict, c: int) -> dict:
        return next(lv for lv in run["levels"] if lv["concurrency"] == c)

    rows: list[Row] = [(f"out tok/s c={c}", f"output_throughput@{c}", ".1f") for c in concurrency]
    rows.append(("peak out tok/s", "peak_output_throughput", ".1f"))
    rows.append(("held c (no preemption/queue)", lambda r: r["held_concurrency"], "d"))
    rows.append(("preemptions (all levels)", lambda r: sum(lv["preemptions"] for lv in r["levels"]), "d"))
    if axis == "prefix":
        rows += [(f"TTFT p50 ms c={c}", f"ttft_ms.p50@{c}", ".1f") for c in concurrency]
        rows.append(("cached share", lambda r: at(r, top)["cached_token_share"], ".2f"))
    rows.append((f"TTFT p95 ms c={top}", f"ttft_ms.p95@{top}", ".1f"))
    rows.append((f"TPOT p95 ms c={top}", f"tpot_ms.p95@{top}", ".2f"))
    if axis == "weights":
        rows.append(("prefill tok/s", "prefill_throughput", ".1f"))
    rows.append(("$/M out (worker-s, peak)", "cost_per_mtok_usd", ".3f"))
    rows.append(("billed $/M out", lambda r: r["billed_output_usd_per_mtok"], ".4f"))
    return rows


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base


def tables(report: dict) -> list:
    from rich.table import Table

    out: list = []
    for axis, spec in report["axes"].items():
        names = list(spec["variants"])
        runs = [report["runs"][spec["variants"][n]] for n in names]
        base = spec["baseline"]
        table = Table(title=f"tessera bench matrix: {spec['title']} ({report['deployment']})")
        table.add_column("metric")
        for name in names:
            table.add_column(name, justify="right")
        for name in names[1:]:
            table.add_column(f"{name} / {base}", justify="right")
        for label, figure, fmt in axis_rows(report, axis):
            if isinstance(figure, str):
                cells = [format_interval(run["stats"].get(figure), fmt) for run in runs]
                ratios = [format_interval(spec["ratios"][n].get(figure), ".2f", "x") for n in names[1:]]
            else:
                values = [figure(run) for run in runs]
                cells = ["-" if v is None else format(v, fmt) for v in values]
                ratios = ["-" if (r := ratio(v, values[0])) is None else f"{r:.2f}x" for v in values[1:]]
            table.add_row(label, *cells, *ratios)
        out.append(table)
        if axis == "integrity" and (peak := spec["ratios"]["on"]["peak_output_throughput"]):
            overhead = f"{100 * (1 - peak['mean']):+.1f}%"
            if peak["ci95"]:
                low, high = (100 * (1 - r) for r in reversed(peak["ci95"]))
                overhead += f" ({low:+.1f}–{high:+.1f})"
            out.append(f"integrity check overhead at peak: {overhead} of output tok/s")
    out.append(
        f"input {report['input_len']} tokens, output {report['output_len']}, {report['requests_per_client']} "
        f"requests per client per level; kv_budget_bytes {report['kv_budget_bytes']} per worker "
        f"({report['mode']}, dtype {report['dtype']}); worker ${report['worker_usd_per_hour']}/h; "
        f"{report['repeats']} repeat(s), configurations in turn per repeat"
        + (f"; figures: {report['interval']}" if report["repeats"] > 1 else "")
        + f"; original config restored: {restored_all(report)}"
    )
    return out


def restored_all(report: dict) -> bool:
    """Whether every deployment the matrix changed is back on its original config."""
    second = report["mode_deployment"]
    return report["restored_config"] == report["original_config"] and (
        second is None or second["restored_config"] == second["original_config"]
    )


def plot(report: dict, path: Path) -> None:
    """Output tok/s against concurrency, one panel per axis, one line per variant, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise BenchError(
            "--plot needs matplotlib: pip install -e '.[train]' (or pip install matplotlib)"
        ) from e
    axes = report["axes"]
    figure, panels = plt.subplots(1, len(axes), figsize=(4.5 * len(axes), 4), squeeze=False)
    for panel, spec in zip(panels[0], axes.values(), strict=True):
        for name, i in spec["variants"].items():
            levels = report["runs"][i]["levels"]
            panel.plot([lv["concurrency"] for lv in levels], [lv["output_throughput"] for lv in levels],
                       marker="o", label=name)  # fmt: skip
        panel.set_title(spec["title"])
        panel.set_xlabel("concurrent requests")
        panel.set_ylabel("output tokens/s")
        panel.grid(alpha=0.3)
        panel.legend()
    figure.suptitle(f"{report['deployment']}: {report['date']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
