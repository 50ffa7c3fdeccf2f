"""Dense bf16 linears on the CPU with the weight reordered once into oneDNN's blocked layout.

``F.linear`` on a bf16 weight in plain row-major layout lets oneDNN reorder it on every call; the reorder
dominates at the batch sizes of decode. ``PackedLinear`` reorders once, when a serving model is prepared
(as torch's own CPU freezing does), and keeps only the packed weight: the same bytes, the same GEMM, so
outputs are bit-identical to ``F.linear`` (measured on this project's 2-core CPU, one thread: [1, 256] ×
[256, 1536] 47 -> 28 µs, [32, 256] × [256, 1536] 153 -> 129 µs; prefill-sized inputs unchanged).
"""

from __future__ import annotations

import torch
from torch import nn


def cpu_packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run oneDNN's packed GEMM for weights in ``dtype`` (bf16 only: in
    fp32 the packed kernel was slower than ``F.linear`` at one row)."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight packed for oneDNN: inference only (the packed weight is an
    opaque tensor, neither a parameter nor in ``state_dict``: a serving model is loaded, then packed)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The batch size is oneDNN's layout hint; measured: the same speed for 1-2,000 rows whatever it is.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 32)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def pack_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of a CPU model whose weight oneDNN packs by a ``PackedLinear``;
    returns how many. Quantised layers keep their own kernels; a weight another module shares (a tied
    output projection reads the embedding) is never a plain linear's here."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.device.type == "cpu"
                and cpu_packing_available(child.weight.dtype)
            ):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
