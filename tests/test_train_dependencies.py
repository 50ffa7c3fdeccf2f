"""The trainer's --with-dependencies: installed dependencies' sources join the training split under the
stdlib's rules (test folders skipped, the same path-hash held-out rule), each with its licence on record;
a copyleft or missing one is refused; the scored held-out stream stays the stdlib's."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from gpu_workers.tools.train import data, pycode
from gpu_workers.tools.train.corpus_cache import load_corpus

SMALL_DEPENDENCIES = ("cachetools", "sniffio", "six")  # installed with the project, a few files each
HELDOUT_PERCENT = 50
TINY = ["--vocab-size", "300", "--heldout-percent", str(HELDOUT_PERCENT)]


@pytest.fixture
def small_stdlib(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "stdlib"
    root.mkdir()
    real = Path(sysconfig.get_paths()["stdlib"])
    for name in ("abc.py", "bisect.py", "colorsys.py", "fnmatch.py", "glob.py", "heapq.py", "queue.py"):
        shutil.copy(real / name, root / name)
    monkeypatch.setattr(data, "stdlib_root", lambda: root)
    monkeypatch.setattr(data, "DEPENDENCY_DISTRIBUTIONS", SMALL_DEPENDENCIES)
    return root


def test_dependency_files_join_the_split_by_the_same_rule_with_their_licences(small_stdlib):
    stdlib = data.stdlib_corpus(heldout_percent=HELDOUT_PERCENT)
    corpus = data.with_dependencies(stdlib, heldout_percent=HELDOUT_PERCENT)

    added = [f for f in corpus.train + corpus.heldout if f.startswith("site-packages/")]
    assert {f.split("/")[1] for f in added} == {"cachetools", "sniffio", "six.py"}
    assert set(corpus.train).isdisjoint(corpus.heldout)
    assert set(stdlib.train) <= set(corpus.train) and set(stdlib.heldout) <= set(corpus.heldout)
    for name in added:  # one rule for every file, whichever source it came from
        assert (name in corpus.heldout) == data.is_heldout(name, HELDOUT_PERCENT)
        assert "tests" not in name.split("/") and name.endswith(".py")
    assert any(f in corpus.heldout for f in added) and any(f in corpus.train for f in added)

    texts = dict(zip(added, corpus.texts(added), strict=True))
    assert "def cached(" in texts["site-packages/cachetools/__init__.py"]
    by_name = {s.distribution: s for s in corpus.sources}
    assert set(by_name) == {"cachetools", "sniffio", "six"}
    assert by_name["cachetools"].licence == "MIT" and by_name["six"].files == 1
    assert sum(s.files for s in corpus.sources) == len(added)


@pytest.mark.parametrize(
    ("name", "message"),
    [("psycopg", "LGPL"), ("hypothesis", "MPL"), ("no-such-distribution", "not installed")],
)
def test_a_copyleft_or_missing_dependency_is_refused_by_name(small_stdlib, name, message):
    with pytest.raises(ValueError, match=message) as caught:
        data.with_dependencies(data.stdlib_corpus(), names=("cachetools", name))
    assert name in str(caught.value)


def test_the_trainer_scores_the_stdlib_held_out_and_records_the_dependencies(small_stdlib, tmp_path):
    cache = tmp_path / "corpus.pt"
    plain, _ = pycode.prepare_corpus(pycode.parse_args(TINY))
    args = pycode.parse_args([*TINY, "--with-dependencies", "--corpus-cache", str(cache)])
    built, _ = pycode.prepare_corpus(args)

    assert built.heldout_files == plain.heldout_files  # the scored split is the one other models share
    assert len(built.train_stream) > len(plain.train_stream)
    assert built.dependency_heldout_files and all(
        f.startswith("site-packages/") and f not in built.train_files for f in built.dependency_heldout_files
    )
    assert {s["distribution"] for s in built.sources} == set(SMALL_DEPENDENCIES)

    loaded = load_corpus(cache)
    assert loaded.sources == built.sources
    assert loaded.dependency_heldout_files == built.dependency_heldout_files
    assert loaded.train_files == built.train_files

    # A cache made with the dependencies is not silently reused without them (nor the reverse).
    with pytest.raises(SystemExit, match="made with --with-dependencies"):
        pycode.prepare_corpus(pycode.parse_args([*TINY, "--corpus-cache", str(cache)]))

    refused = pycode.parse_args([*TINY, "--with-dependencies"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data, "DEPENDENCY_DISTRIBUTIONS", ("psycopg",))
        with pytest.raises(SystemExit, match="--with-dependencies: .*psycopg.*LGPL"):
            pycode.prepare_corpus(refused)


def test_no_held_out_dependency_file_is_a_near_copy_of_a_file_trained_on():
    """With every listed dependency: vendored copies (typer's click) and repeated templates stay out, and
    a held-out dependency file sharing most of its lines with a training file is dropped, not scored.
    (The stdlib split is v1's, kept as it is so that every model is compared on it: TRAINING.md lists its
    held-out files that share half their lines with a training file.)"""
    corpus = data.with_dependencies(data.stdlib_corpus())
    assert not any(f.startswith("site-packages/typer/_click/") for f in corpus.train)

    def lines(text: str) -> set[str]:
        return {line.strip() for line in text.splitlines() if len(line.strip()) >= 12}

    train = [lines(t) for t in corpus.texts(corpus.train)]
    heldout = [f for f in corpus.heldout if f.startswith("site-packages/")]
    assert len(heldout) > 40
    for name, text in zip(heldout, corpus.texts(heldout), strict=True):
        own = lines(text)
        if own:
            worst = max(len(own & other) for other in train) / len(own)
            assert worst < data.NEAR_COPY_SHARE, (
                f"{name} shares {worst:.0%} of its lines with a training file"
            )


def test_near_copies_finds_a_file_that_repeats_most_of_another():
    body = [f"value_{i} = compute_something({i})" for i in range(10)]
    heldout = {"copy.py": "\n".join(body), "own.py": "\n".join(f"other_name_{i} = 1" for i in range(10))}
    others = ["\n".join(body[:6] + ["something_else_entirely()"])]  # 6 of copy.py's 10 lines
    assert data.near_copies(heldout, others) == {"copy.py"}
    assert data.near_copies(heldout, others, share=0.7) == set()
