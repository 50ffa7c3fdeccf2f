"""The default-model trainer's --corpus-cache and --device: a cached corpus is exactly the one it was made from
(so another machine, with another stdlib, trains on this machine's data), and a short CPU run from a cache
writes a checkpoint the serving loader reads."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from gpu_workers.model import load_model
from gpu_workers.tools.train import data, pycode
from gpu_workers.tools.train.corpus_cache import file_sha256, load_corpus

# Small stdlib modules: enough text for a 300-token BPE, few enough to tokenise in a moment.
SOURCE_FILES = [
    "abc.py",
    "bisect.py",
    "colorsys.py",
    "fnmatch.py",
    "genericpath.py",
    "glob.py",
    "keyword.py",
    "linecache.py",
    "queue.py",
    "sched.py",
    "stat.py",
    "heapq.py",
]
HELDOUT_PERCENT = 50  # about half of a dozen files, so both splits are non-empty
VOCAB = 300
TINY_MODEL = [
    "--vocab-size", str(VOCAB), "--hidden-size", "32", "--intermediate-size", "64", "--layers", "1",
    "--heads", "2", "--kv-heads", "1", "--context", "32", "--batch-size", "2",
    "--heldout-percent", str(HELDOUT_PERCENT),
]  # fmt: skip


@pytest.fixture
def small_stdlib(tmp_path, monkeypatch) -> Path:
    """A stdlib folder holding only SOURCE_FILES, which the trainer's corpus reads instead of the real one."""
    root = tmp_path / "stdlib"
    root.mkdir()
    real = Path(sysconfig.get_paths()["stdlib"])
    for name in SOURCE_FILES:
        shutil.copy(real / name, root / name)
    monkeypatch.setattr(data, "stdlib_root", lambda: root)
    heldout = [f for f in SOURCE_FILES if data.is_heldout(f, HELDOUT_PERCENT)]
    assert 0 < len(heldout) < len(SOURCE_FILES)
    return root


def test_corpus_cache_round_trips_exactly_and_outlives_the_stdlib_it_came_from(small_stdlib, tmp_path):
    cache = tmp_path / "corpus.pt"
    args = pycode.parse_args([*TINY_MODEL, "--corpus-cache", str(cache)])
    built, written = pycode.prepare_corpus(args)
    assert cache.is_file() and written == {"path": str(cache), "sha256": file_sha256(cache), "loaded": False}

    # Another machine's stdlib differs: here a training file is gone, so a rebuild would differ.
    (small_stdlib / built.train_files[0]).unlink()
    loaded, read = pycode.prepare_corpus(args)
    assert read == {"path": str(cache), "sha256": written["sha256"], "loaded": True}
    assert loaded.train_files == built.train_files and loaded.heldout_files == built.heldout_files
    assert loaded.heldout_files == sorted(f for f in SOURCE_FILES if data.is_heldout(f, HELDOUT_PERCENT))
    for got, want in (
        (loaded.train_stream, built.train_stream),
        (loaded.heldout_stream, built.heldout_stream),
    ):
        assert got.dtype == torch.long and torch.equal(got, want)
    assert loaded.tokenizer.to_str() == built.tokenizer.to_str()
    assert loaded.python_version == built.python_version
    rebuilt, _ = pycode.prepare_corpus(pycode.parse_args(TINY_MODEL))
    assert len(rebuilt.train_stream) < len(built.train_stream)  # the cache, not the stdlib, was read


def test_cache_made_with_other_flags_or_not_a_cache_is_refused(small_stdlib, tmp_path):
    cache = tmp_path / "corpus.pt"
    pycode.prepare_corpus(pycode.parse_args([*TINY_MODEL, "--corpus-cache", str(cache)]))
    other_split = pycode.parse_args([*TINY_MODEL, "--corpus-cache", str(cache), "--heldout-percent", "3"])
    with pytest.raises(SystemExit, match="50% held-out split, not --heldout-percent 3"):
        pycode.prepare_corpus(other_split)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(SystemExit, match="is not a corpus cache"):
        pycode.prepare_corpus(pycode.parse_args([*TINY_MODEL, "--corpus-cache", str(junk)]))


def test_three_cpu_steps_from_a_cache_write_a_loadable_checkpoint(small_stdlib, tmp_path):
    cache, out = tmp_path / "corpus.pt", tmp_path / "model"
    pycode.prepare_corpus(pycode.parse_args([*TINY_MODEL, "--corpus-cache", str(cache)]))
    pycode.main(
        [
            *TINY_MODEL,
            *("--device", "cpu", "--steps", "3", "--eval-every", "3", "--warmup-steps", "1"),
            *("--corpus-cache", str(cache), "--out", str(out), "--work-dir", str(tmp_path / "work")),
        ]
    )
    record = json.loads((out / "training.json").read_text())
    assert record["status"] == "complete" and record["steps_done"] == 3
    assert record["corpus"]["cache"] == {"path": str(cache), "sha256": file_sha256(cache), "loaded": True}
    assert record["corpus"]["heldout_files"] == load_corpus(cache).heldout_files
    assert record["machine"]["device"] == "cpu" and "--device" not in record["command"]  # the default

    model = load_model(out, dtype=torch.float32)
    assert model.config.vocab_size == VOCAB and model.config.max_position_embeddings == 32
    # The checkpoint read back scores the held-out split as the run recorded (its final, shipped number).
    windows = data.eval_windows(load_corpus(cache).heldout_stream, 32)
    assert pycode.heldout_loss(model, windows, batch=2) == pytest.approx(record["heldout_loss"], rel=1e-5)
    assert record["heldout_loss"] < torch.log(torch.tensor(float(VOCAB))).item() + 0.5
