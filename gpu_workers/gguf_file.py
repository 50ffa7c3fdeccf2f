"""GGUF checkpoints (llama.cpp's one-file format), read with struct and numpy and the ``gguf`` package's
constants: the key/values and tensor table in one pass over the file's head, each tensor's bytes a view of the
memory-mapped file.

What a file declares, as Hugging Face names it: the config (``hf_config``: a config.json dict), the
tokenizer's parts and chat template (``metadata``), and each tensor under its HF name with its GGML type
(``tensors``). Torch-free (numpy only), so the gateway reads a GGUF's tokenizer and limits without torch.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # gguf is imported when a file is read: a gateway serving no GGUF never pays its ~0.1 s
    from gguf import GGMLQuantizationType

# GGUF's ``general.architecture`` -> the HF architecture it is served as. llama.cpp writes Mistral's dense
# models (7B, Nemo) and SmolLM2 as "llama".
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp's converter permutes these architectures' q/k rows for its interleaved rotary (GPT-J style);
# HF's rotary rotates halves (GPT-NeoX style), so loading undoes it. Qwen's rows are stored as in HF.
PERMUTED_QK = ("llama",)
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # the layouts read here; version 1 counted with 32-bit integers
_MIN_HEADER = 24  # magic, version, tensor count, key/value count
# Tensors gguf.GGUFReader (so this module) views as their elements; every other type as its bytes.
_PLAIN_TENSOR_DTYPES = {
    "F16": "f2",
    "F32": "f4",
    "F64": "f8",
    "I8": "i1",
    "I16": "i2",
    "I32": "i4",
    "I64": "i8",
}

# Per-layer tensors: GGUF's name after ``blk.N.`` -> the HF module name after ``model.layers.N.``.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Derivable tables some converters store: llama.cpp's Llama 3 rope frequency factors (checked against the
# config by ``checkpoint``) and rotary caches.
DERIVED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GGUFError(ValueError):
    """A GGUF file that cannot be served: what is wrong and what was expected."""


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes, whatever its name)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == _MAGIC


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file under its HF name: its GGML type name (``F32``, ``Q4_1``...), its shape
    as torch orders it ([out, in] for a linear's weight), and its bytes as the file stores them (a
    read-only view of the memory-mapped file: [rows, bytes per row] for block-quantised types)."""

    name: str
    gguf_name: str
    type: str
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as the file's tensor table lists it: GGUF name, GGML type, dims in GGML order (innermost
    first), and where its bytes lie in the file."""

    name: str
    type: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Everything before a GGUF file's tensor data: its version, its key/values as Python values (what
    ``gguf.GGUFReader``'s ``field.contents()`` gives), and its tensor table."""

    version: int
    byte_order: str  # struct's "<" or ">"
    fields: dict[str, Any]
    tensors: list[TensorInfo]


