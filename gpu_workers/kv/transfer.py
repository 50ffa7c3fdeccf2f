"""Move a sequence's KV out of one cache and into another, converting formats: the prefill→decode hand-off.

A ``KVBlock`` holds the first ``num_tokens`` tokens of a sequence, free of any page layout, in the
receiving pool's format (FP8 halves the bytes on the wire too). FP8 blocks carry one power-of-two scale per
layer for K and V, set from the sequence's own amax (the dynamic scheme of ``kv.cache``). Importing writes
through the receiving cache's normal write path, so its own scale policy (static or dynamic) applies and
the pages it fills are freshly allocated, with fresh integrity tags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_workers.formats.fp8 import FP8_DTYPE, dequantize_fp8, fp8_scale_pow2, quantize_fp8
from gpu_workers.kv.cache import KVCache, WriteSpans

KV_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": FP8_DTYPE}


def kv_format_name(dtype: torch.dtype) -> str:
    """The transport name of a cache element type (``KVCache.dtype``)."""
    return next(name for name, d in KV_FORMATS.items() if d == dtype)


@dataclass
class KVBlock:
    kv_format: str
    num_tokens: int
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim]; uint8 bits for fp8_e4m3
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [layers] fp32, fp8_e4m3 only
    v_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.k_scale is not None else 0
        return self.k.nbytes + self.v.nbytes + scales

    def tensors(self) -> dict[str, torch.Tensor]:
        """Named tensors for serialisation (safetensors)."""
        out = {"k": self.k, "v": self.v}
        if self.k_scale is not None:
            out |= {"k_scale": self.k_scale, "v_scale": self.v_scale}
        return out

    @classmethod
    def from_tensors(cls, kv_format: str, tensors: dict[str, torch.Tensor]) -> KVBlock:
        if kv_format not in KV_FORMATS:
            raise ValueError(f"unknown KV format {kv_format!r}; expected one of {sorted(KV_FORMATS)}")
        k, v = tensors["k"], tensors["v"]
        return cls(kv_format, k.shape[1], k, v, tensors.get("k_scale"), tensors.get("v_scale"))

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as float32."""
        if self.kv_format == "fp8_e4m3":
            return (
                dequantize_fp8(self.k, self.k_scale[:, None, None, None], torch.float32),
                dequantize_fp8(self.v, self.v_scale[:, None, None, None], torch.float32),
            )
        return self.k.float(), self.v.float()


def _slots(pages: list[int], num_tokens: int, page_size: int, device) -> torch.Tensor:
    positions = torch.arange(num_tokens, device=device)
    table = torch.tensor(pages, dtype=torch.long, device=device)
    return table[positions // page_size] * page_size + positions % page_size


def export_kv(cache: KVCache, pages: list[int], num_tokens: int, kv_format: str) -> KVBlock:
    """The KV of tokens [0, num_tokens) held in ``pages``, converted to ``kv_format``."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown KV format {kv_format!r}; expected one of {sorted(KV_FORMATS)}")
    slots = _slots(pages, num_tokens, cache.page_size, cache.k.device)
    slot_pages = slots // cache.page_size
    ks, vs = [], []
    for layer in range(cache.spec.num_layers):
        k_slots, v_slots = cache.layer(layer)
        k, v = k_slots[slots], v_slots[slots]
        if cache.quantized:
            k_scale, v_scale = cache.layer_scales(layer)
            k = dequantize_fp8(k, k_scale[slot_pages][:, None, None], torch.float32)
            v = dequantize_fp8(v, v_scale[slot_pages][:, None, None], torch.float32)
        ks.append(k.float())
        vs.append(v.float())
    k, v = torch.stack(ks).cpu(), torch.stack(vs).cpu()
    if kv_format != "fp8_e4m3":
        return KVBlock(kv_format, num_tokens, k.to(KV_FORMATS[kv_format]), v.to(KV_FORMATS[kv_format]))
    k_scale = fp8_scale_pow2(k.abs().amax(dim=(1, 2, 3)))
    v_scale = fp8_scale_pow2(v.abs().amax(dim=(1, 2, 3)))
    return KVBlock(
        kv_format,
        num_tokens,
        quantize_fp8(k, k_scale[:, None, None, None]),
        quantize_fp8(v, v_scale[:, None, None, None]),
        k_scale,
        v_scale,
    )


def import_kv(cache: KVCache, pages: list[int], block: KVBlock) -> None:
    """Write ``block`` into ``pages`` (already allocated for at least ``block.num_tokens`` tokens)."""
    spec = cache.spec
    if tuple(block.k.shape[0:1] + block.k.shape[2:]) != (spec.num_layers, spec.num_kv_heads, spec.head_dim):
        raise ValueError(
            f"KV block of shape {tuple(block.k.shape)} does not fit this model's cache "
            f"({spec.num_layers} layers, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim})"
        )
    device = cache.k.device
    slots = _slots(pages, block.num_tokens, cache.page_size, device)
    spans = WriteSpans(
        token_seq=torch.zeros(block.num_tokens, dtype=torch.long, device=device),
        prev_page=torch.full((1,), -1, dtype=torch.long, device=device),
    )
    k, v = block.dequantized()
    for layer in range(spec.num_layers):
        cache.write(layer, k[layer].to(device), v[layer].to(device), slots, spans)
