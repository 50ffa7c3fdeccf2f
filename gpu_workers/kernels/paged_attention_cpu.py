"""Paged decode attention on the CPU: a numba kernel that reads each row's pages in place.

The torch reference gathers every page a group of rows reads into a padded copy per layer, for K and V
(decoding every gathered e4m3 value first), then runs SDPA over the copy. Here each (row, query head)
walks its own page table and reads the stored values where they lie: FP8 (e4m3 bits, their fields moved
into bf16's: exact, 2^120 below their value, given back outside the loops), INT8 codes, BF16 (bits
shifted into fp32's) or fp32, widened inside the dot products rather than into a tile. Scores for four positions are
summed at once (four independent reductions), softmax in fp32 over the row's own positions with a
vectorisable exp, then V four positions at a time; the next pages are prefetched, since a pool's pages
sit anywhere in memory. A KV head's query heads (its GQA group) are served together, so each K and V
position is read once for the group, not once per query head, and two or four query heads at a time
share each value widened in registers; for groups of more than four, FP8 positions are widened once into a
four-position tile that every head of the group reads (widening e4m3 costs more than the tile). Each query
head's sums keep their order, as in a head-at-a-time walk; fastmath still lets the compiler contract a
product into an FMA differently per code shape and CPU, so a value may differ from such a walk in its last
bit (MHA over FP8 pages on an AVX-512 Intel CPU: 0.15% of outputs, by 1 ulp). The page scales multiply a
page's scores and its probabilities, as the Triton kernel does: scalar multiplies per position, not per
element; an INT8 entry's own scale (the bf16 after its codes) multiplies its position's score and
probability the same way. No padding, no mask, no copies.

Same signature and result as ``paged_attention.paged_decode_attention_reference`` (computed in fp32,
returned in q's dtype; the exp is within 5 float32 ulps, and probabilities under e^-64 count as 0).
Compiled on first use, cached on disk by numba. ``decode_step_cpu`` runs it after the K/V write, in one call
per layer.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from gpu_workers.kernels.numba_bits import as_float32, narrow, prefetch, widen

# Reassociation lets the dot products vectorise; no finite-math assumption (scores may be large).
_JIT = {
    "nogil": True,
    "fastmath": {"reassoc", "contract", "nsz", "arcp"},
    "boundscheck": False,
    "cache": True,
}
# FP8 values are read 2^120 below their value (their fields placed in bf16's). The kernel gives that back
# outside the loops (where fastmath could move a multiply) and so that no intermediate overflows: half on
# each side of the scores (the queries and the page factors), and in the V sums 2^100 on the weights and
# 2^20 on the output, so that a weight times a value sits only 2^20 below its true size. A weighted value
# 2^60 below it (an even split) underflows into a float32 denormal once its probability is under ~1e-20,
# and on Intel CPUs every operation on a denormal takes a microcode assist (a sharp softmax then doubled the
# kernel's time). Weights stay finite for page scales up to ~2^28 (values up to ~10^11).
_HALF_FP8_OFFSET = np.float32(2.0**60)
_FP8_OUT_OFFSET = np.float32(2.0**20)
# Pages of K a row's scores run ahead of (fetched while earlier pages are scored); its V pages are fetched
# during its first query head's scores, well before the weighted sum reads them. One layer of 32 rows over
# 8,030 positions, its pages out of cache: FP8 540-600 -> 365-380 us, BF16 650-700 -> 375-380 us.
_PAGES_AHEAD = 2
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # ln 2 in two parts: n * _LN2_HI is exact for |n| < 2^11
_LN2_LO = np.float32(1.428606765330187e-06)
# Probabilities under e^-64 (1.6e-28) count as 0: their share of the output is far below float32's
# resolution, and times a value (2^20 below its size in FP8's V sums) they would make denormals.
_EXP_MIN = np.float32(-64.0)
_INV_FACTORIAL = [np.float32(1.0 / f) for f in (2, 6, 24, 120, 720, 5040)]
_C2, _C3, _C4, _C5, _C6, _C7 = _INV_FACTORIAL
_STORED = (torch.uint8, torch.int8, torch.bfloat16, torch.float32)  # FP8 bits, INT8 entries, BF16, fp32
_INT8_SCALE_BYTES = 2  # an INT8 entry's bf16 scale after its codes (formats.kv_int8)


@numba.njit(**_JIT)
def _prefetch_page(slots, first_slot, head, page_size, line):
    """Every cache line of one KV head's values in one page (``line`` elements to a line)."""
    kv_heads, dim = slots.shape[1], slots.shape[2]
    for o in range(page_size):
        start = ((first_slot + o) * kv_heads + head) * dim
        for e in range(0, dim, line):
            prefetch(slots, start + e)


