"""``tessera bench serve`` against a real ``tessera up``: the metrics follow vLLM's definitions and token
counts are the server's own."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time

import httpx
import jsonschema
import pytest
from tessera.bench.schemas import validate
from tessera.bench.serve import (
    STAT_METRICS,
    Outcome,
    Workload,
    arrival_gaps,
    meets,
    metric,
    prompts,
    summarize,
)
from tessera.bench.stats import format_interval, mean_interval, ratio_interval, t975
from tessera.launcher import DEFAULT_MODEL
from test_launcher import assert_all_stopped, start_up, stop_up


def test_tpot_excludes_the_first_token_and_itl_pools_every_gap():
    a = Outcome(status="ok", latency=1.0, ttft=0.1, itls=[0.3, 0.3, 0.3], prompt_tokens=10, output_tokens=4)
    b = Outcome(
        status="ok", latency=0.5, ttft=0.5, itls=[], prompt_tokens=10, cached_tokens=5, output_tokens=1
    )
    failed = Outcome(status="429", latency=0.01)
    assert a.tpot == pytest.approx(0.3) and b.tpot is None
    level = summarize([a, b, failed], duration_s=2.0, slo_ms={"ttft": 200})
    assert level["completed"] == 2 and level["failures"] == {"429": 1}
    assert level["output_throughput"] == 2.5 and level["request_throughput"] == 1.0
    assert level["goodput"] == 0.5  # only a meets TTFT <= 200 ms
    assert level["cached_token_share"] == 0.25
    assert level["itl_ms"]["mean"] == pytest.approx(300) and level["tpot_ms"]["p50"] == pytest.approx(300)
    assert level["ttft_ms"]["p50"] == pytest.approx(300)  # between 100 and 500
    assert meets(b, {"tpot": 1}) and not meets(a, {"e2el": 999})


def test_mean_interval_is_students_t_over_repeats():
    stat = mean_interval([1.0, 2.0, 3.0])
    # s = 1, n = 3: mean -+ t(0.975, 2) / sqrt(3) = 2 -+ 4.303 / 1.732
    assert stat["mean"] == 2.0 and stat["values"] == [1.0, 2.0, 3.0]
    assert stat["ci95"] == pytest.approx([2 - 2.4843, 2 + 2.4843], abs=1e-4)
    assert mean_interval([5.0])["ci95"] is None  # one repeat: a mean, no interval
    assert mean_interval([1.0, None]) is None  # a figure missing from a repeat has no honest mean
    # Beyond the table the expansion is within 0.001 of Student's t (2.0395 at 31, 1.9799 at 120).
    assert t975(30) == 2.042 and t975(31) == pytest.approx(2.0395, abs=1e-3)
    assert t975(120) == pytest.approx(1.9799, abs=1e-3)
    assert format_interval(stat, ".2f") == "2.00 (-0.48–4.48)" and format_interval(None, ".1f") == "-"


def test_ratio_interval_pairs_variant_and_baseline_by_repeat():
    # Drift doubles both sides in the second repeat: paired, the ratio is exactly 2 every time.
    paired = ratio_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert paired["mean"] == 2.0 and paired["ci95"] == [2.0, 2.0]
    unpaired = ratio_interval([2.0, 4.0, 6.0], [3.0, 1.0, 2.0])
    assert unpaired["ci95"][1] - unpaired["ci95"][0] > 1  # the same values, wrongly paired, spread widely
    assert ratio_interval([1.0, 2.0], [1.0, 0.0]) is None
    with pytest.raises(ValueError, match="pair them by repeat"):
        ratio_interval([1.0], [1.0, 2.0])


def test_poisson_arrivals_average_the_rate_and_burstiness_spreads_them():
    poisson, bursty = arrival_gaps(20_000, 4.0, 1.0, 0), arrival_gaps(20_000, 4.0, 0.25, 0)
    assert sum(poisson) / len(poisson) == pytest.approx(0.25, rel=0.05)
    assert sum(bursty) / len(bursty) == pytest.approx(0.25, rel=0.05)
    variance = lambda gaps: sum((g - 0.25) ** 2 for g in gaps) / len(gaps)  # noqa: E731
    assert variance(bursty) > 3 * variance(poisson)


def test_prompts_share_a_prefix_within_a_tenant_only():
    batch = prompts(Workload(model="m", input_len=20, output_len=4, shared_prefix_len=12, vocab=500), 6, 2)
    assert all(len(p) == 20 and all(10 <= t < 500 for t in p) for p in batch)
    assert batch[0][:12] == batch[2][:12] == batch[4][:12] != batch[1][:12]
    assert batch[0][12:] != batch[2][12:]


def ledger_usage(up, output_tokens: int) -> dict:
    """The default model's row of the tenant's usage, once the ledger holds ``output_tokens`` (billing
    consumes the outcomes asynchronously)."""
    deadline = time.monotonic() + 60
    while True:
        response = httpx.get(
            f"{up.url}/v1/usage", params={"group_by": "model"}, headers={"Authorization": f"Bearer {up.key}"}
        )
        assert response.status_code == 200, response.text
        row = next((r for r in response.json()["data"] if r["model"] == DEFAULT_MODEL), {"output_tokens": 0})
        if row["output_tokens"] >= output_tokens or time.monotonic() > deadline:
            assert row["output_tokens"] == output_tokens
            return row
        time.sleep(0.5)


def test_a_wrong_serve_report_fails_its_schema():
    level = summarize(
        [Outcome(status="ok", latency=1.0, ttft=0.1, itls=[0.3] * 3, prompt_tokens=10, output_tokens=4)],
        1.0,
        {},
    )
    stats = {name: mean_interval([metric(level, name)]) for name in STAT_METRICS}
    report = {
        "url": "http://127.0.0.1:8787",
        "workload": {
            "model": "m",
            "input_len": 10,
            "output_len": 4,
            "shared_prefix_len": 0,
            "vocab": 1000,
            "seed": 0,
        },
        "tenants": 1,
        "num_requests": 1,
        "repeats": 1,
        "interval": "t",
        "slo_ms": {},
        "levels": [{"concurrency": 1, **level, "repeats": [level], "stats": stats}],
        "machine": "m",
        "date": "2026-12-01",
    }
    validate(report, "serve")

    def broken(change) -> jsonschema.ValidationError:
        wrong = copy.deepcopy(report)
        change(wrong)
        with pytest.raises(jsonschema.ValidationError) as failed:
            validate(wrong, "serve")
        return failed.value

    assert "'ttft_ms' is a required property" in broken(lambda r: r["levels"][0].pop("ttft_ms")).message
    assert list(broken(lambda r: r["levels"][0]["repeats"][0].update(output_tokens="4")).absolute_path) == [
        "levels",
        0,
        "repeats",
        0,
        "output_tokens",
    ]
    assert "too short" in broken(lambda r: r["levels"][0]["stats"]["ttft_ms.p95"].update(ci95=[1.0])).message
    broken(lambda r: r["levels"][0].pop("concurrency"))  # neither a concurrency nor a request rate
    broken(lambda r: r["levels"][0]["stats"].update({"ttft_ms.p42": None}))  # no such figure
    broken(lambda r: r["levels"][0].update(cached_token_share=1.5))


def bench_serve(url: str, key: str, concurrency: str, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "tessera.cli", "bench", "serve", "--url", url, "--model", DEFAULT_MODEL,
        "--api-key", key, "--concurrency", concurrency, "--num-requests", "8", "--input-len", "64",
        "--output-len", "6", "--shared-prefix-len", "48", *extra,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bench_serve_reports_the_servers_usage_at_each_level(tmp_path_factory):
    up = start_up(tmp_path_factory.mktemp("bench-serve"))
    out = tmp_path_factory.mktemp("bench-serve-out")
    try:
        files = ["--json", str(out / "serve.json"), "--plot", str(out / "serve.png")]
        result = bench_serve(
            up.url, up.key, "1,4", "--slo", "ttft=60000,tpot=60000", "--repeats", "2", *files
        )
        assert result.returncode == 0, result.stderr
        report = json.loads((out / "serve.json").read_text())
        ledger = ledger_usage(up, sum(level["output_tokens"] for level in report["levels"]))
        refused = bench_serve(up.url, "not-a-key", "2")
    finally:
        assert stop_up(up, signal.SIGTERM) == 0, up.output
        assert_all_stopped(up)
    validate(report, "serve")  # the documented schema
    # The client's token counts are the server's usage (exactly input/output_len each) and its ledger's.
    assert ledger["requests"] == sum(level["completed"] for level in report["levels"]) == 2 * 2 * 8
    assert ledger["input_tokens"] == sum(level["prompt_tokens"] for level in report["levels"])
    assert [level["concurrency"] for level in report["levels"]] == [1, 4] and report["repeats"] == 2
    for level in report["levels"]:
        assert len(level["repeats"]) == 2
        for part in (level, *level["repeats"]):
            n = 8 * len(level["repeats"]) if part is level else 8  # the level pools both repeats
            assert part["completed"] == n and part["failures"] == {}
            assert part["output_tokens"] == n * 6 and part["prompt_tokens"] == n * 64  # the server's usage
            assert part["goodput"] == part["request_throughput"]  # generous SLOs: every request meets them
            assert part["completed"] + sum(part["failures"].values()) == part["requests"] == n
            assert part["ttft_ms"]["p50"] <= part["e2el_ms"]["p50"]
            for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
                assert part[name]["p50"] <= part[name]["p95"] <= part[name]["p99"]
            assert part["tpot_ms"]["mean"] > 0 and part["itl_ms"]["p99"] > 0
        # stats: each metric's per-repeat values, their mean, and an interval around it.
        for name in STAT_METRICS:
            stat = level["stats"][name]
            assert stat["values"] == [pytest.approx(metric(r, name), abs=1e-4) for r in level["repeats"]]
            assert stat["mean"] == pytest.approx(sum(stat["values"]) / 2, abs=1e-4)
            assert stat["ci95"][0] <= stat["mean"] <= stat["ci95"][1]
    # The first request ever misses; every later one shares the tenant's cached 48-token prefix (pages of
    # 16) and nothing more: each level of each repeat sends prompts of its own.
    first, *later = [level["repeats"][rep] for rep in range(2) for level in report["levels"]]  # sent order
    assert first["cached_tokens"] == 7 * 48 and first["cached_token_share"] == round(7 * 48 / (8 * 64), 4)
    assert [r["cached_tokens"] for r in later] == [8 * 48] * 3
    assert (out / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert " (" in result.stdout and "–" in result.stdout  # tables print "mean (low–high)"
    assert refused.returncode == 0, refused.stderr
    assert "401: 8" in refused.stdout  # every request refused, counted by status
