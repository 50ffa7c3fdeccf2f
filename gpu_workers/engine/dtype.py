"""The compute dtype an engine runs in: ``dtype="auto"`` resolves to bf16 where bf16 is fast, else fp32.

CUDA runs bf16. A CPU without bf16 matrix instructions multiplies bf16 several times slower than fp32
(oneDNN emulates it), so there a bf16 checkpoint is upcast at load and computed in fp32. On x86 the CPU's
own feature flags say which case it is in (AVX512-BF16 or AMX-BF16: a bf16 matmul took 0.3-0.45x fp32's
time on three such VMs; without them 4.5-10x), so every process on a host decides alike whatever else
the host is doing. Elsewhere a small matmul is timed in both dtypes, once per process.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# bf16 counts as fast when it is at most this much slower than fp32 (it halves weight and KV bytes).
BF16_TOLERANCE = 1.25
_PROBE_SHAPE = (64, 256, 704)  # [M, K] x [K, N]: the scale of the decode GEMMs this matters for
_X86_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # the instructions oneDNN's fast bf16 GEMMs need


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # a key of DTYPES
    reason: str  # why, for stats and the worker log

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.name]


def resolve_dtype(requested: str, device: str) -> DtypeChoice:
    """``requested`` as given, or for "auto" the faster of bf16 and fp32 on ``device``."""
    if requested != "auto":
        return DtypeChoice(requested, "requested")
    if torch.device(device).type != "cpu":
        return DtypeChoice("bfloat16", f"auto: bf16 on {torch.device(device).type}")
    return cpu_dtype(torch.cpu.get_capabilities(), cpu_bf16_slowdown)


def cpu_dtype(capabilities: Mapping[str, object], measure: Callable[[], float]) -> DtypeChoice:
    """bf16 or fp32 for a CPU with these ``torch.cpu.get_capabilities()``: from its flags on x86, where a
    timing would depend on the load of the moment (two workers of one deployment starting together once
    chose different dtypes, and so different greedy outputs), else from ``measure()`` (bf16's slowdown)."""
    if capabilities.get("architecture") in ("x86_64", "x86"):
        present = [flag for flag in _X86_BF16_FLAGS if capabilities.get(flag)]
        if present:
            return DtypeChoice(
                "bfloat16", f"auto: this CPU has {' and '.join(present)} (bf16 matrix instructions)"
            )
        return DtypeChoice(
            "float32",
            "auto: this CPU has neither amx_bf16 nor avx512_bf16, so bf16 matmuls are emulated (several times "
            "slower than fp32) and weights are upcast",
        )
    ratio = measure()
    if ratio <= BF16_TOLERANCE:
        return DtypeChoice("bfloat16", f"auto: a bf16 matmul takes {ratio:.2f}x fp32's time on this CPU")
    return DtypeChoice(
        "float32", f"auto: a bf16 matmul takes {ratio:.1f}x fp32's time on this CPU, so weights are upcast"
    )


@functools.cache
def cpu_bf16_slowdown(rounds: int = 5) -> float:
    """How many times longer a bf16 matmul takes than the same fp32 one on this CPU (best of ``rounds``)."""
    m, k, n = _PROBE_SHAPE
    a, b = torch.randn(m, k), torch.randn(k, n)
    operands = {dtype: (a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(operands, float("inf"))
    with torch.inference_mode():
        for x, y in operands.values():
            torch.mm(x, y)  # first call of a dtype pays one-off dispatch and allocation costs
        for _ in range(rounds):
            for dtype, (x, y) in operands.items():
                start = time.perf_counter()
                for _ in range(4):
                    torch.mm(x, y)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.bfloat16] / best[torch.float32]
