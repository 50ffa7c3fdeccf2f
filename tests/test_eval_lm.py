"""`tessera eval lm`: bits per byte as a hand computation, loss on the right positions, paired model
comparison, and the command's output and errors."""

from __future__ import annotations

import json
import math
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from tessera.cli import main

from gpu_workers import Engine, EngineConfig
from gpu_workers.tools.demo_checkpoint import write_demo_checkpoint
from gpu_workers.tools.eval.heldout import heldout_texts
from gpu_workers.tools.eval.lm import ModelScore, position_buckets, run_lm, score_model, summarize_lm
from gpu_workers.tools.eval.scoring import score_logprobs
from gpu_workers.tools.train.data import EOS_ID

# Non-ASCII on purpose: bytes, not characters, are the denominator.
SMALL_TEXTS = {
    "a.py": 'def größe(x):\n    """Return x, in Größe."""\n    return x * 2\n',
    "b.py": "import os\n\nprint(os.sep, 'é')\n",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(path: Path, seed: int) -> Path:
    """A random 2,048-context Llama with a real BPE tokenizer; decisive logits, so the loss varies by token."""
    write_demo_checkpoint(
        path,
        seed=seed,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=2048,
    )
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] *= 40.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def model_a(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("lm-a"), seed=0)


@pytest.fixture(scope="module")
def model_b(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("lm-b"), seed=1)


def engine_nll(model_dir: Path, ids: list[int]) -> np.ndarray:
    """The serving path's NLL of ids[1:], one sequence through the engine's paged cache (not the eval's)."""
    engine = Engine.from_pretrained(model_dir, EngineConfig(dtype="float32", kv_budget_bytes=8 * 2**20))
    logp = score_logprobs(engine, ids[:-1], chunk_size=256)
    return -logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).double().numpy()


def test_bits_per_byte_is_total_nats_over_ln2_over_utf8_bytes(model_a):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_a / "tokenizer.json"))
    total_nats = 0.0
    targets = 0
    for text in SMALL_TEXTS.values():
        ids = tokenizer.encode(text).ids + [EOS_ID]  # <|bos|> text <|eos|>, as in training
        nll = engine_nll(model_a, ids)
        total_nats += nll.sum()
        targets += len(nll)
    num_bytes = sum(len(t.encode("utf-8")) for t in SMALL_TEXTS.values())
    assert num_bytes > sum(map(len, SMALL_TEXTS.values()))  # the texts hold multi-byte characters

    result = run_lm([model_a], SMALL_TEXTS)["models"][str(model_a)]
    assert result["targets"] == targets
    assert result["bits_per_byte"] == pytest.approx(total_nats / math.log(2) / num_bytes, rel=1e-5)
    assert result["nats_per_token"] == pytest.approx(total_nats / targets, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(total_nats / targets), rel=1e-5)
    lo, hi = result["bits_per_byte_ci95"]
    assert lo <= result["bits_per_byte"] <= hi


def test_every_position_is_scored_as_the_serving_path_scores_it(model_a):
    # 2,048 + ~600 targets: a full window and a shorter one, padded in the same batch.
    text = (Path(sysconfig.get_paths()["stdlib"]) / "locale.py").read_text(encoding="utf-8")[:5000]
    score = score_model(model_a, {"locale.py": text})
    assert score.context == 2048
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_a / "tokenizer.json")).encode(text).ids + [EOS_ID]
    [nll] = score.nll
    assert 2048 < len(nll) == len(ids) - 1 < 4096
    np.testing.assert_allclose(nll[:2048], engine_nll(model_a, ids[:2049]), atol=2e-4)
    # The second window starts afresh at position 0 with token 2,048 as its input.
    np.testing.assert_allclose(nll[2048:], engine_nll(model_a, ids[2048:]), atol=2e-4)
    assert nll.std() > 1.0  # decisive logits: a shifted position would show


