"""FP8 and INT8 KV writes on the CPU: quantise and scatter new K or V in one numba call.

FP8: open pages (dynamic scales), quantise and scatter in one call.

The torch path (``KVCache._open_pages`` + ``kv_write.write_kv_reference``) takes some 15 tensor ops and a
scalar fp8 cast per write, ~70 µs for a 32-token decode step's K or V on this CPU; every layer writes
both, every step. Here one pass finds the sequences that open a page (write its slot 0), one takes their
new tokens' amax, their pages get ``max(inherited scale, smallest power of two >= amax / 448)``, and one
pass writes every token as the e4m3 bits of ``x / page scale`` saturated at ±448, rounded to nearest even
as torch's cast rounds. Bit-identical to the torch path (tests/test_kernels.py).

INT8: every (token, KV head) entry gets its own bf16 scale from its amax and its codes rounded to nearest
even, as ``formats.kv_int8.quantize_int8_entries`` computes them; bit-identical to it. ``_hadamard`` is
``formats.kv_int8.hadamard``'s butterflies in the same order (the same bits), for the fused decode step.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from gpu_workers.formats.fp8 import FP8_MAX, MIN_AMAX
from gpu_workers.formats.kv_int8 import INT8_MAX
from gpu_workers.kernels.numba_bits import as_float32, as_uint32, widen

_JIT = {"nogil": True, "boundscheck": False, "cache": True}  # no fastmath: every rounding is the spec's
_FP8_MAX = np.float32(FP8_MAX)
_MIN_AMAX = np.float32(MIN_AMAX)
_MIN_NORMAL = np.float32(2.0**-6)  # e4m3's smallest normal value
_SUBNORMAL_STEPS = np.float32(2.0**9)  # e4m3 subnormals are multiples of 2^-9
_INT8_MAX = np.float32(INT8_MAX)


@numba.njit(inline="always", **_JIT)
def _e4m3(v):
    """The e4m3 bits of float32 ``v`` saturated at ±448, rounded to nearest even (NaN stays NaN)."""
    bits = as_uint32(v)
    sign = np.uint8((bits >> 24) & 0x80)
    if v != v:
        return np.uint8(0x7F) | sign
    v = min(max(v, -_FP8_MAX), _FP8_MAX)
    magnitude = as_uint32(v) & 0x7FFFFFFF
    if abs(v) < _MIN_NORMAL:
        return np.uint8(np.rint(abs(v) * _SUBNORMAL_STEPS)) | sign  # 8 steps is the smallest normal, 0x08
    # keep 3 of fp32's 23 mantissa bits, ties to even (a carry moves into the exponent), then move the
    # exponent from fp32's bias (127) to e4m3's (7)
    kept = (magnitude + np.uint32(0x7FFFF) + ((magnitude >> 20) & 1)) >> 20
    return np.uint8(kept - np.uint32(120 << 3)) | sign


@numba.njit(**_JIT)
def _pow2_at_least(scale):
    """The smallest power of two >= ``scale`` (a positive normal float32)."""
    bits = as_uint32(scale)
    if bits & 0x7FFFFF:
        bits = (bits & np.uint32(0x7F800000)) + np.uint32(0x800000)
    return as_float32(bits)


@numba.njit(**_JIT)
def _write(x, slots, slot_mapping, page_scale, page_size, token_seq, prev_page, dynamic):
    tokens, heads, dim = x.shape
    if dynamic:
        sequences = prev_page.shape[0]
        opens = np.zeros(sequences, np.bool_)
        for t in range(tokens):
            if slot_mapping[t] % page_size == 0:
                opens[token_seq[t]] = True
        amax = np.zeros(sequences, np.float32)
        for t in range(tokens):
            s = token_seq[t]
            if opens[s]:
                for h in range(heads):
                    for d in range(dim):
                        amax[s] = max(amax[s], abs(widen(x[t, h, d])))
        for t in range(tokens):
            slot = slot_mapping[t]
            if slot % page_size == 0:
                s = token_seq[t]
                inherited = page_scale[prev_page[s]] if prev_page[s] >= 0 else np.float32(0.0)
                fresh = _pow2_at_least(max(amax[s], _MIN_AMAX) / _FP8_MAX)
                page_scale[slot // page_size] = max(inherited, fresh)
    for t in range(tokens):
        slot = slot_mapping[t]
        scale = page_scale[slot // page_size]
        for h in range(heads):
            for d in range(dim):
                slots[slot, h, d] = _e4m3(widen(x[t, h, d]) / scale)


@numba.njit(**_JIT)
def _write_int8(x, slots, slot_mapping):
    """x [T, kv_heads, dim] as INT8 entries [.., dim + 2] at ``slots[slot_mapping]``: codes, then the bf16
    scale's low and high byte."""
    tokens, heads, dim = x.shape
    for t in range(tokens):
        slot = slot_mapping[t]
        for h in range(heads):
            amax = np.float32(0.0)
            for d in range(dim):
                amax = max(amax, abs(widen(x[t, h, d])))
            scale = max(amax, _MIN_AMAX) / _INT8_MAX
            bits = as_uint32(scale)
            bf16 = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16  # to nearest even, as torch rounds
            scale = as_float32(bf16 << 16)
            for d in range(dim):
                code = min(max(np.rint(widen(x[t, h, d]) / scale), -_INT8_MAX), _INT8_MAX)
                slots[slot, h, d] = np.int8(np.int32(code))
            low, high = np.int32(bf16 & 0xFF), np.int32(bf16 >> 8)
            slots[slot, h, dim] = np.int8(low - 256 if low > 127 else low)
            slots[slot, h, dim + 1] = np.int8(high - 256 if high > 127 else high)


