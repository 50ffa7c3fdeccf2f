"""The tokenised training corpus in one file (``--corpus-cache``), so another machine trains on exactly it.

Another Python version ships another standard library, so the files, their split and the streams would
differ there; the cache carries the split's file lists, the tokenizer and both token streams.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

FORMAT = 1


@dataclass(frozen=True)
class TokenisedCorpus:
    """The split (file lists, sorted POSIX paths), the tokenizer and the int64 token streams it gives."""

    train_files: list[str]
    heldout_files: list[str]
    heldout_percent: int
    tokenizer: Tokenizer
    train_stream: torch.Tensor
    heldout_stream: torch.Tensor
    python_version: str = sys.version.split()[0]
    # Dependencies' sources in the training split (dicts of train.data.Source's fields), and their held-out
    # files: kept out of training like the stdlib's, not in ``heldout_stream`` (which stays the stdlib's, the
    # split every model here shares and is compared on).
    sources: tuple[dict, ...] = ()
    dependency_heldout_files: tuple[str, ...] = ()
    # Both streams were tokenised from the files with their docstrings cut (train.docstrings).
    short_docstrings: bool = False


def save_corpus(corpus: TokenisedCorpus, path: Path) -> str:
    """Write ``corpus`` to ``path`` (torch.save of plain lists, strings and tensors); return its sha256."""
    vocab = corpus.tokenizer.get_vocab_size()
    stored = torch.int16 if vocab <= torch.iinfo(torch.int16).max else torch.int32  # 4x smaller to carry
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "format": FORMAT,
            "train_files": corpus.train_files,
            "heldout_files": corpus.heldout_files,
            "heldout_percent": corpus.heldout_percent,
            "tokenizer": corpus.tokenizer.to_str(),
            "train_stream": corpus.train_stream.to(stored),
            "heldout_stream": corpus.heldout_stream.to(stored),
            "python_version": corpus.python_version,
            "sources": list(corpus.sources),
            "dependency_heldout_files": list(corpus.dependency_heldout_files),
            "short_docstrings": corpus.short_docstrings,
        },
        path,
    )
    return file_sha256(path)


def load_corpus(path: Path) -> TokenisedCorpus:
    """The corpus ``save_corpus`` wrote; ValueError names what is wrong with a file that is not one."""
    try:
        data = torch.load(path, weights_only=True)
    except Exception as exc:  # torch raises several types for a file that is not a torch.save archive
        raise ValueError(f"{path} is not a corpus cache (torch.load failed: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a corpus cache of format {FORMAT}; delete it to rebuild it")
    return TokenisedCorpus(
        train_files=list(data["train_files"]),
        heldout_files=list(data["heldout_files"]),
        heldout_percent=int(data["heldout_percent"]),
        tokenizer=Tokenizer.from_str(data["tokenizer"]),
        train_stream=data["train_stream"].long(),
        heldout_stream=data["heldout_stream"].long(),
        python_version=data["python_version"],
        sources=tuple(data.get("sources", ())),
        dependency_heldout_files=tuple(data.get("dependency_heldout_files", ())),
        short_docstrings=bool(data.get("short_docstrings", False)),
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
