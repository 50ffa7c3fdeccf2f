"""Linear layers over quantised weights, and swapping them into a model in place of ``nn.Linear``.

Their tensors are buffers named as in the checkpoint (``<module>.weight_packed`` ...), so the loader fills
them by name. ``load_dense`` quantises an unquantised weight into them: quantising at load time.

On CPU the first forward prepares the weights once for the activations' dtype and reuses them until a
buffer changes: int4 in torch's packed int4 layout (fp32 compute: large layers with bf16 activations, small
ones dequantised, see ``kernels.quant_linear``); fp8 dequantised, as CPU torch has no fast fp8 matmul. On
the Triton kernels, int4 is repacked once the same way for the fast W4A16 kernel (``Int4GpuPack``).
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.formats.weights import (
    SCALE_DTYPE,
    dequantize_fp8_weight,
    dequantize_int4,
    quantize_fp8_weight,
    quantize_int4,
)
from gpu_workers.kernels.int4_pack import Int4GpuPack, prepack_int4_gpu
from gpu_workers.kernels.packed_linear import PackedLinear, cpu_packing_available, linear_of
from gpu_workers.kernels.quant_linear import (
    INT4_CPU_KERNEL_MIN_WEIGHTS,
    Int4CpuPack,
    fp8_linear,
    int4_cpu_supported,
    int4_linear,
    int4_linear_cpu,
    prepack_int4_cpu,
    use_cpu_weights,
    use_int4_gpu_pack,
)
from gpu_workers.quant.config import QuantConfig

QuantLinearT = TypeVar("QuantLinearT", bound=nn.Module)


class Fp8Linear(nn.Module):
    """y = x @ (W_fp8 * scale).T + b with e4m3 weights and one fp32 scale per output channel."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bias_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype)) if bias else None
        self._dense = _Prepared()

    def load_dense(self, weight: torch.Tensor) -> None:
        q = quantize_fp8_weight(weight.to(self.weight.device))
        self.weight.copy_(q.weight)
        self.weight_scale.copy_(q.weight_scale)
        self._dense.clear()

    @classmethod
    def concat(cls, layers: list[Fp8Linear]) -> Fp8Linear | None:
        """One layer whose outputs are ``layers``' side by side (their e4m3 codes and per-output-channel
        scales stacked: the same numbers), or None if their inputs differ."""
        first = layers[0]
        if len({m.in_features for m in layers}) != 1:
            return None
        bias = None if first.bias is None else first.bias.dtype
        with torch.device("meta"):
            fused = cls(first.in_features, sum(m.out_features for m in layers), bias is not None, bias)
        return _stacked(fused, layers, ("weight", "weight_scale"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_cpu_weights(x):
            key = (x.dtype, *_identity(self.weight, self.weight_scale, self.bias))
            # forward, not the module call: no hooks to run on a layer of our own, ~2 us a call at batch 1
            return self._dense.get(key, lambda: self._cpu_linear(x.dtype)).forward(x)
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def _cpu_linear(self, dtype: torch.dtype) -> nn.Module:
        """This layer's weight dequantised once into ``dtype``, as a linear: packed for oneDNN where it
        packs (bf16: the same GEMM as ``F.linear``, less work per call), else a plain ``nn.Linear``."""
        linear = linear_of(dequantize_fp8_weight(self.weight, self.weight_scale, dtype), self.bias)
        return PackedLinear(linear) if cpu_packing_available(dtype) else linear


class Int4Linear(nn.Module):
    """y = x @ W.T + b with W = (q - zero) * scale, int4 codes in groups along the input dimension.

    ``minimums`` (GGUF's Q4_1, as the file stores it): W = q * scale + min, no zero points; ``scale_dtype``
    is the scales' (and minimums') stored dtype, float16 for a GGUF's blocks."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        bias_dtype: torch.dtype,
        group_size: int,
        symmetric: bool,
        minimums: bool = False,
        scale_dtype: torch.dtype = SCALE_DTYPE,
    ):
        super().__init__()
        if in_features % 2:
            raise ValueError(f"int4 packs two input columns per byte; in_features {in_features} is odd")
        if symmetric and minimums:
            raise ValueError("an int4 layer is symmetric (zero 8) or has minimums, not both")
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.symmetric, self.minimums = group_size, symmetric, minimums
        groups = -(-in_features // group_size)
        self.register_buffer("weight_packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=scale_dtype))
        self.weight_zero: torch.Tensor | None
        self.weight_min: torch.Tensor | None
        offsets = torch.empty(out_features, groups, dtype=scale_dtype)
        self.register_buffer("weight_zero", None if symmetric or minimums else offsets)
        self.register_buffer("weight_min", offsets if minimums else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype)) if bias else None
        self._cpu_pack = _Prepared()
        # compute dtype -> (the buffers, their versions, the pack or None), see _cpu_pack_for
        self._cpu_memo: dict[torch.dtype, tuple] = {}
        self._gpu_pack = _Prepared()
        self._dense = _Prepared()
        # The size that routes fp32 compute to the int4 kernel: this layer's, or a fused layer's parts'.
        self.kernel_weights = in_features * out_features

    def load_dense(self, weight: torch.Tensor) -> None:
        if self.minimums:
            raise ValueError(
                "an int4 layer with minimums holds a GGUF's Q4_1 blocks as stored; it does not quantise"
            )
        q = quantize_int4(weight.to(self.weight_packed.device), self.group_size, self.symmetric)
        self.weight_packed.copy_(q.weight_packed)
        self.weight_scale.copy_(q.weight_scale)
        if q.weight_zero is not None:
            self.weight_zero.copy_(q.weight_zero)
        self._cpu_pack.clear()
        self._cpu_memo.clear()
        self._gpu_pack.clear()
        self._dense.clear()

    @classmethod
    def concat(cls, layers: list[Int4Linear]) -> Int4Linear | None:
        """One layer whose outputs are ``layers``' side by side (codes, group scales and zero points
        stacked along the output dimension: the same numbers), or None if their inputs or groups differ."""
        first = layers[0]
        if (
            len(
                {(m.in_features, m.group_size, m.symmetric, m.minimums, m.weight_scale.dtype) for m in layers}
            )
            != 1
        ):
            return None
        # Each part must take the CPU path it took alone (the int4 kernel with bf16 activations in fp32
        # compute only for layers of >= 1M weights, and only for a multiple of 16 outputs), or the fused
        # layer would compute some parts differently.
        if len({(m.kernel_weights >= INT4_CPU_KERNEL_MIN_WEIGHTS, m.out_features % 16) for m in layers}) != 1:
            return None
        bias = None if first.bias is None else first.bias.dtype
        out_features = sum(m.out_features for m in layers)
        with torch.device("meta"):
            fused = cls(
                first.in_features,
                out_features,
                bias is not None,
                bias,
                first.group_size,
                first.symmetric,
                first.minimums,
                first.weight_scale.dtype,
            )
        fused.kernel_weights = min(m.kernel_weights for m in layers)
        offsets = ("weight_min",) if first.minimums else () if first.symmetric else ("weight_zero",)
        buffers = ("weight_packed", "weight_scale", *offsets)
        return _stacked(fused, layers, buffers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_cpu_weights(x):
            pack = self._cpu_pack_for(x.dtype)
            if pack is not None:
                return int4_linear_cpu(x, pack, self._parameters.get("bias"))  # None: not a parameter
            if x.dtype == torch.float32:
                key = (x.dtype, *_identity(*self._stored()))
                args = (self.weight_packed, self.weight_scale, self.weight_zero, self.group_size, x.dtype)
                dense = self._dense.get(key, lambda: dequantize_int4(*args, self.weight_min))
                return F.linear(x, dense, self.bias)
        return int4_linear(
            x,
            self.weight_packed,
            self.weight_scale,
            self.weight_zero,
            self.group_size,
            self.bias,
            self.weight_min,
            self.gpu_pack() if use_int4_gpu_pack(x) else None,
        )

    def _stored(self) -> tuple[torch.Tensor | None, ...]:
        buffers = self._buffers  # not four trips through nn.Module.__getattr__: read at every call
        return (
            buffers["weight_packed"],
            buffers["weight_scale"],
            buffers["weight_zero"],
            buffers["weight_min"],
        )

    def _cpu_pack_for(self, dtype: torch.dtype) -> Int4CpuPack | None:
        """The pack torch's int4 kernel runs compute in ``dtype`` on (``cpu_pack`` of its activation dtype),
        or None where that kernel does not serve it. Asked by every call of every decode step: answered from
        a memo per dtype while the stored buffers stay the same (a cold step spent ~12 us of Python a call
        on the question, 1.5 ms of SmolLM2's 15 ms step at one request)."""
        buffers = self._buffers
        packed, scale = buffers["weight_packed"], buffers["weight_scale"]
        offsets = buffers["weight_zero"]
        offsets = buffers["weight_min"] if offsets is None else offsets
        memo = self._cpu_memo.get(dtype)
        # The same buffer objects (the memo holds them: none is freed and its id reused) at the same versions
        if (
            memo is not None
            and memo[0] is packed
            and memo[1] is scale
            and memo[2] is offsets
            and memo[3] == (packed._version, scale._version, None if offsets is None else offsets._version)
        ):
            return memo[4]
        activations = self._cpu_activations(dtype)
        pack = None if activations is None else self.cpu_pack(activations)
        versions = (packed._version, scale._version, None if offsets is None else offsets._version)
        self._cpu_memo[dtype] = (packed, scale, offsets, versions, pack)
        return pack

    def _cpu_activations(self, dtype: torch.dtype) -> torch.dtype | None:
        """The activation dtype this layer runs torch's int4 kernel in for ``dtype`` compute, or None."""
        if dtype == torch.float32:
            if self.kernel_weights < INT4_CPU_KERNEL_MIN_WEIGHTS:
                return None
            dtype = torch.bfloat16
        return dtype if int4_cpu_supported(self.out_features, self.group_size, dtype) else None

    def cpu_pack(self, dtype: torch.dtype) -> Int4CpuPack:
        """This weight in torch's CPU int4 layout for activations in ``dtype``, packed once."""
        key = (dtype, *_identity(*self._stored()))
        return self._cpu_pack.get(
            key,
            lambda: prepack_int4_cpu(
                self.weight_packed,
                self.weight_scale,
                self.weight_zero,
                self.group_size,
                dtype,
                self.weight_min,
            ),
        )

    def gpu_pack(self) -> Int4GpuPack:
        """This weight in the fast W4A16 kernel's layout, packed once on its device (a copy beside the stored
        buffers, as ``cpu_pack``'s is)."""
        return self._gpu_pack.get(
            _identity(*self._stored()),
            lambda: prepack_int4_gpu(
                self.weight_packed, self.weight_scale, self.weight_zero, self.group_size, self.weight_min
            ),
        )


def _stacked(fused: QuantLinearT, layers: list[QuantLinearT], buffers: tuple[str, ...]) -> QuantLinearT:
    """``fused`` (built on the meta device) given ``layers``' named buffers and biases, stacked along the
    output dimension."""
    for name in buffers:
        setattr(fused, name, torch.cat([getattr(m, name) for m in layers]))
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in layers]), requires_grad=False)
    return fused


def _identity(*buffers: torch.Tensor | None) -> tuple[int, ...]:
    """Changes when a buffer is replaced (``.to``, ``to_empty``) or written in place through autograd's
    view of it (``copy_``, ``load_state_dict``); ``load_dense`` clears the cache itself."""
    return tuple([(b.data_ptr(), b._version) for b in buffers if b is not None])


class _Prepared:
    """One derived form of a layer's weights, kept while ``key`` (dtype, buffer versions) stays the same.
    Not a buffer: ``state_dict`` and the checkpoint hold only the stored format."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value = None

    def get(self, key: tuple, make):
        if self._key != key:
            self._value, self._key = make(), key
        return self._value

    def clear(self) -> None:
        self._key = self._value = None


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
