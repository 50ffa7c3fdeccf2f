"""This tree's CPU paged decode attention against another tree's, side by side in one process.

    git archive <rev> | tar -x -C /tmp/base && python scripts/ab_decode_attention.py /tmp/base 4 2 32

Arguments: the other tree, query heads, KV heads, rows. One layer, head_dim 64, pages of 16, contexts of
100-259 positions on shuffled pages, in FP8 (normal e4m3 values), fp32 and BF16 KV. The two kernels must
agree to the last bits (the share that differs is printed); then 15 rounds of 20 calls each, alternating,
and per round this tree's time over the other's.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from gpu_workers.kernels import paged_attention_cpu as this


def drop_numba_cache(path: Path) -> None:
    """Numba cannot load its disk cache of a module imported from a path (it was compiled as '<dynamic>'),
    and the other tree cannot load what such an import writes there: drop the kernel's cache before the run
    and after it."""
    for cached in path.parent.glob("__pycache__/paged_attention_cpu.*.nb[ic]"):
        cached.unlink()


def main(base_tree: str, heads: int, kv_heads: int, rows: int) -> None:
    path = Path(base_tree) / "gpu_workers/kernels/paged_attention_cpu.py"
    drop_numba_cache(path)
    try:
        compare(path, heads, kv_heads, rows)
    finally:
        drop_numba_cache(path)


def compare(path: Path, heads: int, kv_heads: int, rows: int) -> None:
    spec = importlib.util.spec_from_file_location("base_paged_attention_cpu", path)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dim, page_size = 64, 16
    lens = torch.randint(100, 260, (rows,), dtype=torch.int32)
    width = int(((lens + page_size - 1) // page_size).max())
    pages = rows * width + 8
    tables = torch.randperm(pages)[: rows * width].view(rows, width).to(torch.int32)
    q = torch.randn(rows, heads, dim)
    shape = (pages * page_size, kv_heads, dim)
    for name in ("fp8", "fp32", "bf16"):
        if name == "fp8":
            # e4m3 of normal values, as a page quantised to its amax holds them: random bytes would make one
            # in 16 an e4m3 subnormal, a float32 denormal once widened, and on Intel CPUs each product with
            # one takes a microcode assist (7-10x the whole kernel's time), which real pages rarely meet
            k, v = (torch.randn(shape).mul(64).to(torch.float8_e4m3fn).view(torch.uint8) for _ in range(2))
            # codes of about 64 times the values (a page's amax maps to 448), so scores stay in a real
            # model's range: a softmax peaked far beyond that gives probabilities whose products with the
            # values underflow to denormals in the V sums, which (on Intel) dominate the time again
            scales = {"k_scale": (torch.rand(pages) + 0.5) / 64, "v_scale": (torch.rand(pages) + 0.5) / 64}
        else:
            dtype = torch.float32 if name == "fp32" else torch.bfloat16
            k, v = (torch.randn(shape).to(dtype) for _ in range(2))
            scales = {}

        def call(module, k=k, v=v, scales=scales):
            return module.paged_decode_attention_cpu(q, k, v, tables, lens, page_size, 0.125, **scales)

        ours, other = call(this), call(base)
        differ = float((ours != other).float().mean())
        if differ:  # fastmath may contract differently per code shape: a last-bit difference, no more
            torch.testing.assert_close(ours, other, rtol=2**-20, atol=2**-20 * float(other.abs().max()))
        times: dict[str, list[float]] = {"base": [], "this": []}
        for _ in range(15):
            for label, module in (("base", base), ("this", this)):
                start = time.perf_counter()
                for _ in range(20):
                    call(module)
                times[label].append((time.perf_counter() - start) / 20 * 1e6)
        ratios = sorted(a / b for a, b in zip(times["this"], times["base"], strict=True))
        print(
            f"{name} {heads}q/{kv_heads}kv {rows} rows: other {statistics.median(times['base']):.0f} us, "
            f"this {statistics.median(times['this']):.0f} us, this/other {statistics.median(ratios):.2f} "
            f"[{ratios[2]:.2f}, {ratios[-3]:.2f}] "
            + (f"({differ:.2%} of outputs differ in their last bits)" if differ else "(same bits)")
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