@numba.njit(**_JIT)
def _exp(x):
    """e^x for x <= 0 (a softmax's shifted scores), vectorisable where ``np.exp`` calls libm per element:
    e^r · 2^n with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its degree-7 Taylor polynomial (within 5
    float32 ulps of e^x); below e^-64 it returns 0."""
    below = x < _EXP_MIN
    x = max(x, _EXP_MIN)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _C7 * r + _C6
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    e = p * as_float32(np.uint32(np.int32(n) + 127) << 23)
    return np.float32(0.0) if below else e


@numba.njit(inline="always", **_JIT)
def _entry_scale(slots, slot, head, dim):
    """The scale of the INT8 entry at ``slots[slot, head]``: the bf16 in its two bytes after ``dim`` codes."""
    low = np.uint32(slots[slot, head, dim]) & np.uint32(0xFF)
    high = np.uint32(slots[slot, head, dim + 1]) & np.uint32(0xFF)
    return as_float32(((high << 8) | low) << 16)


@numba.njit(inline="always", **_JIT)
def _times_entry_scales(probs, slots, base, start, end, head, dim, t):
    """Scale every query head's ``probs[:, t:t + end - start]`` by the scales of the INT8 entries at slots
    ``base + start`` to ``base + end`` of one KV head."""
    for r in range(start, end):
        factor = _entry_scale(slots, base + r, head, dim)
        for g in range(probs.shape[0]):
            probs[g, t + r - start] *= factor


@numba.njit(**_JIT)
def _widen_rows(slots, first, count, head, tile):
    """``count`` positions of one KV head from slot ``first`` on, widened into the first rows of ``tile``
    [4, 1, dim] (shaped as slots are, so that the loops below read either)."""
    for j in range(count):
        for d in range(tile.shape[2]):
            tile[j, 0, d] = widen(slots[first + j, head, d])


@numba.njit(inline="always", **_JIT)
def _scores(qs, src, first, head, factor, probs, t):
    """Scores of four positions of one KV head (``src[first:first + 4, head]``: a page's slots, or their
    widened tile at 0, 0) for every query head of its group (``qs`` [group, dim]), times ``factor``, into
    ``probs[:, t:t + 4]``. Four query heads at a time share each widened value (two positions at a time:
    eight sums), then two (four positions); each head's sums are independent, so their reductions overlap
    rather than queue. The same bits whatever the grouping; four heads took 0.90x (FP8) and 0.95x (BF16)
    the time of pairs for 8 or 16 query heads over 2 or 4 KV heads at 32 rows. Sharing V values four ways
    as well was 1.7x slower for groups of eight, so ``_accumulate`` stays with pairs."""
    group, dim = qs.shape
    quads = group - group % 4
    for g in range(0, quads, 4):
        for o in range(0, 4, 2):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            b0 = np.float32(0.0)
            b1 = np.float32(0.0)
            c0 = np.float32(0.0)
            c1 = np.float32(0.0)
            e0 = np.float32(0.0)
            e1 = np.float32(0.0)
            for d in range(dim):
                k0, k1 = widen(src[first + o, head, d]), widen(src[first + o + 1, head, d])
                a0 += qs[g, d] * k0
                a1 += qs[g, d] * k1
                b0 += qs[g + 1, d] * k0
                b1 += qs[g + 1, d] * k1
                c0 += qs[g + 2, d] * k0
                c1 += qs[g + 2, d] * k1
                e0 += qs[g + 3, d] * k0
                e1 += qs[g + 3, d] * k1
            probs[g, t + o] = a0 * factor
            probs[g, t + o + 1] = a1 * factor
            probs[g + 1, t + o] = b0 * factor
            probs[g + 1, t + o + 1] = b1 * factor
            probs[g + 2, t + o] = c0 * factor
            probs[g + 2, t + o + 1] = c1 * factor
            probs[g + 3, t + o] = e0 * factor
            probs[g + 3, t + o + 1] = e1 * factor
    paired = group - group % 2
    for g in range(quads, paired, 2):
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        r0 = np.float32(0.0)
        r1 = np.float32(0.0)
        r2 = np.float32(0.0)
        r3 = np.float32(0.0)
        for d in range(dim):
            x, y = qs[g, d], qs[g + 1, d]
            k0, k1 = widen(src[first, head, d]), widen(src[first + 1, head, d])
            k2, k3 = widen(src[first + 2, head, d]), widen(src[first + 3, head, d])
            s0 += x * k0
            s1 += x * k1
            s2 += x * k2
            s3 += x * k3
            r0 += y * k0
            r1 += y * k1
            r2 += y * k2
            r3 += y * k3
        probs[g, t] = s0 * factor
        probs[g, t + 1] = s1 * factor
        probs[g, t + 2] = s2 * factor
        probs[g, t + 3] = s3 * factor
        probs[g + 1, t] = r0 * factor
        probs[g + 1, t + 1] = r1 * factor
        probs[g + 1, t + 2] = r2 * factor
        probs[g + 1, t + 3] = r3 * factor
    for g in range(paired, group):
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for d in range(dim):
            x = qs[g, d]
            s0 += x * widen(src[first, head, d])
            s1 += x * widen(src[first + 1, head, d])
            s2 += x * widen(src[first + 2, head, d])
            s3 += x * widen(src[first + 3, head, d])
        probs[g, t] = s0 * factor
        probs[g, t + 1] = s1 * factor
        probs[g, t + 2] = s2 * factor
        probs[g, t + 3] = s3 * factor


