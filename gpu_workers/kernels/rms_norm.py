"""Residual add + RMSNorm in one pass: ``add_rms_norm(x, residual, weight, eps)`` -> (normed, sum).

A decoder layer adds its sublayer's output to the residual stream and normalises the sum for the next
sublayer; done apart that is an add and RMSNorm's upcast, square, mean, rsqrt, scale, downcast and weight
multiply, each a kernel launch on a GPU. Here the sum ``x + residual`` (in x's dtype, the next residual) and
``weight * norm(sum)`` come from one kernel where Triton runs, from this reference elsewhere. Without a
residual the sum is ``x`` itself (a layer stack's first norm). The arithmetic is HF's: normalised in float32,
cast back to x's dtype, then times the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_workers.kernels import backend, records_grad


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, normalised in float32."""
    if x.dtype == torch.float32 == weight.dtype:
        return F.rms_norm(x, weight.shape, weight, eps)  # one call, same math
    # x * rsqrt(mean(x^2) + eps) in float32 as one call: the same ops, bit for bit, one dispatch for five.
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x if residual is None else x + residual
    return rms_norm_reference(summed, weight, eps), summed


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    kernels: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``weight * norm(x + residual)``, ``x + residual``) for x, residual [T, hidden]: one Triton kernel, or
    one numba call on the CPU (``rms_norm_cpu``: the reference's bits), else (and where autograd records:
    training) the reference. ``kernels``: ``kernels.backend(x.device)`` where the caller knows it (a step
    asks once, not at every norm)."""
    kernels = kernels or backend(x.device)
    if records_grad(x, residual, weight):
        kernels = "reference"
    if kernels == "cpu":
        cpu = _cpu or _import_cpu()
        if cpu.cpu_norm_supported(x, residual, weight):
            return cpu.add_rms_norm_cpu(x, residual, weight, eps)
    elif kernels == "triton" and x.dim() == 2:
        from gpu_workers.kernels.rms_norm_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


_cpu = None  # rms_norm_cpu once imported: numba is imported where the CPU kernels run only


def _import_cpu():
    global _cpu
    from gpu_workers.kernels import rms_norm_cpu

    _cpu = rms_norm_cpu
    return _cpu
