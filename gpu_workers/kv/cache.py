"""The KV tensors of one engine: pages of K and V for every layer in the engine's KV format.

Formats: unquantised (``float32``/``bfloat16``/``float16`` elements, stored as they are), ``int8`` (each
(token, KV head) entry its int8 codes and its own bf16 scale, ``formats.kv_int8``: nothing to open or
inherit, the scale is the entry's; keys stored Hadamard-rotated, read by queries rotated the same way,
``queries``) or ``float8_e4m3fn`` (uint8 bits of ``x / scale``, see ``formats``).
FP8 scales are per layer for K and V and stored per (layer, page), fp32, so that a page always carries the
scale it was written with: a prefix page shared by later sequences, or handed to another pool, stays
readable without its writer.

Where the scales come from:
- static: a calibration file (``tessera calibrate``) gives one scale per layer for K and V; every page of
  the layer uses it.
- dynamic (no file): a sequence's scale is set by its own K/V. When a step writes a page's first slot
  (the page is opened), the page gets ``max(scale of the sequence's previous page, amax of the sequence's
  new tokens this step / 448 rounded up to a power of two)``. So the first prefill chunk sets the scale
  from the prompt's amax, and pages opened later in prefill or decode inherit it, growing only if the new
  tokens need more range. Tokens written into an already opened page use its scale and saturate at
  ±448·scale if they exceed it. A sequence that starts from cached prefix pages inherits the scale of its
  last cached page. Power-of-two scales make the stored values (nearly) independent of where prefill
  chunks fall, so a request's output does not depend on the step token budget or its batch
  (``formats.fp8_scale_pow2``).
Scale bytes are part of every page's cost, so ``pages_for_budget`` stays honest about capacity.

A spec with ``bf16_tail`` (MLA's rope key) keeps those values in bf16 in an FP8 cache: each entry is the
e4m3 head followed by the tail's bf16 bytes, and the page scales come from the head alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_workers.formats.fp8 import SCALE_DTYPE, fp8_scale_pow2, is_fp8, quantize_fp8_entry, storage_dtype
from gpu_workers.formats.kv_int8 import hadamard, is_int8, rotation_block
from gpu_workers.kernels import use_cpu_kernels
from gpu_workers.kernels.kv_write import write_kv, write_kv_reference
from gpu_workers.kernels.kv_write_cpu import write_kv_fp8_cpu, write_kv_int8_cpu
from gpu_workers.kv.scales import KVScales
from gpu_workers.kv.spec import KVSpec


@dataclass
class WriteSpans:
    """Which sequence each token of a write belongs to, so dynamic FP8 scales are per sequence."""

    token_seq: torch.Tensor  # [T] row of the sequence each new token belongs to
    prev_page: torch.Tensor  # [S] page holding each sequence's token just before this write; -1 if none


class KVCache:
    """K and V pages, shape [layers, pages, page_size, kv_heads, head_dim] each.

    A token's slot is ``page * page_size + offset``; writes scatter new tokens to their slots. For FP8,
    ``k_scale``/``v_scale`` [layers, pages] hold each page's scale; INT8 entries hold their own.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        scales: KVScales | str | Path | None = None,
    ):
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {page_size}")
        if scales is not None and not is_fp8(dtype):
            raise ValueError(f"KV scales only apply to an FP8 KV cache; this cache stores {dtype}")
        if is_int8(dtype) and spec.bf16_tail:
            raise ValueError(
                "an INT8 KV cache quantises whole entries; this model keeps part of each entry in bf16 "
                "(bf16_tail, e.g. DeepSeek's kv_rope_bf16): use fp8_e4m3 or bf16 KV for it"
            )
        if isinstance(scales, str | Path):
            scales = KVScales.load(scales)
        if scales is not None and scales.num_layers != spec.num_layers:
            raise ValueError(
                f"the KV scales file has {scales.num_layers} layers but the model has {spec.num_layers}; "
                "calibrate this model with `tessera calibrate`"
            )
        self.spec = spec
        # INT8 keys are stored times this block-diagonal Hadamard size (1: not rotated). A latent entry
        # (v_is_k) is also the values, which stay as they are.
        self.key_block = rotation_block(spec.head_dim) if is_int8(dtype) and not spec.v_is_k else 1
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.static_scales = scales
        shape = (spec.num_layers, num_pages, page_size, spec.num_kv_heads, spec.stored_dim(dtype))
        self.k = torch.zeros(shape, dtype=storage_dtype(dtype), device=device)
        # An MLA latent entry (``spec.v_is_k``) is one tensor: V is the same tensor as K, written once.
        self.v = self.k if spec.v_is_k else torch.zeros(shape, dtype=storage_dtype(dtype), device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if is_fp8(dtype):
            # Dynamic scales start at 1.0 and are set when a page is opened; static ones never change.
            ones = (1.0,) * spec.num_layers
            self.k_scale = _per_page(scales.k_scale if scales else ones, num_pages, device)
            self.v_scale = _per_page(scales.v_scale if scales else ones, num_pages, device)
            if spec.v_is_k:
                self.v_scale = self.k_scale
        # kernels.decode_step_cpu.CacheLayer per layer, made on first use (host_layer)
        self._host_layers: list | None = None
        # A page no sequence owns, where a CUDA-graph step's padded rows write (engine/graphs.py) and where a
        # write's tokens that open no FP8 page put their scale; set by the engine that keeps one aside (CUDA
        # graphs, or FP8 KV with dynamic scales on a GPU). With it, opening FP8 pages needs no host sync.
        self.scratch_page: int | None = None

    @staticmethod
    def page_bytes(spec: KVSpec, page_size: int, dtype: torch.dtype) -> int:
        """Bytes one page costs: its K/V elements plus, for FP8, its scales (``KVSpec.page_bytes``)."""
        return spec.page_bytes(page_size, dtype)

    @staticmethod
    def pages_for_budget(spec: KVSpec, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        """How many whole pages (scales included) fit in ``budget_bytes``."""
        return budget_bytes // KVCache.page_bytes(spec, page_size, dtype)

    @property
    def quantized(self) -> bool:
        """Whether values are stored as 8-bit codes (FP8 with page scales, or INT8 entries)."""
        return is_fp8(self.dtype) or is_int8(self.dtype)

    @property
    def page_scaled(self) -> bool:
        """Whether pages carry scales (FP8); INT8 entries carry their own."""
        return is_fp8(self.dtype)

    @property
    def opens_pages(self) -> bool:
        """Whether a write that opens a page sets its scale (FP8 without static scales)."""
        return self.page_scaled and self.static_scales is None

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> float:
        return self.page_bytes(self.spec, self.page_size, self.dtype) / self.page_size

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.nbytes * self.spec.tensors if self.page_scaled else 0
        return self.k.nbytes * self.spec.tensors + scales

    @property
    def tail(self) -> int:
        """Values at the end of each entry stored in bf16 (FP8 caches of a spec with ``bf16_tail``)."""
        return self.spec.bf16_tail if self.page_scaled else 0

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer flattened to slots: [pages * page_size, kv_heads, stored dim], as stored
        (an FP8 entry with a bf16 tail is ``head_dim + tail`` bytes wide, an INT8 entry ``head_dim + 2``)."""
        width = self.spec.stored_dim(self.dtype)
        k = self.k[layer].view(-1, self.spec.num_kv_heads, width)
        v = self.v[layer].view(-1, self.spec.num_kv_heads, width)
        return k, v

    def host_layer(self, layer: int):
        """One layer's slots and scales as the CPU kernels read them (``decode_step_cpu.CacheLayer``);
        numpy views of this cache's tensors, made once."""
        if self._host_layers is None:
            from gpu_workers.kernels.decode_step_cpu import cache_layer

            self._host_layers = [
                cache_layer(
                    *self.layer(i),
                    *self.layer_scales(i),
                    self.num_pages,
                    self.static_scales is None,
                    self.key_block,
                )
                for i in range(self.spec.num_layers)
            ]
        return self._host_layers[layer]

    def queries(self, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
        """Queries [T, heads, dim] and the attention scale as this cache's keys are read: rotated as the keys
        are stored (in q's dtype) with the scale divided by the rotation's size, or as they are."""
        if self.key_block == 1:
            return q, scale
        return hadamard(q, self.key_block).to(q.dtype), scale / self.key_block

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-page K and V scales [pages] of one layer; None for a cache without page scales."""
        if not self.page_scaled:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        spans: WriteSpans | None = None,
    ) -> None:
        """Store new tokens' K/V [T, kv_heads, head_dim] at their slots (INT8 keys rotated first).

        ``spans`` says which sequence each token belongs to; without it (FP8, dynamic scales) the whole
        write is treated as one sequence with no earlier pages.
        """
        if self.key_block > 1:
            k = hadamard(k, self.key_block)
        k_slots, v_slots = self.layer(layer)
        writes = [(k, k_slots, self.k_scale), (v, v_slots, self.v_scale)][: self.spec.tensors]
        if not self.page_scaled:  # stored as they are, or as INT8 entries that scale themselves
            cpu_int8 = self.quantized and use_cpu_kernels(slot_mapping.device)
            for x, slots, _ in writes:
                if cpu_int8:
                    write_kv_int8_cpu(x, slots, slot_mapping)
                else:
                    write_kv(x, slots, slot_mapping, None, self.page_size)
            return
        if slot_mapping.numel() == 0:
            return
        if not self.tail and use_cpu_kernels(slot_mapping.device):  # opening and writing in one call
            token_seq, prev_page = (None, None) if spans is None else (spans.token_seq, spans.prev_page)
            dynamic = self.static_scales is None
            for x, slots, scales in writes:
                write_kv_fp8_cpu(
                    x, slots, slot_mapping, scales[layer], self.page_size, token_seq, prev_page, dynamic
                )
            return
        pages = slot_mapping // self.page_size
        for x, slots, scales in writes:
            page_scale = scales[layer]
            head = x[..., : x.shape[-1] - self.tail]  # what the scale covers
            if self.static_scales is None:
                self._open_pages(head, slot_mapping, pages, page_scale, spans)
            if self.tail:  # mixed e4m3 + bf16 bits, encoded here and copied as bytes (no kernel for it)
                bits = quantize_fp8_entry(x, page_scale[pages][:, None, None], self.tail)
                write_kv_reference(bits, slots, slot_mapping, None, self.page_size)
            else:
                write_kv(x, slots, slot_mapping, page_scale, self.page_size)

    def _open_pages(
        self,
        x: torch.Tensor,
        slot_mapping: torch.Tensor,
        pages: torch.Tensor,
        page_scale: torch.Tensor,
        spans: WriteSpans | None,
    ) -> None:
        """Set the dynamic scale of every page this write opens (writes slot 0 of)."""
        opens = slot_mapping % self.page_size == 0
        if self.scratch_page is None and x.device.type == "cpu" and not bool(opens.any()):
            return  # most decode steps open no page (on a GPU the check would cost a sync, not save work)
        token_amax = x.detach().abs().amax(dim=(1, 2)).float()
        if spans is None:
            token_seq = torch.zeros_like(slot_mapping)
            prev_page = torch.full((1,), -1, dtype=torch.long, device=slot_mapping.device)
        else:
            token_seq, prev_page = spans.token_seq, spans.prev_page
        seq_amax = torch.zeros(len(prev_page), dtype=SCALE_DTYPE, device=x.device)
        seq_amax.scatter_reduce_(0, token_seq, token_amax, "amax")
        inherited = torch.where(prev_page >= 0, page_scale[prev_page.clamp_min(0)], 0.0)
        seq_scale = torch.maximum(inherited, fp8_scale_pow2(seq_amax))
        if self.scratch_page is not None:
            # Every token writes: an opening one its page's scale, the rest the scratch page's, which
            # nothing reads. A masked write would read the mask's count back to the host (a sync that a
            # CUDA graph cannot hold); a page is opened by one token of a step at most, so no two writes
            # but the scratch page's collide.
            target = torch.where(opens, pages, self.scratch_page)
            page_scale.index_put_((target,), seq_scale[token_seq])
            return
        page_scale[pages[opens]] = seq_scale[token_seq[opens]]


def _per_page(layer_scales: tuple[float, ...], num_pages: int, device: torch.device | str) -> torch.Tensor:
    """[layers, pages] scales, every page of a layer starting at that layer's scale."""
    return torch.tensor(layer_scales, dtype=SCALE_DTYPE, device=device)[:, None].repeat(1, num_pages)
