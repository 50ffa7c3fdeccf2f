"""Triton SiLU(gate) * up: one launch for what torch does in two (SiLU, then the multiply), each program a
block of one row's columns, reading gate and up from the fused projection's output once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # SiLU rounded to the row's dtype before the multiply, as torch's two ops round it.
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as ``silu_mul.silu_mul_reference`` for gate_up [T, 2 * inter]."""
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(inter, _BLOCK))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=4
        )
    return out
