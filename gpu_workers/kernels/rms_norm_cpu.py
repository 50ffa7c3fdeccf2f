"""Residual add + RMSNorm on the CPU in one numba call, bit for bit what ``rms_norm.add_rms_norm_reference``
computes (HF's LlamaRMSNorm after an add), for bf16 or fp32 rows with weights of the same dtype.

The reference is ten torch ops a norm (add, upcast, square, the mean's sum and divide, eps, rsqrt, scale,
downcast, weight), each a dispatch and an allocation, for rows of a few hundred values at decode; here one
call does them all, row by row. The same bits need the same arithmetic in the same order:
- the add, the scale and the weight multiply are float32 operations on the widened values, each result
  rounded to the row's dtype where torch rounds it (bf16 rows: round to nearest even);
- the mean of squares is torch's float sum (``SumKernel.cpp``'s ``cascade_sum`` over a contiguous row):
  eight-lane vectors summed four at a time into cascading levels of 16, the four partial vectors added in
  order, the tail after the last whole vector summed as scalars, then the eight lanes added in order; rows
  shorter than eight take the scalar form of the same cascade. Then a float32 divide by the length, the
  eps added in float32, ``1 / sqrt`` (both correctly rounded, as torch's ``rsqrt`` on the CPU computes it).
Torch's CPU sum splits one row across threads only for a row of 32,768 values or more (or rows fewer than
its threads with that many values in all); hidden sizes stay below that.
No fastmath here: reassociating or contracting a sum changes its bits.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from gpu_workers.kernels.numba_bits import narrow, pointer, widen

_JIT = {"nogil": True, "boundscheck": False, "cache": True}
_LANES = 8  # torch's Vectorized<float> in the sum kernel (built for AVX2 on x86, two NEON registers on ARM)
_ILP = 4  # vectors (or scalars) summed side by side
_LEVELS = 4
# What a row's element is, as the kernel's pointers are typed: bf16 bits or float32.
_ELEMENTS = {torch.bfloat16: np.empty(0, np.uint16), torch.float32: np.empty(0, np.float32)}


@numba.njit(inline="always", **_JIT)
def _ceil_log2(x):
    if x <= 2:
        return 1
    bits = 0
    x -= 1
    while x > 0:
        bits += 1
        x >>= 1
    return bits


@numba.njit(inline="always", **_JIT)
def _add_vectors(acc, squares, i, width):
    """The four vectors side by side at index ``i`` onto the cascade's first level, lane by lane."""
    for k in range(_ILP):
        base = (i * _ILP + k) * width
        for lane in range(width):
            acc[0, k, lane] += squares[base + lane]


