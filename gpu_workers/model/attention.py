"""The attention every model layer calls, one signature for every family and backend:
``attn(layer, q, k, v, scale, sliding_window, rotary)`` writes the step's new K/V into the paged cache
(``kv.KVCache``) and attends through it, as the step's ``kv.AttentionMetadata`` says, on the kernels the
device runs (``kernels.backend``: Triton, the numba CPU kernels or the torch references; a CUDA-graphed
step calls it the same way on static buffers). With ``rotary`` the standard rotation of q and k happens
here, inside the K/V write where a kernel can (q, k and v then views of one fused projection output).
A model with fused projections hands that output over whole: ``attn.rotate_and_attend(layer, qkv, cos, sin,
heads, kv_heads, scale, sliding_window)``, the same attention without splitting it first.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_workers.kernels import backend
from gpu_workers.kernels.kv_write import rotate_write_kv
from gpu_workers.kernels.paged_attention import paged_attention
from gpu_workers.kernels.rotary import apply_rotary
from gpu_workers.kv import AttentionMetadata, KVCache

# What the CPU decode kernel reads: FP8 bits, INT8 entries, BF16, fp32.
_KERNEL_STORED = (torch.uint8, torch.int8, torch.bfloat16, torch.float32)


class PagedAttention:
    """One step's attention: write the new K/V, then attend through pages.

    The path is chosen here, from the step's backend and the cache's format: on Triton a fused projection's
    split, rotation and K/V write are one launch before the attention; a decode-only step on the CPU
    kernels writes and attends in one numba call per layer (``decode_step_cpu``), the rotation
    included when q, k and v come from one fused projection; every other step writes, then attends."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata, one_call: bool = True):
        """``one_call=False`` keeps a decode-only step on the write-then-attend path that a step mixing
        prefill and decode takes (a batch-invariant engine): the one-call kernel is the same arithmetic,
        but compiled apart, so with fastmath it may round a value's last bit otherwise (measured on
        SmolLM2's layers on an AVX-512 Xeon: 1 ulp)."""
        self.cache = cache
        self.meta = meta
        self.backend = backend(meta.slot_mapping.device)  # the layers' norms and activations run on it too
        self._decode_step = _cpu_decode_step(cache, meta) if self.backend == "cpu" and one_call else None
        # Asked at every layer, answered once a step: whether the Triton kernels split, rotate and write a
        # fused projection in one launch (K and V whole entries, unquantised or INT8: FP8 pages open with
        # scales); whether the one-call CPU kernel stores new K/V of any dtype (quantising them).
        self._rotates_in_write = (
            self.backend == "triton" and cache.spec.tensors == 2 and not cache.page_scaled and not cache.tail
        )
        self._quantized = cache.quantized
        # The step's cos tensor and its rotary tables as arrays: every layer gets the same ones.
        self._rotary: tuple[torch.Tensor, np.ndarray, np.ndarray] | None = None

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention output [T, heads, dim] of queries q [T, heads, dim] over the cache after writing k, v
        [T, kv_heads, dim] at the step's slots. ``rotary`` (cos, sin) [T, dim]: q and k still to be rotated
        (``kernels.rotary.apply_rotary``); without it they come rotated."""
        if rotary is not None:
            cos, sin = rotary
            qkv = fused_output(q, k, v)
            if qkv is not None:
                return self.rotate_and_attend(
                    layer, qkv, cos, sin, q.shape[1], k.shape[1], scale, sliding_window
                )
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self._write_and_attend(layer, q, k, v, scale, sliding_window)

    def rotate_and_attend(
        self,
        layer: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``self(...)`` from a fused q/k/v projection [T, (heads + 2 kv_heads) * dim], q and k rotated by
        ``cos``/``sin`` [T, dim]: on the Triton kernels the split, rotation and write in one launch, then
        the attention; in one kernel call where a decode-only step on the CPU kernels allows it; else q and
        k rotated together, then written and attended."""
        tokens, dim = qkv.shape[0], cos.shape[1]
        if qkv.dtype == cos.dtype and qkv.is_contiguous() and qkv.shape[1] == (heads + 2 * kv_heads) * dim:
            if self._rotates_in_write:
                k_slots, v_slots = self.cache.layer(layer)
                q = rotate_write_kv(
                    qkv,
                    cos,
                    sin,
                    heads,
                    kv_heads,
                    k_slots,
                    v_slots,
                    self.meta.slot_mapping,
                    self.cache.key_block,
                )
                scale /= self.cache.key_block  # queries read INT8 keys rotated alike (KVCache.queries)
                return paged_attention(q, k_slots, v_slots, self.meta, scale, sliding_window)
            if self._one_call(qkv.dtype):
                return self._rotate_write_and_decode(
                    layer, qkv, cos, sin, heads, kv_heads, scale, sliding_window
                )
        # q and k sit side by side in the fused output: rotated in one go.
        qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
        q, k = apply_rotary(qk, cos, sin).split([heads, kv_heads], dim=1)
        v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
        return self._write_and_attend(layer, q, k, v, scale, sliding_window)

    def _one_call(self, dtype: torch.dtype) -> bool:
        """Whether this layer's write and attention run as one CPU kernel call: a decode-only step the
        kernel serves, with new K/V it can store (quantised, or already in the cache's dtype)."""
        return self._decode_step is not None and (self._quantized or dtype == self.cache.dtype)

    def _rotate_write_and_decode(
        self,
        layer: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        kv_heads: int,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if self._rotary is None or self._rotary[0] is not cos:
            from gpu_workers.kernels.paged_attention_cpu import host_array

            self._rotary = (cos, host_array(cos.contiguous()), host_array(sin.contiguous()))
        _, cos_array, sin_array = self._rotary
        return (_decode_step_cpu or _import_decode_step_cpu()).rotate_write_and_decode_cpu(
            qkv,
            cos_array,
            sin_array,
            heads,
            kv_heads,
            self.cache.host_layer(layer),
            self._decode_step,
            scale,
            sliding_window,
        )

    def _write_and_attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if self._one_call(k.dtype):
            return (_decode_step_cpu or _import_decode_step_cpu()).write_and_decode_cpu(
                q, k, v, self.cache.host_layer(layer), self._decode_step, scale, sliding_window
            )
        self.cache.write(layer, k, v, self.meta.slot_mapping, self.meta.spans)
        q, scale = self.cache.queries(q, scale)
        k_slots, v_slots = self.cache.layer(layer)
        k_scale, v_scale = self.cache.layer_scales(layer)
        return paged_attention(q, k_slots, v_slots, self.meta, scale, sliding_window, k_scale, v_scale)


_decode_step_cpu = None  # kernels.decode_step_cpu once imported: numba is imported where it runs only


def _import_decode_step_cpu():
    global _decode_step_cpu
    from gpu_workers.kernels import decode_step_cpu

    _decode_step_cpu = decode_step_cpu
    return decode_step_cpu


def fused_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The one projection output [T, (heads + 2 kv_heads) * dim] whose consecutive columns q [T, heads,
    dim], k and v [T, kv_heads, dim] are views of (a fused q/k/v projection split by the model), or None."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    width = (heads + 2 * kv_heads) * dim
    start = q.storage_offset()
    if k.storage_offset() != start + heads * dim or v.storage_offset() != start + (heads + kv_heads) * dim:
        return None
    for x in (q, k, v):
        if x.stride()[1:] != (dim, 1) or (tokens > 1 and x.stride(0) != width):
            return None
    if k.shape != v.shape or not q.dtype == k.dtype == v.dtype:
        return None
    if not q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
        return None
    return q.as_strided((tokens, width), (width, 1))


def _cpu_decode_step(cache: KVCache, meta: AttentionMetadata):
    """The step's rows for ``write_and_decode_cpu`` (``decode_step_cpu.DecodeStep``) when it serves this
    step: decode rows only, K and V stored whole-entry (no bf16 tail) in a format the kernel reads; else
    None."""
    decode = meta.decode
    if decode is None or meta.prefill or meta.spans is None or cache.spec.tensors != 2 or cache.tail:
        return None
    if cache.k.dtype not in _KERNEL_STORED:
        return None
    from gpu_workers.kernels.decode_step_cpu import DecodeStep

    tables, lens = decode.int32_tables()
    return DecodeStep(
        meta.slot_mapping.numpy(),
        meta.spans.token_seq.numpy(),
        meta.spans.prev_page.numpy(),
        tables.numpy(),
        lens.numpy(),
        meta.page_size,
        {},
    )
