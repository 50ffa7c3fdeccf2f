"""The held-out files every ``tessera eval`` scores: the standard-library files the training split
(``train.data.stdlib_corpus``, a rule on the SHA-256 of each path) kept out of training; or, with
``split="dependencies"``, the held-out files of the dependencies' sources the trainer can add
(``train.data.with_dependencies``, the same rule), which no model here was trained on either."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from gpu_workers.tools.train.data import is_dependency_file, stdlib_corpus, with_dependencies

DEFAULT_HELDOUT_PERCENT = 3


def heldout_percent(model_dir: Path) -> int:
    """The held-out share the model was trained with (its training.json), else the training default."""
    record = Path(model_dir) / "training.json"
    if not record.exists():
        return DEFAULT_HELDOUT_PERCENT
    hyper = json.loads(record.read_text()).get("hyperparameters", {})
    return int(hyper.get("heldout_percent", DEFAULT_HELDOUT_PERCENT))


SPLITS = ("stdlib", "dependencies")


def heldout_texts(
    model_dirs: Sequence[Path], max_files: int | None = None, split: str = "stdlib"
) -> dict[str, str]:
    """The held-out files of the models' split (``SPLITS``), by name; every model must share the split,
    or one of them would be scored on files it was trained on."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    percents = {Path(d): heldout_percent(d) for d in model_dirs}
    if len(set(percents.values())) > 1:
        shown = ", ".join(f"{d}: {p}%" for d, p in percents.items())
        raise ValueError(
            f"the models were trained with different held-out splits ({shown}); compare models that "
            "share one, or some would be scored on their own training files"
        )
    percent = next(iter(percents.values()), DEFAULT_HELDOUT_PERCENT)
    corpus = stdlib_corpus(heldout_percent=percent)
    files = corpus.heldout
    if split == "dependencies":
        corpus = with_dependencies(corpus, heldout_percent=percent)
        files = [f for f in corpus.heldout if is_dependency_file(f)]
    files = files[:max_files] if max_files else files
    return dict(zip(files, corpus.texts(files), strict=True))