def test_position_buckets_average_exactly_their_positions_of_the_long_files():
    # Loss p // 512 + 1 at position p: the buckets' means are known exactly; a short file (loss 50
    # everywhere) must not enter them.
    long_nll = np.array([p // 512 + 1.0 for p in range(3000)])
    short_nll = np.full(1000, 50.0)
    texts = {"long.py": "x" * 3000, "short.py": "y" * 1000}
    scores = {
        "v2": ModelScore(context=2048, max_position_embeddings=2048, nll=[long_nll, short_nll]),
        "v1": ModelScore(context=512, max_position_embeddings=512, nll=[long_nll, short_nll]),
    }
    result = summarize_lm(scores, texts)
    assert result["bucket_files"] == ["long.py"] and result["bucket_context"] == 2048
    v2 = result["models"]["v2"]["position_buckets"]
    assert [b["positions"] for b in v2] == [[0, 512], [512, 1024], [1024, 2048]]
    assert [b["loss"] for b in v2] == [1.0, 2.0, 3.5]  # 1024-1535 -> 3, 1536-2047 -> 4
    assert [b["targets"] for b in v2] == [512, 512, 1024]
    assert v2[-1]["minus_first"] == 2.5
    v1 = result["models"]["v1"]["position_buckets"]
    assert [(b["positions"], b["loss"]) for b in v1] == [([0, 512], 1.0)]  # up to its own context
    assert position_buckets(1500) == [(0, 512), (512, 1024), (1024, 1500)]


def test_later_models_are_compared_paired_against_the_first(model_a, model_b, tmp_path):
    same = shutil.copytree(model_a, tmp_path / "copy")
    results = run_lm([model_a, model_b, same], SMALL_TEXTS)["models"]
    a, b, copy = (results[str(d)] for d in (model_a, model_b, same))
    assert "bpb_change_pct" not in a
    assert b["bpb_change_pct"] == pytest.approx(100 * (b["bits_per_byte"] / a["bits_per_byte"] - 1))
    assert b["bpb_change_pct"] != 0
    assert copy["bpb_change_pct"] == 0.0 and copy["bpb_change_pct_ci95"] == [0.0, 0.0]


def test_models_with_different_heldout_splits_are_refused(model_a, tmp_path):
    other = shutil.copytree(model_a, tmp_path / "other")
    (other / "training.json").write_text(json.dumps({"hyperparameters": {"heldout_percent": 5}}))
    with pytest.raises(ValueError, match="different held-out splits"):
        heldout_texts([model_a, other])


def test_context_flag_scores_every_target_in_shorter_windows(model_a):
    full, short = (run_lm([model_a], SMALL_TEXTS, context)["models"][str(model_a)] for context in (None, 8))
    assert (full["context"], short["context"]) == (2048, 8)
    assert short["targets"] == full["targets"]
    assert short["bits_per_byte"] != full["bits_per_byte"]  # less history for most targets


def test_command_prints_both_tables_for_two_models(model_a, model_b, capsys):
    args = ["eval", "lm", "--model", str(model_a), "--model", str(model_b), "--max-files", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| model | context | targets | nats/token | perplexity | bits/byte | Δ bpb vs first |" in out
    assert f"| {model_a} | 2048 |" in out and "(reference)" in out
    assert "| model | 0–512 | 512–1024 | 1024–2048 | last − first |" in out
    assert "1 held-out files" in out and "files longer than 2048 tokens: ast.py" in out


def test_the_dependencies_split_is_their_held_out_files_by_the_same_rule(model_a):
    from gpu_workers.tools.train.data import is_heldout

    texts = heldout_texts([model_a], split="dependencies")
    assert texts and all(name.startswith("site-packages/") for name in texts)
    assert all(is_heldout(name, 3) for name in texts)  # the trainer's rule: none of them was trained on
    stdlib = heldout_texts([model_a])
    assert stdlib and not any(name.startswith("site-packages/") for name in stdlib)
    assert "site-packages/click/globals.py" not in texts  # typer ships a copy of it: dropped as a near copy
    with pytest.raises(ValueError, match="split must be one of"):
        heldout_texts([model_a], split="tests")


@pytest.mark.parametrize("command", ["lm", "completions"])
def test_unknown_model_dir_is_a_one_line_error(command, tmp_path, capsys):
    assert main(["eval", command, "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera: error: --model") and "no such directory" in err
    assert "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert main(["eval", command, "--model", str(tmp_path / "empty")]) == 2
    assert "no config.json or tokenizer.json" in capsys.readouterr().err
