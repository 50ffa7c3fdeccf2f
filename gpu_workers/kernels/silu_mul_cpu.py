"""SiLU(gate) * up on the CPU in one numba call, bit for bit what ``silu_mul.silu_mul_reference`` computes, for
bf16 or fp32 rows.

Torch's CPU SiLU computes ``x / (1 + exp(-x))`` in float32 on vectors, its ``exp`` being SLEEF's
single-precision exp with 1-ulp accuracy (``expf_u10``), not the C library's: with the C library's exp, a
float32 SiLU differs from torch's in the last bit on 4% of values (419,914 of 10M normal values, sd 8).
Rounded to bf16 no bf16 input showed a difference here, which nothing guarantees. So the exp here is that
function's own arithmetic: n = rint(x * log2(e)); the reduced argument s = x - n * ln2, with ln2 split in
two parts, each step one fused multiply-add; a degree-5 polynomial p(s) by Horner's rule in FMAs;
e = 1 + (s * s * p + s); scaled by 2^n as two powers of two (2^(n >> 1), then the rest), so no
intermediate overflows; 0 below -104 and infinity above 100. SiLU rounds to the row's dtype, the product
with up is a float32 multiply rounded again, as torch's ``mul`` on bf16 rounds.

Torch runs that vectorised loop over whole pairs of vectors and the C library's exp on a row's last few
values: a row of a multiple of 64 values is all vector work on every x86 and ARM build, the kernel's rows.
Whether this torch computes SiLU so is checked once per dtype against torch itself (``probe``: every bf16
value, a spread of float32 ones); where it does not, the reference serves.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from gpu_workers.kernels.numba_bits import as_float32, fma, narrow, pointer, rint, widen

# error_model="numpy": IEEE division, not Python's zero check, which keeps the row loop from vectorising
_JIT = {"nogil": True, "boundscheck": False, "cache": True, "error_model": "numpy"}
_ROW_MULTIPLE = 64  # two vectors of 32 bf16 (AVX-512): a row of a multiple of this is all vector work
_ELEMENTS = {torch.bfloat16: np.empty(0, np.uint16), torch.float32: np.empty(0, np.float32)}
_F = np.float32


@numba.njit(inline="always", **_JIT)
def _exp(x):
    """SLEEF's ``expf_u10`` (FMA build), to the bit."""
    n = rint(x * _F(1.442695040888963407359924681001892137426645954152985934135449406931))
    s = fma(n, _F(-0.693145751953125), x)
    s = fma(n, _F(-1.428606765330187045e-06), s)
    p = _F(0.000198527617612853646278381)
    p = fma(p, s, _F(0.00139304355252534151077271))
    p = fma(p, s, _F(0.00833336077630519866943359))
    p = fma(p, s, _F(0.0416664853692054748535156))
    p = fma(p, s, _F(0.166666671633720397949219))
    p = fma(p, s, _F(0.5))
    e = _F(1.0) + fma(s * s, p, s)
    q = np.int32(n)
    half = q >> 1
    e = e * as_float32(np.uint32((half + 0x7F) << 23)) * as_float32(np.uint32((q - half + 0x7F) << 23))
    # selects, not branches: the loop over a row stays vectorisable
    e = _F(0.0) if x < _F(-104.0) else e
    return _F(np.inf) if x > _F(100.0) else e


@numba.njit(**_JIT)
def _silu_mul(gate_up, out):
    """out [T, inter] = SiLU(gate) * up of gate_up [T, 2 * inter], bf16 bits (uint16) or float32 alike."""
    rows, inter = out.shape
    for t in range(rows):
        for i in range(inter):
            x = widen(gate_up[t, i])
            silu = widen(narrow(x / (_F(1.0) + _exp(-x)), out))
            out[t, i] = narrow(silu * widen(gate_up[t, inter + i]), out)


@numba.njit(**_JIT)
def _silu_mul_at(gate_up, out, rows, inter, like):
    """``_silu_mul`` on memory given by address (tensors' ``data_ptr()``; ``like``: their element type)."""
    _silu_mul(
        numba.carray(pointer(gate_up, like), (rows, 2 * inter)),
        numba.carray(pointer(out, like), (rows, inter)),
    )


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_mul_reference(gate_up)`` in one call; ``cpu_silu_mul_supported`` rows only."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    _silu_mul_at(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, _ELEMENTS[gate_up.dtype])
    return out


def cpu_silu_mul_supported(gate_up: torch.Tensor) -> bool:
    """Whether ``silu_mul_cpu`` reads these rows: [T, 2 * inter] bf16 or fp32 on the CPU, inter a multiple of
    64 (all vector work in torch). Whether this torch's SiLU is the arithmetic reproduced here is the
    caller's question (``silu_mul.silu_mul``)."""
    return (
        gate_up.dtype in _ELEMENTS
        and gate_up.dim() == 2
        and gate_up.shape[1] % (2 * _ROW_MULTIPLE) == 0
        and gate_up.device.type == "cpu"
    )


def probe(dtype: torch.dtype) -> torch.Tensor:
    """A gate/up row [1, 2 * 65536] that tells whether the kernel gives another SiLU's bits: as gate, every bf16
    value (for float32: values from 2^-140 to 2^7 of both signs, zeros, infinities and NaN), as up a
    permutation of them."""
    if dtype == torch.bfloat16:
        gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    else:
        magnitudes = torch.logspace(-140, 7, 2**15 - 4, base=2.0)
        special = torch.tensor([0.0, float("inf"), float("nan"), 104.5])
        gate = torch.cat([magnitudes, special, -magnitudes, -special])
    up = gate[torch.arange(gate.numel()) * 40503 % gate.numel()]  # an odd multiplier: a permutation
    return torch.cat([gate, up])[None]
