"""Kernel benchmarks: weight GEMV/GEMM per weight format and batch, paged decode attention per KV format and
context length, as time, achieved memory bandwidth and speedup over BF16.

On CUDA the Triton kernels run, each timed twice: a CUDA graph of calls over rotated copies of the
operands, replayed (``time_ms``: the kernels' own time with operands from HBM, what a decode step captured
in a graph pays), and one call launched from Python (``triton.testing.do_bench``: what an eager step pays,
launch overhead included, which for a batch-1 GEMV can exceed the kernel). Elsewhere the torch references run, timed by wall clock, and the
rows say so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_workers.formats.fp8 import quantize_fp8
from gpu_workers.formats.weights import quantize_fp8_weight, quantize_int4
from gpu_workers.kernels import use_triton
from gpu_workers.kernels.int4_pack import prepack_int4_gpu
from gpu_workers.kernels.paged_attention import paged_decode_attention
from gpu_workers.kernels.quant_linear import fp8_linear, int4_linear

# Published HBM bandwidth, GB/s, by a substring of torch.cuda.get_device_name().
PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0, "L4": 300.0}


@dataclass
class GemmRow:
    k: int
    n: int
    batch: int
    weights: str  # bf16 | fp8 | int4 | int4-fast (the W4A16 kernels: quant_linear.int4_linear)
    ms: float  # CUDA graph replay on a GPU; wall clock elsewhere
    gbs: float  # bytes moved (weights as stored + activations in and out) per second
    speedup: float  # over bf16 at the same shape and batch
    eager_ms: float | None  # launched from Python, on a GPU


@dataclass
class AttentionRow:
    batch: int
    context: int
    kv: str  # bf16 | fp8_e4m3
    ms: float  # CUDA graph replay on a GPU; wall clock elsewhere
    gbs: float  # KV bytes read (with page scales) + q + out per second
    speedup: float  # over bf16 KV at the same batch and context
    eager_ms: float | None  # launched from Python, on a GPU


def backend(device: torch.device) -> str:
    return "triton" if use_triton(device) else "torch reference"


def peak_gbs(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gbs for key, gbs in PEAK_GBS.items() if key in name), None)


# Operands rotated through a captured graph add up to at least this many bytes, about twice an H100's or
# H200's 50-60 MB L2: each call then reads its weights or KV from HBM, as a model's layers do.
ROTATE_BYTES = 128 * 2**20


def rotated(tensors: tuple[torch.Tensor, ...], device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """``tensors`` and enough copies of them that a graph rotating through all reads ``ROTATE_BYTES`` (at
    most 32 copies; only the originals off the GPU)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    count = min(32, -(-ROTATE_BYTES // nbytes)) if device.type == "cuda" else 1
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(count - 1)]


def time_ms(
    calls: list[Callable[[], object]], device: torch.device, repeats: int, eager: bool = True
) -> tuple[float, float | None]:
    """(ms, eager_ms) of one call. ``calls`` run the same kernel on distinct copies of its operands.

    On CUDA: ms is a CUDA graph of all the calls replayed, per call (no launch overhead, operands from
    HBM); eager_ms is ``do_bench`` of the first (launched from Python, L2 flushed between calls). A call
    that cannot be captured keeps its eager time. Elsewhere: the first call's median wall clock over
    ``repeats``, and None. ``eager=False`` skips the eager timing (None in its place)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        eager_ms = do_bench(calls[0], warmup=25, rep=100) if eager else None
        try:
            replayed = _graph_ms(calls, repeats=max(repeats, 20))
        except RuntimeError as exc:  # a call that syncs with the host cannot be captured
            if eager_ms is None:
                raise
            print(f"not capturable, eager time kept: {exc}")
            replayed = eager_ms
        return replayed, eager_ms
    calls[0]()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        calls[0]()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), None


def _graph_ms(calls: list[Callable[[], object]], repeats: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture, as torch's graph docs ask
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / len(calls))
    return statistics.median(samples)


def bench_gemm(
    k: int, n: int, batches: list[int], device: torch.device, group_size: int = 128, repeats: int = 5
) -> list[GemmRow]:
    """x [batch, k] @ W.T for W [n, k] in bf16 (torch), fp8 and int4 (kernels or references). int4 runs the
    convert W4A16 kernel, int4-fast the fast one on weights packed for it beforehand (as a layer packs
    them once); off a GPU both are the reference."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(device)
    w_bf16 = w.to(torch.bfloat16)
    f8 = quantize_fp8_weight(w)
    i4 = quantize_int4(w, group_size)
    weight_bytes = {
        "bf16": w_bf16.numel() * 2,
        "fp8": f8.weight.numel() + f8.weight_scale.numel() * 4,
        "int4": i4.weight_packed.numel() + (i4.weight_scale.numel() + i4.weight_zero.numel()) * 2,
    }
    stored = {
        "bf16": (w_bf16,),
        "fp8": (f8.weight, f8.weight_scale),
        "int4": (i4.weight_packed, i4.weight_scale, i4.weight_zero),
    }
    copies = {fmt: rotated(tensors, device) for fmt, tensors in stored.items()}
    copies["int4-fast"] = [(*c, prepack_int4_gpu(*c, group_size)) for c in copies["int4"]]
    weight_bytes["int4-fast"] = copies["int4-fast"][0][-1].nbytes
    kernels = {
        "bf16": lambda x, w: F.linear(x, w),
        "fp8": lambda x, w, scale: fp8_linear(x, w, scale),
        "int4": lambda x, w, scale, zero: int4_linear(x, w, scale, zero, group_size),
        "int4-fast": lambda x, w, scale, zero, pack: int4_linear(x, w, scale, zero, group_size, pack=pack),
    }
    rows = []
    for batch in batches:
        x = (torch.randn(batch, k, generator=gen)).to(device, torch.bfloat16)
        times = {
            fmt: time_ms([lambda x=x, c=c, f=kernels[fmt]: f(x, *c) for c in copies[fmt]], device, repeats)
            for fmt in kernels
        }
        for fmt, (ms, eager) in times.items():
            moved = weight_bytes[fmt] + 2 * batch * (k + n)
            rows.append(GemmRow(k, n, batch, fmt, ms, moved / ms / 1e6, times["bf16"][0] / ms, eager))
    return rows


def bench_attention(
    contexts: list[int],
    batch: int,
    device: torch.device,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    repeats: int = 5,
) -> list[AttentionRow]:
    """One decode step of ``batch`` sequences of each context length, BF16 vs FP8 KV pages (shuffled pages)."""
    rows = []
    for context in contexts:
        times = _attention_times(context, batch, device, heads, kv_heads, head_dim, page_size, repeats)
        num_pages = batch * -(-context // page_size)
        kv_elements = 2 * batch * context * kv_heads * head_dim
        io = 2 * 2 * batch * heads * head_dim
        for fmt, (ms, eager) in times.items():
            moved = (
                kv_elements * (2 if fmt == "bf16" else 1) + io + (0 if fmt == "bf16" else 2 * 4 * num_pages)
            )
            rows.append(AttentionRow(batch, context, fmt, ms, moved / ms / 1e6, times["bf16"][0] / ms, eager))
    return rows


def _attention_times(
    context: int,
    batch: int,
    device: torch.device,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    repeats: int,
) -> dict[str, tuple[float, float | None]]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    block_tables = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq).to(device, torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(device, torch.bfloat16)
    shape = (num_pages * page_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
    page_scale = torch.full((num_pages,), 4.0 / 448, device=device)
    slot_scale = page_scale.repeat_interleave(page_size)[:, None, None]
    k8, v8 = quantize_fp8(k, slot_scale), quantize_fp8(v, slot_scale)
    scale = head_dim**-0.5
    caches = {"bf16": (k, v), "fp8_e4m3": (k8, v8)}
    times = {}
    for fmt, (k_pages, v_pages) in caches.items():
        pairs = rotated((k_pages, v_pages), device)
        scales = (None, None) if fmt == "bf16" else (page_scale, page_scale)
        calls = [
            lambda kp=kp, vp=vp, scales=scales: paged_decode_attention(
                q, kp, vp, block_tables, seq_lens, page_size, scale, None, *scales
            )
            for kp, vp in pairs
        ]
        times[fmt] = time_ms(calls, device, repeats)
        del pairs, calls
    return times
