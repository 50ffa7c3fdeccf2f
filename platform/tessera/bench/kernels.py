"""``tessera bench kernels``: weight GEMV/GEMM per weight format and paged decode attention per KV format.

The timings come from ``gpu_workers.tools.kernel_bench``; this prints them against the memory bandwidth.
On a CUDA device the Triton kernels run; without one the torch references run, and the output says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict

DEFAULT_SHAPES = [(4096, 4096), (4096, 14336)]


def run_kernels(
    batches: list[int],
    shapes: list[tuple[int, int]] | None,
    contexts: list[int] | None,
    attn_batch: int | None,
    peak_gbs: float | None,
    device: str | None,
    threads: int | None,
    as_json: bool,
) -> None:
    """Unset arguments take defaults for the device: shapes, contexts and batch (GPU or CPU), the peak
    bandwidth (the device's, if known), the device (cuda when available) and torch's CPU threads."""
    import torch

    from gpu_workers.tools import kernel_bench as bench

    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    shapes = shapes or DEFAULT_SHAPES
    contexts = contexts or ([1024, 4096, 16384] if gpu else [256, 1024])
    attn_batch = attn_batch or (16 if gpu else 2)
    peak = peak_gbs or bench.peak_gbs(device)
    name = torch.cuda.get_device_name(device) if gpu else "CPU"
    gemm = [row for k, n in shapes for row in bench.bench_gemm(k, n, batches, device)]
    attention = bench.bench_attention(contexts, attn_batch, device)
    if as_json:
        body = {
            "device": name,
            "backend": bench.backend(device),
            "peak_gbs": peak,
            "gemm": [asdict(r) for r in gemm],
            "attention": [asdict(r) for r in attention],
        }
        print(json.dumps(body, indent=2))
        return
    print(f"device: {name}; backend: {bench.backend(device)}")
    if not gpu:
        print("no CUDA device: these are the torch reference paths on CPU, not the Triton kernels")
    print(f"peak memory bandwidth: {f'{peak:,.0f} GB/s' if peak else 'unknown (--peak-gbs)'}")
    print()
    if gpu:
        print("ms: replayed from a CUDA graph (the kernels' own time); eager ms: launched from Python")
    print(
        f"{'K x N':<13}{'batch':>6}{'weights':>11}{'ms':>10}{'GB/s':>10}{'% peak':>8}{'vs bf16':>9}{'eager ms':>10}"
    )
    for r in gemm:
        print(
            f"{f'{r.k}x{r.n}':<13}{r.batch:>6}{r.weights:>11}{r.ms:>10.4f}{r.gbs:>10.3g}"
            f"{_percent(r.gbs, peak):>8}{r.speedup:>8.2f}x{_ms(r.eager_ms):>10}"
        )
    print()
    print(f"paged decode attention, 32 query / 8 KV heads x 128, page 16, batch {attn_batch}")
    print(f"{'context':<9}{'KV':>10}{'ms':>10}{'GB/s':>10}{'% peak':>8}{'vs bf16':>9}{'eager ms':>10}")
    for r in attention:
        print(
            f"{r.context:<9}{r.kv:>10}{r.ms:>10.4f}{r.gbs:>10.3g}{_percent(r.gbs, peak):>8}{r.speedup:>8.2f}x"
            f"{_ms(r.eager_ms):>10}"
        )


def _ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.4f}"


def _percent(gbs: float, peak: float | None) -> str:
    return f"{100 * gbs / peak:.0f}%" if peak else "-"
