"""Move a sequence's KV out of one cache and into another, converting formats: the prefill→decode hand-off.

A ``KVBlock`` holds the first ``num_tokens`` tokens of a sequence, free of any page layout except one thing:
an FP8 block keeps the scale every page was written with, one per (layer, page of ``page_size`` tokens) for
K and V, so FP8 travels bit for bit and is never quantised a second time. An INT8 block is its entries as
stored, each with its own scale (keys Hadamard-rotated, as an INT8 cache stores them): bit for bit into
any INT8 cache, whatever its page size. A cache whose values are its keys
(``KVSpec.v_is_k``: MLA's latent entry) sends that one tensor once: the block's ``v`` and ``v_scale`` are
None.

The steps are split so that an engine holds its lock only for plain copies:
- ``read_pages`` (under the sending engine's lock): the tokens as the cache stores them, with their pages'
  scales; a copy, because the pages are freed right after.
- ``convert`` (outside it): into the receiving pool's format. A format to itself changes nothing; an
  unquantised block quantised to FP8 gets one power-of-two scale per layer from its own amax, the scale the
  receiving cache would give a prompt written in one step (the dynamic scheme of ``kv.cache``); to INT8,
  the entries the receiving cache would write.
- ``for_cache`` (outside the receiving engine's lock): checked against the cache, and in its format and
  page size; a static-scale FP8 cache requantises to its own scales.
- ``write_pages`` (under that lock): copy into freshly allocated pages, which carry fresh integrity tags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch

from gpu_workers.formats.fp8 import (
    FP8_DTYPE,
    SCALE_DTYPE,
    dequantize_fp8_entry,
    fp8_scale_pow2,
    quantize_fp8_entry,
)
from gpu_workers.formats.kv_int8 import (
    SCALE_BYTES,
    dequantize_int8_entries,
    hadamard,
    quantize_int8_entries,
    rotation_block,
)
from gpu_workers.kv.cache import KVCache

KV_FORMATS = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
    "fp8_e4m3": FP8_DTYPE,
}
FP8 = "fp8_e4m3"
INT8 = "int8"


class InvalidKVBlock(ValueError):
    """A block that cannot be imported: malformed, or built for another model or format."""


def kv_format_name(dtype: torch.dtype) -> str:
    """The transport name of a cache element type (``KVCache.dtype``)."""
    return next(name for name, d in KV_FORMATS.items() if d == dtype)


@dataclass
class KVBlock:
    kv_format: str
    num_tokens: int
    k: (
        torch.Tensor
    )  # [layers, tokens, kv_heads, head_dim]; uint8 bits for fp8_e4m3, int8 entries (+2) for int8
    v: torch.Tensor | None  # None: the values are the keys (a v_is_k entry, sent once)
    k_scale: torch.Tensor | None = None  # [layers, pages] fp32, fp8_e4m3 only: each page's scale
    v_scale: torch.Tensor | None = None
    page_size: int = 0  # tokens per page of the cache it came from; what the FP8 scales are per
    bf16_tail: int = 0  # fp8_e4m3 only: values at the end of each entry kept in bf16 (``KVSpec.bf16_tail``)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    @property
    def v_is_k(self) -> bool:
        return self.v is None

    @property
    def num_pages(self) -> int:
        return -(-self.num_tokens // self.page_size) if self.page_size else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """Named tensors for serialisation (safetensors); ``metadata`` holds the rest."""
        out = {"k": self.k, "v": self.v, "k_scale": self.k_scale, "v_scale": self.v_scale}
        return {name: t for name, t in out.items() if t is not None}

    def metadata(self) -> str:
        return json.dumps(
            {"kv_format": self.kv_format, "page_size": self.page_size, "bf16_tail": self.bf16_tail}
        )

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], metadata: str) -> KVBlock:
        meta = json.loads(metadata)
        k, v = tensors["k"], tensors.get("v")
        block = cls(
            meta["kv_format"],
            k.shape[1],
            k,
            v,
            tensors.get("k_scale"),
            tensors.get("v_scale"),
            meta["page_size"],
            int(meta.get("bf16_tail", 0)),
        )
        check(block)
        return block

    def to(self, device: torch.device | str) -> KVBlock:
        def move(t):
            return None if t is None else t.to(device)

        return replace(
            self, k=move(self.k), v=move(self.v), k_scale=move(self.k_scale), v_scale=move(self.v_scale)
        )

    @property
    def head_dim(self) -> int:
        """Values per entry (an FP8 entry with a bf16 tail stores ``head_dim + bf16_tail`` bytes, an INT8
        entry ``head_dim`` codes and its scale)."""
        return self.k.shape[-1] - (SCALE_BYTES if self.kv_format == INT8 else self.bf16_tail)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as float32 [layers, tokens, kv_heads, head_dim]."""
        if self.kv_format == INT8:
            k = dequantize_int8_entries(self.k, torch.float32)
            if self.v is None:  # a latent entry: its values are its keys, not rotated
                return k, k
            block = rotation_block(self.head_dim)  # H H = block * I: rotated back
            return hadamard(k, block) / block, dequantize_int8_entries(self.v, torch.float32)
        if self.kv_format != FP8:
            k = self.k.float()
            return k, (k if self.v is None else self.v.float())
        page_of = torch.arange(self.num_tokens, device=self.k.device) // self.page_size

        def read(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return dequantize_fp8_entry(bits, scale[:, page_of, None, None], torch.float32, self.head_dim)

        k = read(self.k, self.k_scale)
        return k, (k if self.v is None else read(self.v, self.v_scale))


def check(block: KVBlock, spec=None) -> None:
    """Raise InvalidKVBlock saying what is wrong with ``block`` (against the model's ``KVSpec`` if given)."""
    if block.kv_format not in KV_FORMATS:
        raise InvalidKVBlock(f"unknown KV format {block.kv_format!r}; expected one of {sorted(KV_FORMATS)}")
    k, v = block.k, block.k if block.v is None else block.v
    if k.dim() != 4 or k.shape != v.shape or k.shape[1] != block.num_tokens:
        raise InvalidKVBlock(
            f"K {tuple(k.shape)} and V {tuple(v.shape)} must both be [layers, {block.num_tokens} tokens, "
            "KV heads, head dim]"
        )
    if spec is not None and block.v_is_k and not spec.v_is_k:
        raise InvalidKVBlock(
            "this KV block has no V (its values are its keys), but this model's cache stores V"
        )
    stored = torch.uint8 if block.kv_format == FP8 else KV_FORMATS[block.kv_format]
    if k.dtype != stored or v.dtype != stored:
        raise InvalidKVBlock(f"a {block.kv_format} block stores {stored}, got K {k.dtype} and V {v.dtype}")
    if block.bf16_tail and (block.kv_format != FP8 or not 0 < block.bf16_tail < block.head_dim):
        raise InvalidKVBlock(
            f"bf16_tail {block.bf16_tail} is only for fp8_e4m3 blocks, below the entry's "
            f"{block.head_dim} values"
        )
    if spec is not None and (k.shape[0], k.shape[2], block.head_dim) != (
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
    ):
        raise InvalidKVBlock(
            f"KV block of shape {tuple(k.shape)} does not fit this model's cache "
            f"({spec.num_layers} layers, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}); "
            "do both pools serve the same checkpoint?"
        )
    if block.kv_format != FP8:
        if block.k_scale is not None or block.v_scale is not None:
            raise InvalidKVBlock(f"a {block.kv_format} block has no page scales (only fp8_e4m3 blocks do)")
        return
    expected = (k.shape[0], block.num_pages)
    scales = [("k_scale", block.k_scale)] + ([] if block.v_is_k else [("v_scale", block.v_scale)])
    for name, scale in scales:
        if block.page_size <= 0 or scale is None or tuple(scale.shape) != expected:
            raise InvalidKVBlock(
                f"an fp8_e4m3 block needs {name} of shape [layers, pages] = {list(expected)} for its "
                f"page_size ({block.page_size}), got {None if scale is None else list(scale.shape)}"
            )
        if scale.dtype != SCALE_DTYPE or not bool(torch.isfinite(scale).all() and (scale > 0).all()):
            raise InvalidKVBlock(f"{name} must be finite, positive {SCALE_DTYPE} scales")


def _slots(pages: list[int], num_tokens: int, page_size: int, device) -> torch.Tensor:
    positions = torch.arange(num_tokens, device=device)
    table = torch.tensor(pages, dtype=torch.long, device=device)
    return table[positions // page_size] * page_size + positions % page_size


def _flat(cache: KVCache, t: torch.Tensor) -> torch.Tensor:
    """[layers, slots, kv_heads, stored dim] view of the cache's K or V."""
    return t.view(cache.spec.num_layers, -1, cache.spec.num_kv_heads, cache.spec.stored_dim(cache.dtype))


def read_pages(cache: KVCache, pages: list[int], num_tokens: int) -> KVBlock:
    """A copy of tokens [0, num_tokens) held in ``pages``, as the cache stores them (cheap: run it under the lock)."""
    device = cache.k.device
    slots = _slots(pages, num_tokens, cache.page_size, device)
    v_is_k = cache.spec.v_is_k
    k = _flat(cache, cache.k).index_select(1, slots)
    v = None if v_is_k else _flat(cache, cache.v).index_select(1, slots)
    block = KVBlock(
        kv_format_name(cache.dtype), num_tokens, k, v, page_size=cache.page_size, bf16_tail=cache.tail
    )
    if cache.page_scaled:
        held = torch.tensor(pages[: block.num_pages], dtype=torch.long, device=device)
        block.k_scale = cache.k_scale[:, held]
        block.v_scale = None if v_is_k else cache.v_scale[:, held]
    return block


def convert(block: KVBlock, kv_format: str) -> KVBlock:
    """``block`` in ``kv_format``, on the CPU (for the wire); a block already in it stays as it is."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown KV format {kv_format!r}; expected one of {sorted(KV_FORMATS)}")
    if block.kv_format == kv_format:
        return block.to("cpu")
    k, v = block.dequantized()
    v = None if block.v_is_k else v
    if kv_format == INT8:
        return _int8_block(k, v, block.page_size).to("cpu")
    if kv_format != FP8:
        dtype = KV_FORMATS[kv_format]
        return KVBlock(
            kv_format, block.num_tokens, k.to(dtype).cpu(), _cast(v, dtype), page_size=block.page_size
        )
    page_size = block.page_size or block.num_tokens  # a layout-free block: all of it is one page
    return _quantized(k, v, fp8_scale_pow2(_amax(k)), _scale_of(v), page_size).to("cpu")


def for_cache(block: KVBlock, cache: KVCache) -> KVBlock:
    """``block`` checked against ``cache`` and converted to its format and page size, on its device."""
    check(block, cache.spec)
    block = block.to(cache.k.device)
    kv_format = kv_format_name(cache.dtype)
    if block.v is not None and cache.spec.v_is_k:  # a sender that sent the shared tensor twice
        block = replace(block, v=None, v_scale=None)
    if not cache.page_scaled:
        if block.kv_format == kv_format:
            return block  # as stored: unquantised, or INT8 entries with their own scales
        k, v = block.dequantized()
        v = None if block.v_is_k else v
        if kv_format == INT8:
            return _int8_block(k, v, cache.page_size)
        return KVBlock(
            kv_format, block.num_tokens, k.to(cache.dtype), _cast(v, cache.dtype), page_size=cache.page_size
        )
    static = cache.static_scales
    same_layout = block.page_size == cache.page_size and block.bf16_tail == cache.tail
    if block.kv_format == FP8 and same_layout and static is None:
        return block  # the pages' own scales: bit for bit what the sending cache held
    k, v = block.dequantized()
    v = None if block.v_is_k else v
    if static is not None:
        k_scale = torch.tensor(static.k_scale, dtype=SCALE_DTYPE, device=k.device)
        v_scale = None if v is None else torch.tensor(static.v_scale, dtype=SCALE_DTYPE, device=k.device)
    else:
        k_scale, v_scale = fp8_scale_pow2(_amax(k, cache.tail)), _scale_of(v, cache.tail)
    return _quantized(k, v, k_scale, v_scale, cache.page_size, cache.tail)


def write_pages(cache: KVCache, pages: list[int], block: KVBlock) -> None:
    """Copy a ``for_cache`` block into ``pages`` (allocated for at least ``block.num_tokens`` tokens)."""
    if block.kv_format != kv_format_name(cache.dtype) or (
        cache.page_scaled and (block.page_size, block.bf16_tail) != (cache.page_size, cache.tail)
    ):
        raise InvalidKVBlock(
            f"a {block.kv_format} block of page size {block.page_size} (bf16 tail {block.bf16_tail}) cannot "
            f"be copied into a {kv_format_name(cache.dtype)} cache of page size {cache.page_size} (bf16 tail "
            f"{cache.tail}); convert it with for_cache"
        )
    if block.v_is_k != cache.spec.v_is_k:
        raise InvalidKVBlock("a block without V fits only a cache whose values are its keys; use for_cache")
    device = cache.k.device
    slots = _slots(pages, block.num_tokens, cache.page_size, device)
    _flat(cache, cache.k)[:, slots] = block.k
    if not cache.spec.v_is_k:  # else V is K's own tensor, written just now
        _flat(cache, cache.v)[:, slots] = block.v
    if cache.page_scaled:
        held = torch.tensor(pages[: block.num_pages], dtype=torch.long, device=device)
        cache.k_scale[:, held] = block.k_scale
        if not cache.spec.v_is_k:
            cache.v_scale[:, held] = block.v_scale


def _int8_block(k: torch.Tensor, v: torch.Tensor | None, page_size: int) -> KVBlock:
    """An INT8 block of float K/V (V absent when the values are the keys): the entries a cache writes,
    keys rotated unless they are the values too."""
    if v is None:
        return KVBlock(INT8, k.shape[1], quantize_int8_entries(k), None, page_size=page_size)
    keys = quantize_int8_entries(hadamard(k, rotation_block(k.shape[-1])))
    return KVBlock(INT8, k.shape[1], keys, quantize_int8_entries(v), page_size=page_size)


def _cast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype)


def _scale_of(x: torch.Tensor | None, tail: int = 0) -> torch.Tensor | None:
    """The dynamic per-layer scale of ``x`` (None for an absent V)."""
    return None if x is None else fp8_scale_pow2(_amax(x, tail))


def _amax(x: torch.Tensor, tail: int = 0) -> torch.Tensor:
    """Per-layer amax of the values an FP8 scale covers (all but a bf16 tail)."""
    return x[..., : x.shape[-1] - tail].abs().amax(dim=(1, 2, 3))


def _quantized(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor | None,
    page_size: int,
    tail: int = 0,
) -> KVBlock:
    """An FP8 block of float K/V quantised with one scale per layer, recorded for each of its pages (V
    absent when the values are the keys)."""
    num_tokens = k.shape[1]
    num_pages = -(-num_tokens // page_size)

    def bits(x: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else quantize_fp8_entry(x, scale[:, None, None, None], tail)

    def per_page(scale: torch.Tensor | None) -> torch.Tensor | None:
        return None if scale is None else scale[:, None].expand(-1, num_pages).contiguous()

    return KVBlock(
        FP8,
        num_tokens,
        bits(k, k_scale),
        bits(v, v_scale),
        per_page(k_scale),
        per_page(v_scale),
        page_size,
        tail,
    )
