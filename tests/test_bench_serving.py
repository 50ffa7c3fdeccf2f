"""``tessera bench serving`` end to end: it starts ``tessera up``, streams through the API, runs the offline
engine, and reports both sides with the decode engines' mean batch read from the workers' heartbeats."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_serving_reports_both_sides_and_each_decode_engines_mean_batch():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    command = [sys.executable, "-m", "tessera.cli", "bench", "serving", "--concurrency", "4"]
    command += ["--max-tokens", "6", "--rounds", "1", "--threads", "1", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    for side in ("api_4", "api_1", "offline_4", "offline_1"):
        assert report["tok_s"][side]["median"] > 0
    assert {"api_4", "decode_4", "prefill_4"} <= set(report["stack_cpu_ms_per_token"])
    batches = report["decode_tokens_per_step"]
    assert set(batches) == {"api_4", "offline_4"}
    # Offline, 4 requests of 6 greedy tokens start together: 24 tokens in 6 steps (prefill's step samples too).
    assert batches["offline_4"]["median"] == pytest.approx(4.0)
    # The decode worker continues after prefill's first token: 5 tokens each, in batches of 1 to 4 rows.
    assert 1.0 <= batches["api_4"]["median"] <= 4.0
