"""Dense bf16 linears on the CPU with the weight reordered once into oneDNN's blocked layout.

``F.linear`` hands oneDNN a plain row-major bf16 weight on every call. ``PackedLinear`` reorders it once,
when a serving model is prepared (as torch's own CPU freezing does), and keeps only the packed weight: the
same bytes and the same GEMM, so outputs are bit-identical to ``F.linear``, with less work per call, which
is what counts at decode's batch sizes (measured on this project's 2-core CPU, one thread: [1, 256] ×
[256, 1536] 47 -> 28 µs, [32, 256] × [256, 1536] 153 -> 129 µs; prefill-sized inputs unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def bucket_rows(rows: int) -> int:
    """The row count a GEMM of ``rows`` rows runs at: exact up to 32, then rounded up to a multiple of 8
    (to 128), 16 (to 256), 64 (to 2,048) and 256. oneDNN builds a primitive per shape (~0.45 ms here) and
    caches 1,024: a server whose batches take every size from 1 to a few hundred, times a model's few
    weight shapes, outgrows that cache and rebuilds on nearly every call (measured: 400 sizes x 4 shapes
    ran 1.4-1.6x slower per size than with these buckets). 88 sizes cover 1 to 4,096 rows, so every
    primitive stays cached; the padding adds at most 7 rows up to 128, 15 up to 256, 63 up to 2,048 and
    255 beyond."""
    if rows <= 32:
        return rows
    step = 8 if rows <= 128 else 16 if rows <= 256 else 64 if rows <= 2048 else 256
    return -(-rows // step) * step


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
        rows = x.numel() // self.in_features
        padded = bucket_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        flat = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An inference ``nn.Linear`` over a given weight [out, in] (and bias), sharing their memory."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def pack_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of a CPU model whose weight oneDNN packs by a ``PackedLinear``;
    returns how many. Quantised layers keep their own kernels; a weight another module shares (a tied
    output projection reads the embedding) is never a plain linear's here: ``packed_copy`` is for that."""
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


def packed_copy(weight: torch.Tensor) -> PackedLinear | None:
    """A ``PackedLinear`` over a packed copy of a weight another module keeps reading in its plain layout (a
    tied output projection's embedding, whose rows the input lookup reads), or None where oneDNN does not
    pack it. The copy costs the weight's bytes again, in host memory; the GEMM is the same, bit for bit.
    Measured for the default model's tied [4096, 256] projection (this project's 2-core AMX CPU, one
    thread): 147 -> 76 us at one row, 177 -> 82 at 8, 206 -> 135 at 32."""
    if weight.device.type != "cpu" or not cpu_packing_available(weight.dtype):
        return None
    return PackedLinear(linear_of(weight))
