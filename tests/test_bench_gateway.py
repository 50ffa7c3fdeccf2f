"""The gateway bench (``tessera bench gateway``) runs at tiny sizes and reports both servers.

No timing is asserted: these machines are shared and noisy. What is asserted is what the bench must get
right regardless of speed: both servers answered every request, the gateway's answers came through the
stand-in worker, and every figure the report promises is there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tessera.bench.gateway_harness import FIXED_REPLY, bare_app
from tessera.cli import main
from tessera.cli.bench import add_commands

ROOT = Path(__file__).resolve().parents[1]
METRICS = {
    "requests_per_s",
    "p50_ms",
    "p99_ms",
    "server_cpu_ms_per_request",
    "client_cpu_ms_per_request",
}


def test_bench_module_imports_without_torch_or_servers():
    code = (
        "import sys, tessera.bench.gateway, tessera.bench.gateway_harness; "
        "assert not {'torch', 'fastapi', 'httpx', 'uvicorn'} & set(sys.modules), sys.modules.keys()"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_add_commands_registers_gateway_with_its_defaults():
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "gateway", "--concurrency", "4", "--json"])
    assert callable(args.func) and args.json
    assert (args.requests, args.concurrency, args.rounds) == (1000, 4, 5)


def test_bare_app_answers_a_chat_body_with_the_fixed_reply():
    with TestClient(bare_app()) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json() == FIXED_REPLY


@pytest.mark.slow
def test_gateway_bench_reports_both_servers_at_tiny_sizes(capsys):
    code = main(["bench", "gateway", "--requests", "12", "--concurrency", "3", "--rounds", "2", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["bench"] == "gateway"
    assert report["settings"]["requests"] == 12 and report["settings"]["rounds"] == 2
    assert report["prompt_tokens"] > 0  # the stand-in worker saw the gateway's tokenised prompt
    for side in ("bare", "gateway", "gateway_quotas"):
        assert len(report["rounds"][side]) == 2
        assert set(report["results"][side]) == METRICS
        for run in report["rounds"][side]:
            assert run["requests_per_s"] > 0
            assert run["p99_ms"] >= run["p50_ms"] > 0
    for name in ("gateway_over_bare", "quotas_on_over_off"):
        assert set(report[name]) == METRICS  # a ratio may be None: CPU time comes in ticks
    for name in ("gateway_minus_bare", "quotas_on_minus_off"):
        assert set(report[name]) == METRICS - {"requests_per_s"}
    steps = {row["step"]: row for row in report["steps"]}
    assert len(steps) == 11
    assert any(step.startswith("quotas: admit + settle") for step in steps)
    assert all(row["us_median"] > 0 for row in steps.values())
    assert [row["on_path"] for row in report["steps"]].count(False) == 1  # only the record write
