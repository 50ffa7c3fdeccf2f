"""Paged decode attention over FP8 pages on the CPU: a numba kernel that reads each row's pages in place.

The torch reference gathers every page a group of rows reads into a padded copy per layer, for K and V, and
must decode every gathered e4m3 value before SDPA can read it; on a CPU that decode costs as much as the
attention. Here each (row, KV head) walks its own page table: a page's e4m3 values are widened once into
an fp32 tile (their fields moved into bf16's, exact, then ×2^120 back to their value), the query heads
sharing that KV head score against it, softmax in fp32 over the row's own positions (no padding, no
mask), then the V pages the same way. The page scales multiply a page's scores and its probabilities, as
the Triton kernel does: two scalar multiplies per position, not per element.

BF16 and fp32 pages stay on the reference: gathering them is a copy, and SDPA over the copy is as fast as
this kernel at one thread and faster at two (BENCHMARKS.md, "Paged decode attention on the CPU").
Same signature and result as ``paged_attention.paged_decode_attention_reference`` (computed in fp32,
returned in q's dtype). Compiled on first use and cached on disk by numba.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from gpu_workers.formats.fp8 import BF16_FIELDS_OFFSET

# Reassociation lets the dot products vectorise; no finite-math assumption (masked scores start at -inf).
_JIT = {
    "nogil": True,
    "fastmath": {"reassoc", "contract", "nsz", "arcp"},
    "boundscheck": False,
    "cache": True,
}
_BF16_FIELDS_OFFSET = np.float32(BF16_FIELDS_OFFSET)


@numba.njit(**_JIT)
def _widen(slots, base, head, start, end, tile, bits):
    """e4m3 slots ``base + start .. base + end`` of one KV head into rows ``start .. end`` of the fp32 tile."""
    dim = tile.shape[1]
    for o in range(start, end):
        src = slots[base + o, head]
        # e4m3's exponent and mantissa land in bf16's low exponent and high mantissa bits, its sign in
        # bf16's: 2^120 below the e4m3 value (subnormals included), which one multiply restores exactly.
        for d in range(dim):
            b = np.uint32(src[d])
            bits[o, d] = (((b & 0x7F) << 4) | ((b & 0x80) << 8)) << 16
        for d in range(dim):
            tile[o, d] *= _BF16_FIELDS_OFFSET


@numba.njit(**_JIT)
def _decode(q, k, v, tables, lens, page_size, scale, window, k_scale, v_scale, out):
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    probs = np.empty((group, tables.shape[1] * page_size), np.float32)
    tile = np.empty((page_size, dim), np.float32)
    bits = tile.view(np.uint32)
    acc = np.empty((group, dim), np.float32)
    qs = np.empty((group, dim), np.float32)
    top = np.empty(group, np.float32)
    for b in range(rows):
        n = lens[b]
        lo = n - window if 0 < window < n else 0
        first, last = lo // page_size, (n + page_size - 1) // page_size
        for h in range(kv_heads):
            for j in range(group):
                top[j] = -np.inf
                for d in range(dim):
                    acc[j, d] = 0.0
                    qs[j, d] = q[b, h * group + j, d] * scale
            for p in range(first, last):
                page, t0 = tables[b, p], p * page_size
                start, end = max(lo - t0, 0), min(n - t0, page_size)
                _widen(k, page * page_size, h, start, end, tile, bits)
                factor = k_scale[page]
                for o in range(start, end):
                    for j in range(group):
                        s = np.float32(0.0)
                        for d in range(dim):
                            s += qs[j, d] * tile[o, d]
                        s *= factor
                        probs[j, t0 + o - lo] = s
                        top[j] = max(top[j], s)
            for j in range(group):
                total = np.float32(0.0)
                for t in range(n - lo):
                    e = np.exp(probs[j, t] - top[j])
                    probs[j, t] = e
                    total += e
                inv = np.float32(1.0) / total
                for t in range(n - lo):
                    probs[j, t] *= inv
            for p in range(first, last):
                page, t0 = tables[b, p], p * page_size
                start, end = max(lo - t0, 0), min(n - t0, page_size)
                _widen(v, page * page_size, h, start, end, tile, bits)
                factor = v_scale[page]
                for o in range(start, end):
                    for j in range(group):
                        w = probs[j, t0 + o - lo] * factor
                        for d in range(dim):
                            acc[j, d] += w * tile[o, d]
            for j in range(group):
                for d in range(dim):
                    out[b, h * group + j, d] = acc[j, d]


def supports(k_slots: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the kernel reads this cache: whole-entry FP8 slots (uint8 bits) as wide as the queries."""
    return k_slots.device.type == "cpu" and k_slots.dtype == torch.uint8 and k_slots.shape[-1] == q.shape[-1]


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_decode_attention_reference`` over FP8 pages without gathered copies: [B, heads, dim] in q's
    dtype. ``k_scale`` and ``v_scale`` are the layer's per-page scales [pages]."""
    if k_scale is None or v_scale is None:
        raise ValueError("FP8 pages need their per-page k_scale and v_scale")
    out = torch.empty(q.shape, dtype=torch.float32)
    _decode(
        q.detach().float().contiguous().numpy(),
        k_slots.detach().contiguous().numpy(),
        v_slots.detach().contiguous().numpy(),
        block_tables.contiguous().numpy(),
        seq_lens.contiguous().numpy(),
        page_size,
        np.float32(scale),
        sliding_window or 0,
        k_scale.detach().float().contiguous().numpy(),
        v_scale.detach().float().contiguous().numpy(),
        out.numpy(),
    )
    return out.to(q.dtype)