@numba.njit(inline="always", **_JIT)
def _weights(probs, g, t, factor):
    """Query head g's probabilities of positions t to t + 3, times ``factor``."""
    return probs[g, t] * factor, probs[g, t + 1] * factor, probs[g, t + 2] * factor, probs[g, t + 3] * factor


@numba.njit(inline="always", **_JIT)
def _accumulate(acc, probs, t, inv, factor, src, first, head):
    """``acc`` [group, dim] += the four positions' values (``src[first:first + 4, head]``, as in
    ``_scores``) weighted by each query head's probabilities ``probs[:, t:t + 4]`` times ``inv`` (its
    softmax's 1 / sum) and ``factor``; two query heads at a time share each widened value."""
    group, dim = acc.shape
    paired = group - group % 2
    for g in range(0, paired, 2):
        w0, w1, w2, w3 = _weights(probs, g, t, factor * inv[g])
        u0, u1, u2, u3 = _weights(probs, g + 1, t, factor * inv[g + 1])
        for d in range(dim):
            v0, v1 = widen(src[first, head, d]), widen(src[first + 1, head, d])
            v2, v3 = widen(src[first + 2, head, d]), widen(src[first + 3, head, d])
            acc[g, d] += (w0 * v0 + w1 * v1) + (w2 * v2 + w3 * v3)
            acc[g + 1, d] += (u0 * v0 + u1 * v1) + (u2 * v2 + u3 * v3)
    for g in range(paired, group):
        w0, w1, w2, w3 = _weights(probs, g, t, factor * inv[g])
        for d in range(dim):
            acc[g, d] += (w0 * widen(src[first, head, d]) + w1 * widen(src[first + 1, head, d])) + (
                w2 * widen(src[first + 2, head, d]) + w3 * widen(src[first + 3, head, d])
            )


