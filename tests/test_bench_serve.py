"""``tessera bench serve`` against a real ``tessera up``: the metrics follow vLLM's definitions and token
counts are the server's own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from tessera.bench.serve import Outcome, Workload, arrival_gaps, meets, prompts, summarize
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
        result = bench_serve(up.url, up.key, "1,4", "--slo", "ttft=60000,tpot=60000", *files)
        assert result.returncode == 0, result.stderr
        refused = bench_serve(up.url, "not-a-key", "2")
    finally:
        assert stop_up(up, signal.SIGTERM) == 0, up.output
        assert_all_stopped(up)
    report = json.loads((out / "serve.json").read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert level["completed"] == 8 and level["failures"] == {}
        assert level["output_tokens"] == 8 * 6 and level["prompt_tokens"] == 8 * 64  # the server's usage
        assert level["goodput"] == level["request_throughput"]  # generous SLOs: every request meets them
        assert level["ttft_ms"]["p50"] <= level["e2el_ms"]["p50"]
        assert level["tpot_ms"]["mean"] > 0 and level["itl_ms"]["p99"] > 0
    # Every request after the first shares a cached 48-token prefix (pages of 16): 7 of 8 hit in full.
    assert report["levels"][0]["cached_tokens"] == 7 * 48
    assert report["levels"][0]["cached_token_share"] == round(7 * 48 / (8 * 64), 4)
    assert (out / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert refused.returncode == 0, refused.stderr
    assert "401: 8" in refused.stdout  # every request refused, counted by status