@numba.njit(**_JIT)
def _row_sum(squares, width):
    """Torch's ``row_sum`` over ``squares`` [n // width, width] read as vectors of ``width`` lanes (8, or 1
    for the scalar form): four vectors side by side, each into a cascade of levels; the leftover vectors
    onto the first; the four then added in order. Returns the summed vector [width]."""
    size = squares.shape[0] // width
    size_ilp = size // _ILP
    level_power = max(4, _ceil_log2(size_ilp) // _LEVELS)
    level_step = 1 << level_power
    level_mask = level_step - 1
    acc = np.zeros((_LEVELS, _ILP, width), np.float32)
    i = 0
    while i + level_step <= size_ilp:
        for _ in range(level_step):
            _add_vectors(acc, squares, i, width)
            i += 1
        for j in range(1, _LEVELS):
            for k in range(_ILP):
                for lane in range(width):
                    acc[j, k, lane] += acc[j - 1, k, lane]
                    acc[j - 1, k, lane] = 0.0
            if i & (level_mask << (j * level_power)) != 0:
                break
    while i < size_ilp:
        _add_vectors(acc, squares, i, width)
        i += 1
    for j in range(1, _LEVELS):
        for k in range(_ILP):
            for lane in range(width):
                acc[0, k, lane] += acc[j, k, lane]
    for v in range(size_ilp * _ILP, size):
        for lane in range(width):
            acc[0, 0, lane] += squares[v * width + lane]
    for k in range(1, _ILP):
        for lane in range(width):
            acc[0, 0, lane] += acc[0, k, lane]
    return acc[0, 0]


@numba.njit(**_JIT)
def _sum_of_squares(squares):
    """torch's ``sum`` of one contiguous float32 row, to the bit."""
    n = squares.shape[0]
    if n < _LANES:
        return _row_sum(squares, 1)[0]
    vectors = n // _LANES
    lanes = _row_sum(squares[: vectors * _LANES], _LANES)
    total = np.float32(0.0)
    for k in range(vectors * _LANES, n):
        total += squares[k]
    for lane in range(_LANES):
        total += lanes[lane]
    return total


@numba.njit(**_JIT)
def _add_rms_norm(x, residual, add, weight, eps, normed, summed):
    """normed = weight * norm(x + residual) and summed = x + residual, row by row (``add`` False: summed
    is x). Arrays [T, H] of bf16 bits (uint16) or float32, all of one type."""
    rows, dim = x.shape
    values = np.empty(dim, np.float32)
    squares = np.empty(dim, np.float32)
    length = np.float32(dim)
    for t in range(rows):
        for d in range(dim):
            value = widen(x[t, d])
            if add:
                stored = narrow(value + widen(residual[t, d]), x)
                summed[t, d] = stored
                value = widen(stored)
            values[d] = value
            squares[d] = value * value
        mean = _sum_of_squares(squares) / length
        inverse = np.float32(1.0) / np.sqrt(mean + eps)
        for d in range(dim):
            normed[t, d] = narrow(widen(narrow(values[d] * inverse, x)) * widen(weight[d]), x)


@numba.njit(**_JIT)
def _add_rms_norm_at(x, residual, add, weight, eps, normed, summed, rows, dim, like):
    """``_add_rms_norm`` on memory given by address (tensors' ``data_ptr()``; ``like``: their element type):
    a call then costs no numpy array per tensor."""
    shape = (rows, dim)
    _add_rms_norm(
        numba.carray(pointer(x, like), shape),
        numba.carray(pointer(residual, like), shape),
        add,
        numba.carray(pointer(weight, like), (dim,)),
        np.float32(eps),  # torch adds eps in float32
        numba.carray(pointer(normed, like), shape),
        numba.carray(pointer(summed, like), shape),
    )


def cpu_norm_supported(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether ``add_rms_norm_cpu`` serves these rows: x [T, H] bf16 or fp32 on the CPU, the residual (if
    any) of the same shape and dtype, the weight [H] alike. The kernel reads memory by address: anything
    else (a broadcast, another dtype) is the reference's."""
    dtype, shape = x.dtype, x.shape  # asked at every norm of a step: each read once
    return (
        dtype in _ELEMENTS
        and len(shape) == 2
        and shape[1] < 32768
        and weight.dtype == dtype
        and weight.dim() == 1
        and weight.shape[0] == shape[1]
        and (residual is None or (residual.dtype == dtype and residual.shape == shape))
    )


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm_reference``'s (``weight * norm(x + residual)``, ``x + residual``), to the bit, in one
    call; ``cpu_norm_supported`` rows only."""
    x = x.contiguous()
    rows, dim = x.shape
    normed = torch.empty_like(x)  # x contiguous: a plain [rows, dim] tensor, and cheaper than torch.empty
    if residual is None:
        summed = x
    else:
        residual = residual.contiguous()
        summed = torch.empty_like(x)
    weight = weight.contiguous()
    _add_rms_norm_at(
        x.data_ptr(),
        summed.data_ptr() if residual is None else residual.data_ptr(),
        residual is not None,
        weight.data_ptr(),
        eps,
        normed.data_ptr(),
        summed.data_ptr(),
        rows,
        dim,
        _ELEMENTS[x.dtype],
    )
    return normed, summed