@numba.njit(**_JIT)
def _decode(q, k, v, tables, lens, page_size, scale, window, k_scale, v_scale, half_offset, entries, out):
    """``out``: float32, or bf16 bits (uint16: each value rounded to nearest even, as ``.to`` rounds).
    ``entries``: K and V are INT8 entries, each scaled by its own scale (``k_scale``/``v_scale`` are ones)."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    line = 64 // k.itemsize  # values to a cache line
    probs = np.empty((group, tables.shape[1] * page_size), np.float32)  # per query head: positions from lo
    acc = np.empty((group, dim), np.float32)
    qs = np.empty((group, dim), np.float32)
    vals = np.empty((4, 1, dim), np.float32)  # four positions of one KV head, widened once for its group
    inv = np.empty(group, np.float32)
    # FP8 in groups over four: widening (once per pair otherwise) costs more than the tile's stores and loads
    tiled = k.itemsize == 1 and group > 4
    out_offset = _FP8_OUT_OFFSET if half_offset > 1 else np.float32(1.0)
    v_offset = half_offset * (half_offset / out_offset)  # 2^100 for FP8, else 1 (powers of 2: exact)
    for b in range(rows):
        n = lens[b]
        lo = n - window if 0 < window < n else 0
        first, last = lo // page_size, (n + page_size - 1) // page_size
        m = n - lo
        for h in range(kv_heads):
            for g in range(group):
                for d in range(dim):
                    qs[g, d] = widen(q[b, h * group + g, d]) * (scale * half_offset)
            for p in range(first, last):
                page, t0 = tables[b, p], p * page_size
                start, end = max(lo - t0, 0), min(n - t0, page_size)
                factor = k_scale[page] * half_offset
                base = page * page_size
                if p + _PAGES_AHEAD < last:
                    _prefetch_page(k, tables[b, p + _PAGES_AHEAD] * page_size, h, page_size, line)
                _prefetch_page(v, base, h, page_size, line)
                o = start
                while o + 4 <= end:
                    t = t0 + o - lo
                    if tiled:
                        _widen_rows(k, base + o, 4, h, vals)
                        _scores(qs, vals, 0, 0, factor, probs, t)
                    else:
                        _scores(qs, k, base + o, h, factor, probs, t)
                    o += 4
                for r in range(o, end):  # the page's last positions, one at a time
                    _widen_rows(k, base + r, 1, h, vals)
                    for g in range(group):
                        s = np.float32(0.0)
                        for d in range(dim):
                            s += qs[g, d] * vals[0, 0, d]
                        probs[g, t0 + r - lo] = s * factor
                if entries:
                    _times_entry_scales(probs, k, base, start, end, h, dim, t0 + start - lo)
            for g in range(group):
                top = probs[g, 0]
                for t in range(1, m):
                    top = max(top, probs[g, t])
                total = np.float32(0.0)
                for t in range(m):
                    e = _exp(probs[g, t] - top)
                    probs[g, t] = e
                    total += e
                inv[g] = np.float32(1.0) / total
                for d in range(dim):
                    acc[g, d] = 0.0
            if entries:  # each position's V scale on its probabilities (the sums above are without it)
                for p in range(first, last):
                    t0 = p * page_size
                    start, end = max(lo - t0, 0), min(n - t0, page_size)
                    _times_entry_scales(
                        probs, v, tables[b, p] * page_size, start, end, h, dim, t0 + start - lo
                    )
            for p in range(first, last):
                page, t0 = tables[b, p], p * page_size
                start, end = max(lo - t0, 0), min(n - t0, page_size)
                base = page * page_size
                o = start
                while o + 4 <= end:
                    t = t0 + o - lo
                    if tiled:
                        _widen_rows(v, base + o, 4, h, vals)
                        _accumulate(acc, probs, t, inv, v_scale[page] * v_offset, vals, 0, 0)
                    else:
                        _accumulate(acc, probs, t, inv, v_scale[page] * v_offset, v, base + o, h)
                    o += 4
                for r in range(o, end):
                    _widen_rows(v, base + r, 1, h, vals)
                    for g in range(group):
                        w = probs[g, t0 + r - lo] * (v_scale[page] * inv[g] * v_offset)
                        for d in range(dim):
                            acc[g, d] += w * vals[0, 0, d]
            for g in range(group):
                for d in range(dim):
                    out[b, h * group + g, d] = narrow(acc[g, d] * out_offset, out)


def supports(k_slots: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the kernel reads this cache: FP8 (uint8 bits), BF16 or fp32 slots as wide as the queries, or
    INT8 entries (their scale after the codes)."""
    width = q.shape[-1] + (_INT8_SCALE_BYTES if k_slots.dtype == torch.int8 else 0)
    return k_slots.device.type == "cpu" and k_slots.dtype in _STORED and k_slots.shape[-1] == width


def host_array(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the numpy array the kernels read, sharing its memory (bf16 as its bits: numpy has no
    bfloat16)."""
    x = x.detach()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


@functools.lru_cache(maxsize=8)
def _unit_scales(pages: int) -> np.ndarray:
    """Per-page scales of an unquantised cache: 1 everywhere (read only)."""
    ones = np.ones(pages, np.float32)
    ones.flags.writeable = False
    return ones


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
    """``paged_decode_attention_reference`` without gathered copies: [B, heads, dim] in q's dtype.
    FP8 slots need the layer's per-page ``k_scale`` and ``v_scale`` [pages]; INT8 entries carry theirs."""
    fp8 = k_slots.dtype == torch.uint8
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("FP8 pages need their per-page k_scale and v_scale")
    if fp8:
        scales = [s.detach().float().contiguous().numpy() for s in (k_scale, v_scale)]
    else:
        scales = [_unit_scales(k_slots.shape[0] // page_size)] * 2
    out = torch.empty(q.shape, dtype=torch.float32)
    _decode(
        q.detach().float().contiguous().numpy(),
        host_array(k_slots.contiguous()),
        host_array(v_slots.contiguous()),
        block_tables.contiguous().numpy(),
        seq_lens.contiguous().numpy(),
        page_size,
        np.float32(scale),
        sliding_window or 0,
        *scales,
        _HALF_FP8_OFFSET if fp8 else np.float32(1.0),
        k_slots.dtype == torch.int8,
        out.numpy(),
    )
    return out.to(q.dtype)
