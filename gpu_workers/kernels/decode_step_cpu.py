"""A decode-only step's attention on the CPU in one numba call per layer: the new K/V written into the cache
(FP8 pages opened and quantised, INT8 entries with the keys' Hadamard rotation, or copied as they are), then
``paged_attention_cpu``'s kernel over the pages; from a fused q/k/v projection, q and k are rotated first in
the same call. The same results as the write, rotation and attention apart, without their per-call tensor
handling.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import torch

from gpu_workers.kernels.kv_write_cpu import _copy, _hadamard, _write, _write_int8
from gpu_workers.kernels.numba_bits import narrow, pointer, widen
from gpu_workers.kernels.paged_attention_cpu import _HALF_FP8_OFFSET, _decode, _unit_scales, host_array


class CacheLayer(NamedTuple):
    """One layer of a CPU cache as the kernels read it: which kernel of a (FP8, INT8, plain) triple, and that
    kernel's arguments of this layer (slots, per-page scales: ones but for FP8, and the format's own)."""

    kind: int
    args: tuple  # after the kernel's own leading arguments, before the step's
    key_block: int  # INT8 keys are stored Hadamard-rotated in blocks of this size (1: not rotated)


class DecodeStep(NamedTuple):
    """A decode-only step's rows (token i is row i) as the kernels read them."""

    slot_mapping: np.ndarray  # [B] int64
    token_seq: np.ndarray  # [B] int64
    prev_page: np.ndarray  # [B] int64
    tables: np.ndarray  # [B, P] int32
    lens: np.ndarray  # [B] int32
    page_size: int
    calls: dict  # (kind, key block, scale, window) -> the kernels' arguments of the step: made once a step


def cache_layer(
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_pages: int,
    dynamic: bool,
    key_block: int = 1,
) -> CacheLayer:
    """``CacheLayer`` of one layer's slots [slots, kv_heads, dim] and FP8 page scales [pages] (None for
    other formats), with ``KVCache.key_block``; the arrays share the tensors' memory, so one is made per
    layer and kept."""
    fp8 = k_slots.dtype == torch.uint8
    scales = (host_array(k_scale), host_array(v_scale)) if fp8 else (_unit_scales(num_pages),) * 2
    k, v = host_array(k_slots), host_array(v_slots)
    if fp8:  # FP8 pages take their scale when opened where there are no static scales (``dynamic``)
        return CacheLayer(_FP8, (k, v, *scales, dynamic), key_block)
    if k_slots.dtype == torch.int8:  # INT8 entries, each with its own scale
        return CacheLayer(_INT8, (k, v, scales[0], key_block), key_block)
    return CacheLayer(_PLAIN, (k, v, scales[0]), key_block)


_FP8, _INT8, _PLAIN = range(3)  # a kernel triple's order


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _fp8_step(
    out,
    q,
    k,
    v,
    layer_k,
    layer_v,
    k_scale,
    v_scale,
    dynamic,
    step_slots,
    page_size,
    token_seq,
    prev_page,
    tables,
    lens,
    scale,
    window,
):
    _write(k, layer_k, step_slots, k_scale, page_size, token_seq, prev_page, dynamic)
    _write(v, layer_v, step_slots, v_scale, page_size, token_seq, prev_page, dynamic)
    _decode(
        q,
        layer_k,
        layer_v,
        tables,
        lens,
        page_size,
        scale,
        window,
        k_scale,
        v_scale,
        _HALF_FP8_OFFSET,
        False,
        out,
    )


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _rotated(x, block, rounded):
    """float32 copy of x [T, heads, dim] times the Hadamard blocks (``_hadamard``); ``rounded``: rounded to
    x's element type and widened back (queries, as ``KVCache.queries`` hands them to the kernel), else left
    in float32 (keys, as ``KVCache.write`` quantises them)."""
    out = np.empty(x.shape, np.float32)
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for d in range(x.shape[2]):
                out[t, h, d] = widen(x[t, h, d])
    _hadamard(out, block)
    if rounded:
        for t in range(x.shape[0]):
            for h in range(x.shape[1]):
                for d in range(x.shape[2]):
                    out[t, h, d] = widen(narrow(out[t, h, d], x))
    return out


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _int8_step(
    out, q, k, v, layer_k, layer_v, ones, block, step_slots, page_size, tables, lens, scale, window
):
    """INT8: keys and queries rotated (``block``; ``scale`` already divided by it), then write and attend."""
    _write_int8(_rotated(k, block, False), layer_k, step_slots)
    _write_int8(v, layer_v, step_slots)
    queries = _rotated(q, block, True)
    _decode(
        queries,
        layer_k,
        layer_v,
        tables,
        lens,
        page_size,
        scale,
        window,
        ones,
        ones,
        np.float32(1.0),
        True,
        out,
    )


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _plain_step(out, q, k, v, layer_k, layer_v, ones, step_slots, page_size, tables, lens, scale, window):
    _copy(k, layer_k, step_slots)
    _copy(v, layer_v, step_slots)
    _decode(
        q, layer_k, layer_v, tables, lens, page_size, scale, window, ones, ones, np.float32(1.0), False, out
    )


