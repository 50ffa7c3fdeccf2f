"""What batch-invariant execution costs a linear: one row vs the same row padded to 16 rows (PaddedLinears), on
SmolLM2's float32 shapes, the median of 3 blocked runs each.

    OMP_NUM_THREADS=2 python scripts/batch_invariance_cost.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from gpu_workers.engine.invariance import PaddedLinears

SHAPES = [(576, 1728), (576, 3072), (1536, 576), (576, 49152)]  # in x out: fused q/k/v, gate/up, down, output


def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def padded(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with PaddedLinears():
        return F.linear(x, w)


def median_of_3(f, x: torch.Tensor, w: torch.Tensor) -> float:
    runs = [
        Timer("f(x, w)", globals={"f": f, "x": x, "w": w}).blocked_autorange(min_run_time=0.3).median
        for _ in range(3)
    ]
    return sorted(runs)[1]


def main() -> None:
    torch.manual_seed(0)
    for k, n in SHAPES:
        w, x = torch.randn(n, k), torch.randn(1, k)
        a, b = median_of_3(plain, x, w), median_of_3(padded, x, w)
        print(f"{k}x{n}: 1 row {a * 1e6:.0f} us, padded to 16 {b * 1e6:.0f} us, x{b / a:.2f}")


if __name__ == "__main__":
    main()
