"""Linear layers over quantised weights, and swapping them into a model in place of ``nn.Linear``.

Their tensors are buffers named as in the checkpoint (``<module>.weight_packed`` ...), so the loader fills
them by name. ``load_dense`` quantises an unquantised weight into them: quantising at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_workers.formats.weights import SCALE_DTYPE, quantize_fp8_weight, quantize_int4
from gpu_workers.kernels.quant_linear import fp8_linear, int4_linear
from gpu_workers.quant.config import QuantConfig


class Fp8Linear(nn.Module):
    """y = x @ (W_fp8 * scale).T + b with e4m3 weights and one fp32 scale per output channel."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bias_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype)) if bias else None

    def load_dense(self, weight: torch.Tensor) -> None:
        q = quantize_fp8_weight(weight.to(self.weight.device))
        self.weight.copy_(q.weight)
        self.weight_scale.copy_(q.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)


class Int4Linear(nn.Module):
    """y = x @ W.T + b with W = (q - zero) * scale, int4 codes in groups along the input dimension."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        bias_dtype: torch.dtype,
        group_size: int,
        symmetric: bool,
    ):
        super().__init__()
        if in_features % 2:
            raise ValueError(f"int4 packs two input columns per byte; in_features {in_features} is odd")
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.symmetric = group_size, symmetric
        groups = -(-in_features // group_size)
        self.register_buffer("weight_packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=SCALE_DTYPE))
        self.weight_zero: torch.Tensor | None
        if symmetric:
            self.weight_zero = None
        else:
            self.register_buffer("weight_zero", torch.empty(out_features, groups, dtype=SCALE_DTYPE))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype)) if bias else None

    def load_dense(self, weight: torch.Tensor) -> None:
        q = quantize_int4(weight.to(self.weight_packed.device), self.group_size, self.symmetric)
        self.weight_packed.copy_(q.weight_packed)
        self.weight_scale.copy_(q.weight_scale)
        if q.weight_zero is not None:
            self.weight_zero.copy_(q.weight_zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(
            x, self.weight_packed, self.weight_scale, self.weight_zero, self.group_size, self.bias
        )


QuantLinear = Fp8Linear | Int4Linear


def quantized_linear(linear: nn.Linear, quant: QuantConfig) -> QuantLinear:
    """An empty quantised layer of ``linear``'s shape (on its device, e.g. meta); the loader fills it."""
    bias, dtype = linear.bias is not None, linear.weight.dtype
    if quant.format == "fp8":
        return Fp8Linear(linear.in_features, linear.out_features, bias, dtype)
    return Int4Linear(linear.in_features, linear.out_features, bias, dtype, quant.group_size, quant.symmetric)


def convert_linears(model: nn.Module, quant: QuantConfig) -> list[str]:
    """Replace every ``nn.Linear`` that ``quant`` converts by its quantised layer; returns their names."""
    converted = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and quant.converts(name):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            with torch.device(module.weight.device):
                setattr(parent, child, quantized_linear(module, quant))
            converted.append(name)
    return converted