def _run(kernels, lead: tuple, layer: CacheLayer, step: DecodeStep, scale, sliding_window) -> None:
    """Call the FP8, the INT8 or the plain kernel of ``kernels`` (the layer's ``kind``) with its own leading
    arguments ``lead`` (the output first), the layer's (``args``, made once with the cache), then the
    step's rows (made once a step: every layer of a cache shares them)."""
    key = (layer.kind, layer.key_block, scale, sliding_window)
    rows = step.calls.get(key)
    if rows is None:
        rows = step.calls[key] = _step_args(layer, step, scale, sliding_window)
    kernels[layer.kind](*lead, *layer.args, *rows)


def _step_args(layer: CacheLayer, step: DecodeStep, scale, sliding_window) -> tuple:
    """The kernel's arguments after the layer's: the step's slots and rows."""
    window = sliding_window or 0
    if layer.kind == _FP8:
        written = (step.slot_mapping, step.page_size, step.token_seq, step.prev_page)
        return (*written, step.tables, step.lens, np.float32(scale), window)
    # INT8: keys and queries rotated inside, the scale divided by the rotation's size (1 for the others)
    return (
        step.slot_mapping,
        step.page_size,
        step.tables,
        step.lens,
        np.float32(scale / layer.key_block),
        window,
    )


