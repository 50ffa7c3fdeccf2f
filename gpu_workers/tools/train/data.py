"""The training corpus: the standard library's .py files (and, on request, the pure-Python sources of the
project's permissively licensed dependencies), a fixed held-out split, and the BPE tokenizer."""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from gpu_workers.tokenizer import train_byte_level_bpe

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
# Tests are skipped (they are most of the stdlib's bytes and teach odd code); pydoc_data is prose in a string.
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "pydoc_data", "__pycache__"})
# Generated charmap codecs (encodings/cp1252.py, ...) are 256-entry tables, near-identical to each other:
# data rather than code, and a held-out one would be predicted from its training-split twins.
CODEC_TABLE_MARKER = "decoding_table = ("


# The project's dependencies (direct and transitive) whose sources ``--with-dependencies`` adds: each is
# permissively licensed (checked against its metadata when the corpus is built) and written mostly by hand.
# Left out: copyleft or MPL ones (psycopg, hypothesis, certifi, tqdm), generated or table-like code (openai's
# API types, idna's and wcwidth's Unicode tables, pygments' lexers), vendoring installers (pip, setuptools),
# and the very large ones that would outweigh everything else (torch, transformers, sympy, numpy).
DEPENDENCY_DISTRIBUTIONS: tuple[str, ...] = (
    "alembic", "amqp", "annotated-types", "anyio", "attrs", "billiard", "cachetools", "celery", "click",
    "click-didyoumean", "click-plugins", "click-repl", "fastapi", "filelock", "fsspec", "grimp", "h11",
    "httpcore", "httpx", "import-linter", "iniconfig", "itsdangerous", "Jinja2", "jsonschema", "kombu",
    "Mako", "markdown-it-py", "MarkupSafe", "mdurl", "networkx", "packaging", "pluggy", "prometheus_client",
    "prompt_toolkit", "psutil", "pydantic", "pydantic-settings", "pyparsing", "pytest", "python-dateutil",
    "python-dotenv", "python-multipart", "redis", "referencing", "rich", "six", "sniffio", "sortedcontainers",
    "SQLAlchemy", "sse-starlette", "starlette", "triton", "typer", "typing-inspection", "typing_extensions",
    "tzlocal", "uvicorn", "vine",
)  # fmt: skip
# Copies of other code inside a distribution: typer vendors click, alembic's templates repeat each other.
# Left out, and any held-out file that still shares most of its lines with a file outside the held-out
# split is dropped (``near_copies``), so no held-out file is predicted from its own copy.
SKIPPED_DEPENDENCY_PATHS = ("typer/_click/", "alembic/templates/")
VENDORED_DIRS = frozenset({"_vendor", "vendor", "_vendored", "vendored"})
NEAR_COPY_SHARE = 0.5
PERMISSIVE = re.compile(r"\b(MIT|BSD|Apache|ISC|PSF|Python Software Foundation)\b", re.IGNORECASE)
SITE_PACKAGES = "site-packages"  # the prefix of a dependency's file names in a corpus


@dataclass(frozen=True)
class Source:
    """One dependency in the corpus: what it is, under which licence, and how many of its files are used."""

    distribution: str
    version: str
    licence: str
    files: int


@dataclass(frozen=True)
class Corpus:
    """The files used, as sorted POSIX names split into train and held-out; ``root`` holds the stdlib's,
    ``site_root`` those named ``site-packages/...`` (a dependency's file, relative to its install root)."""

    root: Path
    train: list[str]
    heldout: list[str]
    site_root: Path | None = None
    sources: tuple[Source, ...] = ()

    def path(self, name: str) -> Path:
        if is_dependency_file(name) and self.site_root is not None:
            return self.site_root / name.partition("/")[2]
        return self.root / name

    def texts(self, files: list[str]) -> list[str]:
        return [self.path(name).read_text(encoding="utf-8") for name in files]


def is_dependency_file(name: str) -> bool:
    """Whether a corpus file name is a dependency's (``site-packages/...``), not the stdlib's."""
    return name.startswith(SITE_PACKAGES + "/")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(root: Path | None = None, heldout_percent: int = 3) -> Corpus:
    """Every non-empty, UTF-8 .py file of the stdlib outside SKIPPED_DIRS, minus codec tables.

    A file is held out when the SHA-256 of its relative path falls in the first ``heldout_percent`` of
    100 buckets: deterministic, independent of which other files exist, and stable across machines.
    """
    root = root or stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            path = Path(dirpath) / filename
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip() and CODEC_TABLE_MARKER not in text:
                files.append(path.relative_to(root).as_posix())
    files.sort()
    heldout = [f for f in files if is_heldout(f, heldout_percent)]
    return Corpus(root, [f for f in files if f not in set(heldout)], heldout)


