"""Kernel benchmarks: weight GEMV/GEMM per weight format and batch, paged decode attention per KV format and
context length, as time, achieved memory bandwidth and speedup over BF16.

On CUDA the Triton kernels run (timed with ``triton.testing.do_bench``); elsewhere the torch references
run instead, timed by wall clock, and the rows say so.
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
from gpu_workers.kernels.paged_attention import paged_decode_attention
from gpu_workers.kernels.quant_linear import fp8_linear, int4_linear

# Published HBM bandwidth, GB/s, by a substring of torch.cuda.get_device_name().
PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0, "L4": 300.0}


@dataclass
class GemmRow:
    k: int
    n: int
    batch: int
    weights: str  # bf16 | fp8 | int4
    ms: float
    gbs: float  # bytes moved (weights as stored + activations in and out) per second
    speedup: float  # over bf16 at the same shape and batch


@dataclass
class AttentionRow:
    batch: int
    context: int
    kv: str  # bf16 | fp8_e4m3
    ms: float
    gbs: float  # KV bytes read (with page scales) + q + out per second
    speedup: float  # over bf16 KV at the same batch and context


def backend(device: torch.device) -> str:
    return "triton" if use_triton(device) else "torch reference"


def peak_gbs(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gbs for key, gbs in PEAK_GBS.items() if key in name), None)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100)
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bench_gemm(
    k: int, n: int, batches: list[int], device: torch.device, group_size: int = 128, repeats: int = 5
) -> list[GemmRow]:
    """x [batch, k] @ W.T for W [n, k] in bf16 (torch), fp8 and int4 (kernels or references)."""
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
    rows = []
    for batch in batches:
        x = (torch.randn(batch, k, generator=gen)).to(device, torch.bfloat16)
        runs = {
            "bf16": lambda x=x: F.linear(x, w_bf16),
            "fp8": lambda x=x: fp8_linear(x, f8.weight, f8.weight_scale),
            "int4": lambda x=x: int4_linear(x, i4.weight_packed, i4.weight_scale, i4.weight_zero, group_size),
        }
        times = {fmt: time_ms(fn, device, repeats) for fmt, fn in runs.items()}
        for fmt, ms in times.items():
            moved = weight_bytes[fmt] + 2 * batch * (k + n)
            rows.append(GemmRow(k, n, batch, fmt, ms, moved / ms / 1e6, times["bf16"] / ms))
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
        for fmt, ms in times.items():
            moved = (
                kv_elements * (2 if fmt == "bf16" else 1) + io + (0 if fmt == "bf16" else 2 * 4 * num_pages)
            )
            rows.append(AttentionRow(batch, context, fmt, ms, moved / ms / 1e6, times["bf16"] / ms))
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
) -> dict[str, float]:
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
    return {
        "bf16": time_ms(
            lambda: paged_decode_attention(q, k, v, block_tables, seq_lens, page_size, scale), device, repeats
        ),
        "fp8_e4m3": time_ms(
            lambda: paged_decode_attention(
                q, k8, v8, block_tables, seq_lens, page_size, scale, None, page_scale, page_scale
            ),
            device,
            repeats,
        ),
    }