def read_header(path: str | Path) -> GGUFHeader:
    """Parse the key/value section and tensor table of the GGUF v2/v3 file at ``path``; raises GGUFError,
    naming the file, for one that is not GGUF, is truncated or is malformed.

    ``gguf.GGUFReader`` builds numpy views of every part of every value (each of a 49k-token vocabulary's
    strings and lengths) before a value can be read: ~2 s for SmolLM2. This reads each value once, as it
    comes, in a few percent of that."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _MIN_HEADER:
                raise GGUFError(
                    f"{path} is not a GGUF file: it is {size} bytes, shorter than a GGUF header ({_MIN_HEADER})"
                )
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _Parser(buf, path).header()
    except OSError as e:
        raise GGUFError(f"{path} cannot be read as a GGUF file: {e}") from None


class GGUFFile:
    """A GGUF file's metadata (read whole when opened) and tensors (views of the file, mapped when asked for)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        header = read_header(self.path)
        self._byte_order = header.byte_order
        self._fields = header.fields
        self._tensors = header.tensors

    def get(self, key: str, default: Any = None) -> Any:
        value = self._fields.get(key, default)
        return list(value) if isinstance(value, list) else value  # the caller's own, as GGUFReader's are

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path.name} has no {key!r}; the model's shape cannot be known without it")
        return value

    @property
    def metadata(self) -> dict[str, Any]:
        """Every key/value of the file, as ``get`` reads them."""
        return {key: self.get(key) for key in self._fields}

    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFError(
                f"GGUF architecture {arch!r} in {self.path.name} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)}"
            )
        return arch

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self._tensors}

    def tensors(self) -> list[GGUFTensor]:
        """Every tensor under its HF name, in file order; raises GGUFError for a name with no HF place."""
        data = np.memmap(self.path, mode="r")
        out = []
        for t in self._tensors:
            if t.name in DERIVED_TENSORS:
                continue
            shape = tuple(reversed(t.dims))
            out.append(
                GGUFTensor(hf_name(t.name, self.path), t.name, t.type.name, shape, self._view(data, t))
            )
        return out

    def _view(self, data: np.ndarray, t: TensorInfo) -> np.ndarray:
        # As gguf.GGUFReader views a tensor: its elements for the plain types, else its bytes, [rows, bytes
        # per row].
        from gguf.quants import quant_shape_to_byte_shape

        shape = tuple(reversed(t.dims))
        dtype = _PLAIN_TENSOR_DTYPES.get(t.type.name)
        if dtype is None:
            try:
                dtype, shape = "u1", quant_shape_to_byte_shape(shape, t.type)
            except ValueError as e:
                raise GGUFError(f"tensor {t.name!r} in {self.path} cannot be read: {e}") from None
        view = data[t.offset : t.offset + t.nbytes].view(np.dtype(dtype).newbyteorder(self._byte_order))
        return view.reshape(shape)

    def hf_config(self) -> dict[str, Any]:
        """The file's hyperparameters as a Hugging Face ``config.json`` dict."""
        arch = self.architecture
        p = f"{arch}."
        num_heads = int(self.require(p + "attention.head_count"))
        hidden = int(self.require(p + "embedding_length"))
        names = self.tensor_names
        vocab = self.get(p + "vocab_size")
        if vocab is None:
            vocab = len(self.require("tokenizer.ggml.tokens"))
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[arch]],
            "model_type": arch,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self.require(p + "feed_forward_length")),
            "num_hidden_layers": int(self.require(p + "block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self.get(p + "attention.head_count_kv", num_heads)),
            "head_dim": int(self.get(p + "attention.key_length", hidden // num_heads)),
            "max_position_embeddings": int(self.require(p + "context_length")),
            "rms_norm_eps": float(self.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.get(p + "rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "hidden_act": "silu",
        }
        scaling = self.get(p + "rope.scaling.type")
        if scaling not in (None, "none"):
            config["rope_scaling"] = {
                "rope_type": scaling,
                "factor": float(self.get(p + "rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": int(
                    self.get(p + "rope.scaling.original_context_length", config["max_position_embeddings"])
                ),
            }
        for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
            value = self.get(f"tokenizer.ggml.{key}")
            if value is not None:
                config[hf_key] = int(value)
        # Llama 3's instruct models end a turn with <|eot_id|>, which GGUF names apart from EOS.
        eot = self.get("tokenizer.ggml.eot_token_id")
        if eot is not None and eot != config.get("eos_token_id"):
            config["eos_token_id"] = [x for x in (config.get("eos_token_id"), int(eot)) if x is not None]
        return config

    def rope_freqs(self) -> np.ndarray | None:
        """llama.cpp's per-frequency rope divisors (Llama 3.1+), when the file stores them."""
        for t in self._tensors:
            if t.name == "rope_freqs.weight":
                return np.asarray(self._view(np.memmap(self.path, mode="r"), t), dtype=np.float32)
        return None

    def vocabulary(self) -> tuple[list[str], list[int], list[str]]:
        """Tokens, their GGML token types (1 normal, 3 control, 4 user-defined...) and BPE merges."""
        tokens = self.require("tokenizer.ggml.tokens")
        types = self.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = self.get("tokenizer.ggml.merges") or []
        return tokens, types, merges


class _Parser:
    """One pass over a GGUF file's head (a memory map of it); every read checks the file's end, so a
    truncated file is named as such with what was being read."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.size = buf, path, len(buf)
        self.pos = 0
        self.order = "<"
        self.reading = "header"
        self._structs: dict[str, struct.Struct] = {}

    def header(self) -> GGUFHeader:
        from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFValueType

        if self.buf[:4] != _MAGIC:
            raise GGUFError(
                f"{self.path} is not a GGUF file: it starts with {self.buf[:4]!r}, not {_MAGIC!r}"
            )
        (version,) = struct.unpack_from("<I", self.buf, 4)
        if version & 0xFFFF == 0:  # written on a big-endian machine (as gguf.GGUFReader tells them apart)
            self.order = ">"
            (version,) = struct.unpack_from(">I", self.buf, 4)
        if version not in _VERSIONS:
            raise GGUFError(
                f"{self.path} is GGUF version {version}; versions {' and '.join(map(str, _VERSIONS))} are read "
                "(llama.cpp has written version 3 since 2023: convert the model again)"
            )
        self.pos = 8
        tensor_count, kv_count = self.unpack("QQ")
        fields: dict[str, Any] = {}
        try:
            for i in range(kv_count):
                self.reading = f"key/value #{i}"
                key = self.string()
                self.reading = f"key/value {key!r}"
                if key in fields:
                    raise GGUFError(f"{self.path} holds key {key!r} twice")
                (value_type,) = self.unpack("I")
                if key == "general.alignment" and value_type != GGUFValueType.UINT32:
                    raise GGUFError(f"{self.path}: general.alignment must be a uint32")
                fields[key] = self.value(value_type)
            tensors = self.tensor_table(tensor_count)
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: the text of its {self.reading} is not UTF-8 ({e})") from None
        alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment is {alignment}, not a power of two")
        data_start = -(-self.pos // alignment) * alignment
        placed = []
        for t in tensors:
            t = TensorInfo(t.name, t.type, t.dims, data_start + t.offset, t.nbytes)
            if t.offset + t.nbytes > self.size:
                raise GGUFError(
                    f"{self.path} is truncated: tensor {t.name!r} ends at byte {t.offset + t.nbytes}, past the "
                    f"file's end ({self.size} bytes); download or convert it again"
                )
            placed.append(t)
        return GGUFHeader(version, self.order, fields, placed)

    def tensor_table(self, count: int) -> list[TensorInfo]:
        """The tensor table, each offset from the start of the data section."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensors, names = [], set()
        for i in range(count):
            self.reading = f"tensor table entry #{i}"
            name = self.string()
            self.reading = f"tensor table entry {name!r}"
            if name in names:
                raise GGUFError(f"{self.path} holds tensor {name!r} twice")
            names.add(name)
            (n_dims,) = self.unpack("I")
            dims = tuple(self.numbers("Q", n_dims))
            code, offset = self.unpack("IQ")
            try:
                ggml_type = GGMLQuantizationType(code)
            except ValueError:
                raise GGUFError(
                    f"tensor {name!r} in {self.path} has GGML type {code}, which the installed gguf package "
                    "does not know (a newer llama.cpp's type? upgrade gguf)"
                ) from None
            block, block_bytes = GGML_QUANT_SIZES[ggml_type]
            tensors.append(TensorInfo(name, ggml_type, dims, offset, math.prod(dims) * block_bytes // block))
        return tensors

    def value(self, value_type: int) -> Any:
        from gguf import GGUFValueType

        kind = self.kind(value_type)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item_type, count = self.unpack("IQ")
            return self.array(item_type, count)
        return self.unpack(_scalar_codes()[kind])[0]

    def array(self, item_type: int, count: int) -> list[Any]:
        from gguf import GGUFValueType

        kind = self.kind(item_type)
        if kind == GGUFValueType.STRING:
            return self.strings(count)
        if kind == GGUFValueType.ARRAY:
            # Arrays of arrays come back flattened, as gguf.GGUFReader's contents() gives them.
            out: list[Any] = []
            for _ in range(count):
                inner_type, inner_count = self.unpack("IQ")
                out += self.array(inner_type, inner_count)
            return out
        return self.numbers(_scalar_codes()[kind], count)

    def kind(self, code: int) -> Any:
        from gguf import GGUFValueType

        try:
            return GGUFValueType(code)
        except ValueError:
            raise GGUFError(
                f"{self.path}: its {self.reading} has value type {code}, not one of GGUF's "
                f"({', '.join(t.name for t in GGUFValueType)})"
            ) from None

    def numbers(self, code: str, count: int) -> list[Any]:
        dtype = np.dtype(self.order + code)
        start = self.skip(count * dtype.itemsize)
        return np.frombuffer(self.buf[start : self.pos], dtype).tolist()

    def string(self) -> str:
        (length,) = self.unpack("Q")
        start = self.skip(length)
        return str(self.buf[start : self.pos], "utf-8")

    def strings(self, count: int) -> list[str]:
        # The one loop that runs per vocabulary entry (~100k for a small model), so its names are local.
        buf, size, pos = self.buf, self.size, self.pos
        length = self.struct("Q").unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                raise self.truncated()
            (n,) = length(buf, pos)
            pos += 8 + n
            if pos > size:
                raise self.truncated()
            append(str(buf[pos - n : pos], "utf-8"))
        self.pos = pos
        return out

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        s = self.struct(fmt)
        return s.unpack_from(self.buf, self.skip(s.size))

    def struct(self, fmt: str) -> struct.Struct:
        s = self._structs.get(fmt)
        if s is None:
            s = self._structs[fmt] = struct.Struct(self.order + fmt)
        return s

    def skip(self, n: int) -> int:
        """Where the next ``n`` bytes start; moves past them."""
        start = self.pos
        if start + n > self.size:
            raise self.truncated()
        self.pos = start + n
        return start

    def truncated(self) -> GGUFError:
        return GGUFError(
            f"{self.path} is truncated or not a GGUF file: its {self.reading} runs past the file's end "
            f"({self.size} bytes); download or convert it again"
        )


@lru_cache(maxsize=1)
def _scalar_codes() -> dict[Any, str]:
    """GGUF's scalar value types -> their struct (and numpy) codes."""
    from gguf import GGUFValueType as V

    return {
        V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
        V.UINT64: "Q", V.INT64: "q", V.FLOAT32: "f", V.FLOAT64: "d", V.BOOL: "?",
    }  # fmt: skip


@lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file at ``path``, shared by its config, tokenizer and weights in one process."""
    path = Path(path).resolve()
    return _open(str(path), path.stat().st_mtime_ns)


def hf_name(gguf_name: str, path: Path | None = None) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    where = f" in {path.name}" if path else ""
    raise GGUFError(f"tensor {gguf_name!r}{where} has no place in the supported architectures' models")