def with_dependencies(
    corpus: Corpus, names: tuple[str, ...] | None = None, heldout_percent: int = 3
) -> Corpus:
    """``corpus`` plus the .py files of the installed distributions ``names`` (DEPENDENCY_DISTRIBUTIONS), by
    the same rules (test directories skipped, the same hash rule on each file's ``site-packages/...`` name
    for the split), without vendored copies, and without held-out files that are near copies of another
    file (``near_copies``).

    A distribution that is not installed, has no Python files, or whose metadata names no permissive
    licence is an error: the corpus is what its record says, or it is not built.
    """
    texts: dict[str, str] = {}  # every dependency file used, by name: read once
    outside: list[str] = []  # texts of the skipped copies
    sources, site_root = [], None
    for name in DEPENDENCY_DISTRIBUTIONS if names is None else names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(f"dependency {name!r} is not installed: install the project's extras") from None
        licence = distribution_licence(dist)
        if not PERMISSIVE.search(licence):
            raise ValueError(f"dependency {name!r} is licensed {licence!r}, not a permissive licence")
        root = Path(dist.locate_file("")).resolve()
        site_root = site_root or root
        if root != site_root:
            raise ValueError(
                f"dependency {name!r} is installed in {root}, not with the others in {site_root}"
            )
        used = 0
        for entry in dist.files or ():
            parts = entry.parts
            if entry.suffix != ".py" or parts[0].endswith((".dist-info", ".data")) or parts[0] == "..":
                continue
            if any(part in SKIPPED_DIRS or part in VENDORED_DIRS for part in parts[:-1]):
                continue
            try:
                text = (root / entry).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not text.strip():
                continue
            if entry.as_posix().startswith(SKIPPED_DEPENDENCY_PATHS):
                outside.append(text)  # not trained on, but a held-out file must not be a copy of it
                continue
            texts[f"{SITE_PACKAGES}/{entry.as_posix()}"] = text
            used += 1
        if not used:
            raise ValueError(f"dependency {name!r} has no Python source files to train on")
        sources.append(Source(dist.metadata["Name"], dist.version, licence, used))
    names_sorted = sorted(texts)
    heldout = [f for f in names_sorted if is_heldout(f, heldout_percent)]
    held = set(heldout)
    train = [f for f in names_sorted if f not in held]
    others = [*corpus.texts(corpus.train), *(texts[f] for f in train), *outside]
    copies = near_copies({f: texts[f] for f in heldout}, others)
    return Corpus(
        corpus.root,
        corpus.train + train,
        corpus.heldout + [f for f in heldout if f not in copies],
        site_root,
        tuple(sources),
    )


def near_copies(heldout: dict[str, str], others: list[str], share: float = NEAR_COPY_SHARE) -> set[str]:
    """The names in ``heldout`` that share at least ``share`` of their distinct lines (stripped, 12+
    characters: not ``else:`` or ``return None``) with one of ``others``."""
    lines = {name: _lines(text) for name, text in heldout.items()}
    holders: dict[str, list[str]] = {}
    for name, own in lines.items():
        for line in own:
            holders.setdefault(line, []).append(name)
    found: set[str] = set()
    for text in others:
        shared: dict[str, int] = {}
        for line in _lines(text) & holders.keys():
            for name in holders[line]:
                shared[name] = shared.get(name, 0) + 1
        found.update(name for name, n in shared.items() if n >= share * len(lines[name]))
    return found


def _lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) >= 12}


def distribution_licence(dist: importlib.metadata.Distribution) -> str:
    """The licence a distribution declares: the first of its SPDX expression, a one-line License field and
    its licence classifiers that names a permissive licence, else the first of them it has."""
    meta = dist.metadata
    field = (meta.get("License") or "").strip()
    classifiers = [
        c.split("::")[-1].strip() for c in meta.get_all("Classifier") or () if c.startswith("License")
    ]
    candidates = [
        meta.get("License-Expression") or "",
        field if "\n" not in field and len(field) < 80 else "",
        " / ".join(classifiers),
        field.split("\n", 1)[0],
    ]
    named = [c for c in candidates if c]
    return next((c for c in named if PERMISSIVE.search(c)), named[0] if named else "")


def is_heldout(relative_path: str, percent: int) -> bool:
    digest = hashlib.sha256(relative_path.encode()).hexdigest()
    return int(digest[:8], 16) % 100 < percent


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over the training split; encoding prepends <|bos|> like Llama."""
    return train_byte_level_bpe(texts, vocab_size, SPECIAL_TOKENS)


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one int64 stream, each file as <|bos|> tokens <|eos|>: the model learns where files end."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids += encoding.ids
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def eval_windows(stream: torch.Tensor, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping (inputs, targets) windows covering every token after the first exactly once."""
    windows = []
    for start in range(0, len(stream) - 1, seq_len):
        chunk = stream[start : start + seq_len + 1]
        windows.append((chunk[:-1], chunk[1:]))
    return windows


def unigram_perplexity(train: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of ``targets`` under the training split's token frequencies (add-one smoothed)."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1
    log_probs = (counts / counts.sum()).log()
    return math.exp(-log_probs[targets].mean().item())