@numba.njit(**_JIT)
def _hadamard(x, block):
    """float32 x [T, heads, dim] times the block-diagonal Hadamard matrix of ``block``-sized ±1 blocks, in
    place (``formats.kv_int8.hadamard``)."""
    tokens, heads, dim = x.shape
    h = 1
    while h < block:
        for t in range(tokens):
            for head in range(heads):
                for i in range(0, dim, 2 * h):
                    for j in range(i, i + h):
                        low, high = x[t, head, j], x[t, head, j + h]
                        x[t, head, j] = low + high
                        x[t, head, j + h] = low - high
        h *= 2


@numba.njit(**_JIT)
def _copy(x, slots, slot_mapping):
    """New tokens stored as they are (a BF16 or fp32 cache of the compute dtype)."""
    tokens, heads, dim = x.shape
    for t in range(tokens):
        slot = slot_mapping[t]
        for h in range(heads):
            for d in range(dim):
                slots[slot, h, d] = x[t, h, d]


def write_kv_fp8_cpu(
    x: torch.Tensor,
    slots: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_scale: torch.Tensor,
    page_size: int,
    token_seq: torch.Tensor | None,
    prev_page: torch.Tensor | None,
    dynamic: bool,
) -> None:
    """x [T, kv_heads, dim] into the uint8 ``slots`` at ``slot_mapping`` as e4m3 bits of x / page scale.

    ``dynamic``: first set the scale of every page this write opens, per sequence (``token_seq`` [T] and
    ``prev_page`` [S] as in ``kv.cache.WriteSpans``; None: one sequence with no earlier page), as
    ``KVCache._open_pages`` does. ``page_scale`` [pages] (float32) is updated in place."""
    if token_seq is None or prev_page is None:
        token_seq = torch.zeros(slot_mapping.shape, dtype=torch.long)
        prev_page = torch.full((1,), -1, dtype=torch.long)
    _write(
        x.detach().float().contiguous().numpy(),
        slots.numpy(),
        slot_mapping.contiguous().numpy(),
        page_scale.numpy(),
        page_size,
        token_seq.contiguous().numpy(),
        prev_page.contiguous().numpy(),
        dynamic,
    )


def write_kv_int8_cpu(x: torch.Tensor, slots: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """x [T, kv_heads, dim] into the int8 ``slots`` [slots, kv_heads, dim + 2] at ``slot_mapping`` as INT8
    entries (``formats.kv_int8``), bit-identical to ``kv_write.write_kv_reference``."""
    _write_int8(x.detach().float().contiguous().numpy(), slots.numpy(), slot_mapping.contiguous().numpy())
