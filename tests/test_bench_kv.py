"""The KV benches (``tessera bench integrity|prefix|kv-formats``) run at tiny sizes and report what they saw.

No timing is asserted: these machines are shared and noisy. What is asserted is what a bench must get
right regardless of speed: the integrity check changes no output, the prefix cache serves exactly the
shared full pages and nothing across tenants, and FP8 fits more requests than BF16 in one budget.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from tessera.bench import kv
from tessera.cli import main
from tessera.cli.bench import add_commands

from gpu_workers import Engine, EngineConfig

ROOT = Path(__file__).resolve().parents[1]


def run_bench(capsys, *args: str) -> dict:
    code = main(["bench", *args, "--threads", "1", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_bench_module_imports_without_torch():
    code = "import sys, tessera.bench.integrity, tessera.bench.prefix, tessera.bench.kv_formats; assert 'torch' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_add_commands_registers_the_three_benches():
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    for bench in ("integrity", "prefix", "kv-formats"):
        args = parser.parse_args(["bench", bench, "--model", "m", "--json"])
        assert callable(args.func) and args.json


def test_integrity_bench_reports_both_sides_and_identical_outputs(capsys, tiny_llama_dir):
    report = run_bench(
        capsys, "integrity", "--model", str(tiny_llama_dir), "--concurrency", "1,3",
        "--prompt-tokens", "24", "--max-tokens", "4", "--reps", "2",
    )  # fmt: skip
    assert report["bench"] == "integrity"
    assert [r["concurrency"] for r in report["results"]] == [1, 3]
    for row in report["results"]:
        assert row["output_tokens"] == 4 * row["concurrency"]
        assert row["tokens_per_s_off"] > 0 and row["tokens_per_s_on"] > 0
        assert row["p95_step_ms_on"] >= row["p50_step_ms_on"] > 0
        assert set(row["throughput_change_pct"]) == {"median", "min", "max"}
        assert row["check_us_per_step"] > 0  # the checked engine really ran its tracker
        assert row["integrity_mismatches"] == 0
        assert row["identical_outputs"]


def test_prefix_bench_hits_only_the_same_tenants_full_pages(capsys, tiny_llama_dir):
    report = run_bench(
        capsys, "prefix", "--model", str(tiny_llama_dir), "--system-tokens", "40",
        "--suffix-tokens", "5", "--rounds", "2", "--page-size", "16",
    )  # fmt: skip
    rows = {r["kind"]: r for r in report["results"]}
    assert rows["miss_first"]["cached_tokens"] == [0]
    assert rows["miss_other_tenant"]["cached_tokens"] == [0]
    assert rows["hit_same_tenant"]["cached_tokens"] == [32]  # the two full pages of the 40-token prompt
    assert rows["hit_same_tenant"]["requests"] == 6
    assert report["prefix_cache_hit_tokens"] == 6 * 32
    assert report["miss_over_hit_ttft"]["median"] > 0


def test_kv_formats_bench_fits_more_requests_in_fp8(capsys, tiny_llama_dir):
    # 32 + 16 tokens = 3 pages a request; the budget holds 2 such requests in BF16 and ~4 in FP8.
    report = run_bench(
        capsys, "kv-formats", "--model", str(tiny_llama_dir), "--concurrency", "1,4",
        "--prompt-tokens", "32", "--max-tokens", "16", "--fit-requests", "2", "--reps", "1",
    )  # fmt: skip
    assert report["requests_that_fit"]["fp8_e4m3"] > report["requests_that_fit"]["bf16"] == 2
    one, four = report["results"]
    assert one["bf16"]["max_running"] == one["fp8_e4m3"]["max_running"] == 1
    assert four["bf16"]["max_running"] == 2
    assert four["fp8_e4m3"]["max_running"] > 2
    for row in report["results"]:
        assert row["bf16"]["tokens_per_s"] > 0 and row["fp8_e4m3"]["tokens_per_s"] > 0
        assert row["fp8_over_bf16"]["median"] > 0
    # BF16 admits only requests it has whole pages for, so it never preempts. FP8's 11 pages (scales take
    # the 12th) admit all 4 requests at 2 pages each, and decode then needs 4 x 3 = 12: one must be
    # preempted and recomputed.
    assert one["bf16"]["preemptions"] == four["bf16"]["preemptions"] == 0
    assert one["fp8_e4m3"]["preemptions"] == 0
    assert four["fp8_e4m3"]["preemptions"] > 0

    # Recompute after preemption changes no token: at the bench's budget such a batch gives what an
    # engine with room for everything gives.
    rng = random.Random(3)
    prompts = [kv.ids(rng, 32, 128) for _ in range(4)]
    budget = report["settings"]["kv_budget_bytes"]
    tight = Engine.from_pretrained(
        tiny_llama_dir, EngineConfig(kv_cache_dtype="fp8_e4m3", kv_budget_bytes=budget)
    )
    roomy = Engine.from_pretrained(tiny_llama_dir, EngineConfig(kv_cache_dtype="fp8_e4m3"))
    outputs = [o.token_ids for o in tight.generate(prompts, kv.greedy(16))]
    assert tight.stats()["preemptions"] > 0
    assert outputs == [o.token_ids for o in roomy.generate(prompts, kv.greedy(16))]


def test_a_bench_whose_requests_fail_exits_with_the_engines_reason(capsys, tiny_llama_dir):
    # 250 prompt + 16 output tokens outgrow the model's 256 positions: the engine fails every request.
    # The engine only logs what an event callback raises, so a bench that raised there went on and
    # reported 0 tok/s with exit code 0; it must stop and say why.
    code = main(
        ["bench", "kv-formats", "--model", str(tiny_llama_dir), "--concurrency", "1", "--prompt-tokens",
         "250", "--max-tokens", "16", "--reps", "1", "--threads", "1", "--json"]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code != 0
    assert "benchmark request(s) failed" in captured.err
    assert captured.out == ""