def write_and_decode_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: CacheLayer,
    step: DecodeStep,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """A decode-only step's attention for one layer in one kernel call: ``KVCache.write`` of k, v [B,
    kv_heads, dim] (FP8 pages opened and quantised as ``write_kv_fp8_cpu`` does, INT8 entries as
    ``write_kv_int8_cpu`` writes them; unquantised caches take them as they are, so k and v must be in the
    cache's dtype), then ``paged_decode_attention_cpu`` of q
    [B, heads, dim]. The same results as those two calls, without their per-call tensor handling."""
    out = torch.empty(q.shape, dtype=q.dtype)
    # q and k C-contiguous, as the rotation in rotate_write_and_decode_cpu makes them: numba compiles once per
    # array layout (views of a fused projection are 'A'), so both entry points share one compile per dtype.
    q_array, k_array = np.ascontiguousarray(host_array(q)), np.ascontiguousarray(host_array(k))
    _run(_KERNELS, (host_array(out), q_array, k_array, host_array(v)), layer, step, scale, sliding_window)
    return out


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _rotate(qkv, cos, sin, heads, kv_heads):
    """q [T, heads, dim] and k [T, kv_heads, dim] of a fused projection's output [T, (heads + 2 kv_heads) *
    dim], rotated as ``kernels.rotary.apply_rotary`` rotates them, in qkv's element type and rounded as
    torch rounds each of its ops there (x*cos, rotate_half(x)*sin, their sum)."""
    tokens, dim = qkv.shape[0], cos.shape[1]
    half = dim // 2
    q = np.empty((tokens, heads, dim), qkv.dtype)
    k = np.empty((tokens, kv_heads, dim), qkv.dtype)
    for t in range(tokens):
        for h in range(heads + kv_heads):
            base = h * dim
            for d in range(dim):
                turned = -widen(qkv[t, base + d + half]) if d < half else widen(qkv[t, base + d - half])
                a = widen(narrow(widen(qkv[t, base + d]) * widen(cos[t, d]), qkv))
                b = widen(narrow(turned * widen(sin[t, d]), qkv))
                if h < heads:
                    q[t, h, d] = narrow(a + b, qkv)
                else:
                    k[t, h - heads, d] = narrow(a + b, qkv)
    return q, k


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _fused(out_address, qkv_address, like, tokens, cos, sin, heads, kv_heads):
    """The output rows [T, heads, dim] at ``out_address``, and q, k (rotated: ``_rotate``) and v [T, kv_heads,
    dim] of the fused projection output [T, (heads + 2 kv_heads) * dim] at ``qkv_address``, all of ``like``'s
    element type (memory given by address: a call makes no numpy array per tensor)."""
    dim = cos.shape[1]
    qkv = numba.carray(pointer(qkv_address, like), (tokens, (heads + 2 * kv_heads) * dim))
    q, k = _rotate(qkv, cos, sin, heads, kv_heads)
    v = np.empty((tokens, kv_heads, dim), qkv.dtype)
    first = (heads + kv_heads) * dim
    for t in range(tokens):
        for h in range(kv_heads):
            for d in range(dim):
                v[t, h, d] = qkv[t, first + h * dim + d]
    return numba.carray(pointer(out_address, like), (tokens, heads, dim)), q, k, v


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _rope_fp8_step(out_address, qkv_address, like, tokens, cos, sin, heads, kv_heads, *rest):
    _fp8_step(*_fused(out_address, qkv_address, like, tokens, cos, sin, heads, kv_heads), *rest)


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _rope_int8_step(out_address, qkv_address, like, tokens, cos, sin, heads, kv_heads, *rest):
    _int8_step(*_fused(out_address, qkv_address, like, tokens, cos, sin, heads, kv_heads), *rest)


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _rope_plain_step(out_address, qkv_address, like, tokens, cos, sin, heads, kv_heads, *rest):
    _plain_step(*_fused(out_address, qkv_address, like, tokens, cos, sin, heads, kv_heads), *rest)


def rotate_write_and_decode_cpu(
    qkv: torch.Tensor,
    cos: np.ndarray,
    sin: np.ndarray,
    heads: int,
    kv_heads: int,
    layer: CacheLayer,
    step: DecodeStep,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``write_and_decode_cpu`` from a fused q/k/v projection's output [B, (heads + 2 kv_heads) * dim], q and
    k rotated first (``cos``, ``sin`` [B, dim]: ``host_array`` of the rotary tables, in qkv's dtype) exactly
    as ``kernels.rotary.apply_rotary`` rotates them: the q/k/v split, the rotation, the K/V write and the
    attention in one kernel call. Returns [B, heads, dim] in qkv's dtype."""
    tokens, dim = qkv.shape[0], cos.shape[1]
    out = torch.empty((tokens, heads, dim), dtype=qkv.dtype)
    like = _ELEMENTS[qkv.dtype]
    lead = (out.data_ptr(), qkv.data_ptr(), like, tokens, cos, sin, heads, kv_heads)
    _run(_ROPE_KERNELS, lead, layer, step, scale, sliding_window)
    return out


# What a tensor's element is, as the kernels' pointers are typed: bf16 bits or float32.
_ELEMENTS = {torch.bfloat16: np.empty(0, np.uint16), torch.float32: np.empty(0, np.float32)}
_KERNELS = (_fp8_step, _int8_step, _plain_step)
_ROPE_KERNELS = (_rope_fp8_step, _rope_int8_step, _rope_plain_step)
