"""The gated MLP's activation: ``silu_mul(gate_up)`` -> SiLU(gate) * up, from a fused gate/up projection's output
[..., 2 * inter] (gate the first half, up the second) to [..., inter].

Done as torch ops it is a split, SiLU and a multiply: three dispatches, two launches on a GPU and two
allocations per layer, for rows of a few thousand values at decode. With Triton it is one launch
(``silu_mul_triton``); on the CPU kernels one numba call (``silu_mul_cpu``) giving this reference's bits.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from gpu_workers.kernels import backend, records_grad

log = logging.getLogger(__name__)

_cpu = None  # silu_mul_cpu once imported: numba is imported where the CPU kernels run only


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused gate/up output [..., 2 * inter]: one Triton launch, or one numba call on the
    CPU kernels where it reads the rows (``silu_mul_cpu.cpu_silu_mul_supported``) and gives this torch's bits
    (``cpu_matches``), else (and where autograd records: training) the reference."""
    kernels = backend(gate_up.device)
    if kernels == "reference" or records_grad(gate_up):
        return silu_mul_reference(gate_up)
    if kernels == "cpu":
        cpu = _cpu or _import_cpu()
        if cpu.cpu_silu_mul_supported(gate_up) and cpu_matches(gate_up.dtype):
            return cpu.silu_mul_cpu(gate_up)
    elif gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0:
        from gpu_workers.kernels.silu_mul_triton import silu_mul_triton

        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


def _import_cpu():
    global _cpu
    from gpu_workers.kernels import silu_mul_cpu

    _cpu = silu_mul_cpu
    return _cpu


@functools.cache
def cpu_matches(dtype: torch.dtype) -> bool:
    """Whether the CPU kernel gives this torch's bits for ``dtype``: asked once, on ``silu_mul_cpu.probe``
    (NaN for NaN, whatever its payload)."""
    cpu = _cpu or _import_cpu()
    gate_up = cpu.probe(dtype)
    want, got = silu_mul_reference(gate_up), cpu.silu_mul_cpu(gate_up)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    same = (want.view(bits) == got.view(bits)) | (want.isnan() & got.isnan())
    if not bool(same.all()):
        log.warning(
            "the CPU SiLU kernel differs from this torch's SiLU on %d of %d %s probe values: the torch "
            "reference serves",
            int((~same).sum()),
            same.numel(),
            dtype,
        )
        return False
    return True
