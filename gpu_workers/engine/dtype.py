"""The compute dtype an engine runs in: ``dtype="auto"`` resolves to bf16 where bf16 is fast, else fp32.

CUDA runs bf16. A CPU without bf16 matrix units (AMX, AVX512-BF16) multiplies bf16 several times slower
than fp32, so there a bf16 checkpoint is upcast at load and computed in fp32. Which case a CPU is in is
measured once per process: a small matmul timed in both dtypes, interleaved, best of a few rounds.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# bf16 counts as fast when it is at most this much slower than fp32 (it halves weight and KV bytes).
BF16_TOLERANCE = 1.25
_PROBE_SHAPE = (64, 256, 704)  # [M, K] x [K, N]: the scale of the decode GEMMs this matters for


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # a key of DTYPES
    reason: str  # why, for stats and the worker log

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.name]


def resolve_dtype(requested: str, device: str) -> DtypeChoice:
    """``requested`` as given, or for "auto" the fastest of bf16 and fp32 on ``device``."""
    if requested != "auto":
        return DtypeChoice(requested, "requested")
    if torch.device(device).type != "cpu":
        return DtypeChoice("bfloat16", f"auto: bf16 on {torch.device(device).type}")
    ratio = cpu_bf16_slowdown()
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
