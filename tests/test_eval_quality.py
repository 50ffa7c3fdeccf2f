"""`tessera eval quality`: the scoring helper, the metrics, their intervals and the command's JSON."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from gpu_workers import Engine, EngineConfig
from gpu_workers.tools.eval.quality import (
    EvalSettings,
    FileStats,
    completes_function,
    run_quality,
    summarize,
)
from gpu_workers.tools.eval.scoring import score_logprobs

SMALL = EvalSettings(
    max_files=1,
    max_tokens_per_file=80,
    seeds=1,
    prompts_per_file=1,
    prompt_tokens=32,
    functions_per_file=1,
    completion_tokens=16,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_scoring_matches_transformers_logits(demo_model_dir):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 2048, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = Engine.from_pretrained(demo_model_dir, EngineConfig(dtype="float32"))
    ours = score_logprobs(engine, ids, chunk_size=16)  # several chunks: later ones read the cache
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    targets = torch.tensor(ids[1:])[:, None]
    ppl_ours, ppl_ref = (torch.exp(-lp[:-1].gather(1, targets).mean()).item() for lp in (ours, ref))
    assert ppl_ours == pytest.approx(ppl_ref, rel=1e-4)
    assert engine.pages.num_free == engine.pages.num_pages  # the helper gave its pages back


def test_baseline_against_itself_agrees_exactly(demo_model_dir):
    # kv=bf16 is the bf16 baseline's own KV format: the same computation, so no difference at all.
    results = run_quality(demo_model_dir, "bf16", ["kv=bf16"], SMALL)
    same = results["kv=bf16"]
    assert same["kl_mean"] == 0.0 and same["kl_p99"] == 0.0
    assert same["top1_agreement"] == 1.0
    assert same["exact_match_32"] == same["exact_match_128"] == 1.0
    assert same["perplexity"] == results["baseline"]["perplexity"]
    assert same["valid_python"] == results["baseline"]["valid_python"]  # same seeds, same samples
    assert same["tokens"] == 80 and same["greedy_prompts"] == 1


def test_json_has_every_variant_and_reports_a_bad_one(demo_model_dir, capsys):
    from tessera.cli import eval as cli_eval

    parser = argparse.ArgumentParser()
    cli_eval.add_commands(parser.add_subparsers())
    args = parser.parse_args(
        ["eval", "quality", "--model", str(demo_model_dir), "--text", "python"]
        + ["--variants", "kv=fp8_e4m3,weights=int3"]
        + ["--max-files", "1", "--max-tokens-per-file", "64", "--seeds", "1", "--json"]
    )
    assert args.func(args) == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results) == {"baseline", "kv=fp8_e4m3", "weights=int3"}
    assert "weights must be" in results["weights=int3"]["error"]
    for name in ("baseline", "kv=fp8_e4m3"):
        for key in ("perplexity", "kl_mean", "top1_agreement", "kl_p99", "exact_match_32", "valid_python"):
            lo, hi = results[name][f"{key}_ci95"]
            assert lo <= results[name][key] <= hi
    assert results["kv=fp8_e4m3"]["config"]["kv_cache_dtype"] == "fp8_e4m3"
    assert 0 < results["kv=fp8_e4m3"]["kl_mean"] < 0.1


def test_bootstrap_interval_contains_the_estimate_and_reflects_spread():
    rng = np.random.default_rng(0)

    def file(n, loss):
        nll = rng.normal(loss, 0.5, n)
        return FileStats(nll, np.abs(rng.normal(0, 1e-3, n)), np.ones(n, bool), [[1, 2]], [[True, False]])

    base = [file(200, loss) for loss in (3.0, 3.5, 4.0, 4.5, 5.0)]
    results = summarize({"baseline": base, "same": base})
    r = results["same"]
    lo, hi = r["perplexity_ci95"]
    assert lo < r["perplexity"] < hi  # files differ a lot, so the interval is wide
    assert hi / lo > 1.5
    assert r["perplexity_delta_pct_ci95"] == [0.0, 0.0]  # paired: identical files, no difference
    assert r["valid_python"] == 0.5 and r["valid_python_per_seed"] == [0.5]


def test_completed_function_is_cut_at_the_dedent_and_parsed():
    head = 'def f(x):\n    """Double x."""'
    assert completes_function(head, "\n    return 2 * x\nprint(f(1)\n")  # the dedented line is not its body
    assert completes_function(head, "\n    y = x\n\n    return y")
    assert not completes_function(head, "\n    return (2 * x")
    assert not completes_function("def f(x):", "\nreturn x")  # no body before the dedent
