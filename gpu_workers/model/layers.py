"""Building blocks shared by the decoder architectures: RMSNorm (with the residual add before it), the
SwiGLU feed-forward, and fusing linears that read the same input into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.kernels.rms_norm import add_rms_norm, rms_norm_reference
from gpu_workers.kernels.silu_mul import silu_mul
from gpu_workers.quant.linear import Fp8Linear, Int4Linear


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalised in float32 as HF does, over the last dimension."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, kernels: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a residual stream's add and the next norm in one kernel where
        one runs (``kernels.rms_norm``; ``kernels``: the step's backend, where the caller has it); without a
        residual, (norm(x), x)."""
        return add_rms_norm(x, residual, self._parameters["weight"], self.eps, kernels)


def concat_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One linear whose output is the given linears' outputs side by side, or None when they differ in kind
    (type, bias) or their kind cannot be stacked. Plain ``nn.Linear`` stacks here; a quantised layer class
    (``Fp8Linear``, ``Int4Linear``) stacks itself through its ``concat`` (its codes and scales stack along
    the output dimension exactly)."""
    kinds = {type(m) for m in linears}
    if None in linears or len(kinds) != 1 or len({m.bias is None for m in linears}) != 1:
        return None
    kind = kinds.pop()
    if issubclass(kind, Fp8Linear | Int4Linear):
        return kind.concat(linears)
    if kind is not nn.Linear:
        return None
    weight = torch.cat([m.weight for m in linears])
    # On the meta device: no memory is initialised for a weight about to be overwritten.
    fused = nn.Linear(
        weight.shape[1], weight.shape[0], bias=linears[0].bias is not None, device="meta", dtype=weight.dtype
    )
    fused = fused.to_empty(device=weight.device).requires_grad_(False)
    fused.weight.data.copy_(weight)
    if fused.bias is not None:
        fused.bias.data.copy_(torch.cat([m.bias for m in linears]))
    return fused


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); ``fuse`` makes gate and up one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # a plain or a quantised linear

    def fuse(self) -> None:
        """Replace gate_proj and up_proj by one linear with both weights (after the checkpoint loaded)."""
        fused = concat_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj, self.gate_proj, self.up_proj = fused, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modules = self._modules  # not nn.Module's attribute fallback (~1 us a read), at every layer
        gate_up = modules.get("gate_up_proj")
        if gate_up is not None:  # split, SiLU and multiply in one kernel where one runs
            return modules["down_proj"](silu_mul(gate_up(x)))
        return modules["down_proj"](F.silu(modules["gate_proj"](x)) * modules["up_proj"](x))
