"""`tessera eval quality` on a GGUF with the English text: pydoc chunks and chat prompts, end to end."""

from __future__ import annotations

import argparse
import json

import pytest

from gpu_workers.tokenizer import load_tokenizer
from gpu_workers.tools.eval.english import CHAT_PROMPTS, topic_chunks
from gpu_workers.tools.eval.quality import EvalSettings, run_quality
from tests.gguf_files import write_tiny_gguf

FEW = EvalSettings(text="english", chunks=3, chunk_tokens=48, chat_prompts=4, chat_tokens=8)
FIELDS = ("perplexity", "perplexity_delta_pct", "kl_mean", "kl_p99", "top1_agreement", "chat_exact_match")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval_gguf")
    write_tiny_gguf(folder / "q4_0.gguf", "llama", "Q4_0")
    write_tiny_gguf(folder / "f16.gguf", "llama", "F16")
    return folder


def eval_args(*argv: str) -> argparse.Namespace:
    from tessera.cli import eval as cli_eval

    parser = argparse.ArgumentParser()
    cli_eval.add_commands(parser.add_subparsers())
    return parser.parse_args(["eval", "quality", *argv])


def test_gguf_eval_reports_every_format_with_intervals_around_the_estimates(gguf_dir, capsys):
    # No --text: the GGUF has a chat template, so the English text and the default variants (floor, FP8 KV,
    # native Q4, both) run against the fp32 baseline.
    common = ["--model", str(gguf_dir / "q4_0.gguf"), "--chunks", "3", "--chunk-tokens", "48"]
    args = eval_args(*common, "--chat-prompts", "4", "--chat-tokens", "8", "--json")
    assert args.func(args) == 0
    results = json.loads(capsys.readouterr().out)
    assert list(results) == [
        "baseline",
        "dtype=bfloat16",
        "dtype=bfloat16+kv=fp8_e4m3",
        "dtype=bfloat16+weights=int4",
        "dtype=bfloat16+kv=fp8_e4m3+weights=int4",
    ]
    assert results["baseline"]["config"] == {"dtype": "float32", "kv_cache_dtype": "auto", "weights": "bf16"}
    both = results["dtype=bfloat16+kv=fp8_e4m3+weights=int4"]["config"]
    assert both == {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3", "weights": "int4"}
    for name, r in results.items():
        assert (r["chunks"], r["tokens"], r["chat_prompts"]) == (3, 3 * 48, 4)
        assert "pydoc_data/topics.py" in r["text"]
        assert len(r["chat_answers"]) == 4
        assert r["chat_answers_changed"] == round(4 * (1 - r["chat_exact_match"]))
        for key in FIELDS:
            lo, hi = r[f"{key}_ci95"]
            assert lo <= r[key] <= hi, (name, key)
    fp8 = results["dtype=bfloat16+kv=fp8_e4m3"]
    assert fp8["kl_mean"] > 0 and fp8["kl_mean_ci95"][1] > fp8["kl_mean_ci95"][0]

    args = eval_args(*common, "--chat-prompts", "2", "--chat-tokens", "4", "--variants", "kv=fp8_e4m3")
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "| chat exact | chat answers changed |" in table
    assert "| kv=fp8_e4m3 | " in table and "/2 |" in table
    assert "3 chunks of pydoc_data/topics.py" in table


def test_identical_variant_reports_no_difference(gguf_dir):
    results = run_quality(gguf_dir / "f16.gguf", "fp32", ["dtype=float32"], FEW)
    same, base = results["dtype=float32"], results["baseline"]
    assert same["kl_mean"] == same["kl_p99"] == 0.0
    assert same["top1_agreement"] == 1.0 and same["top1_agreement_ci95"] == [1.0, 1.0]
    assert same["chat_exact_match"] == 1.0 and same["chat_answers_changed"] == 0
    assert same["perplexity"] == base["perplexity"] and same["perplexity_delta_pct_ci95"] == [0.0, 0.0]
    assert same["chat_answers"] == base["chat_answers"]


def test_int4_groups_of_128_on_f16_weights_show_as_damage(gguf_dir):
    results = run_quality(gguf_dir / "f16.gguf", "fp32", ["weights=int4"], FEW)
    damaged = results["weights=int4"]
    assert damaged["config"]["weights"] == "int4"
    assert damaged["kl_mean_ci95"][0] > 0.01  # the whole interval, not only the estimate, is above zero
    assert damaged["top1_agreement"] < 1.0


def test_chunks_are_distinct_topics_of_the_asked_length(gguf_dir):
    tokenizer = load_tokenizer(gguf_dir / "f16.gguf")
    chunks = topic_chunks(tokenizer, 5, 100)
    assert len(chunks) == 5 and all(len(ids) == 101 for ids in chunks.values())
    assert topic_chunks(tokenizer, 5, 100) == chunks  # fixed: same topics every run
    assert len(CHAT_PROMPTS) == 20 and len(set(CHAT_PROMPTS)) == 20
