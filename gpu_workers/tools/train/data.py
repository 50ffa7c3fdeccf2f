"""The training corpus: the standard library's .py files, a fixed held-out split, and the BPE tokenizer."""

from __future__ import annotations

import hashlib
import math
import os
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


@dataclass(frozen=True)
class Corpus:
    """The stdlib files used, as sorted POSIX paths relative to ``root``, split into train and held-out."""

    root: Path
    train: list[str]
    heldout: list[str]

    def texts(self, files: list[str]) -> list[str]:
        return [(self.root / name).read_text(encoding="utf-8") for name in files]


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
