"""Every Triton kernel compiles for a Hopper GPU (sm_90), on the CPU, with the arguments its wrapper passes.

tests/test_kernels.py checks what the kernels compute, under Triton's interpreter; the interpreter runs
the kernel's Python and so accepts code the compiler rejects. The first H200 session found one: the FP8
KV write read a module-level float inside the kernel, which the compiler refuses (a global must be a
``tl.constexpr``), so FP8 KV on a GPU failed at its first write while every CPU test passed. Here each
wrapper runs on CPU tensors with its kernels replaced by recorders; every distinct launch is then compiled
ahead of time down to a cubin (Triton's own ptxas, no driver or GPU needed).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from gpu_workers.formats.weights import quantize_fp8_weight, quantize_int4  # noqa: E402
from gpu_workers.kernels import (  # noqa: E402
    fp8_linear_triton,
    int4_linear_triton,
    kv_write_triton,
    paged_attention_triton,  # noqa: E402
    rms_norm_triton,
    silu_mul_triton,
)
from gpu_workers.kv import AttentionMetadata, KVCache, KVSpec  # noqa: E402
from gpu_workers.model.attention import PagedAttention  # noqa: E402

TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.float8_e4m3fn: "fp8e4nv",
}
MODULES = {
    kv_write_triton: ["_write_kv_kernel", "_write_int8_kernel", "_rotate_write_kernel"],
    rms_norm_triton: ["_add_rms_norm_kernel"],
    silu_mul_triton: ["_silu_mul_kernel"],
    paged_attention_triton: ["_decode_split_kernel", "_merge_splits_kernel"],
    fp8_linear_triton: ["_fp8_gemm_kernel"],
    int4_linear_triton: ["_int4_gemm_kernel", "_int4_fast_gemm_kernel"],
}


class Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


@pytest.fixture
def launches(monkeypatch) -> list:
    """The launches the wrappers make while the test runs, with the compiled paths chosen (not the
    interpreter's fp32 dots)."""
    recorded: list = []
    monkeypatch.setenv("TESSERA_KERNELS", "triton")
    # tests/test_kernels.py sets it for its process (pytest-xdist runs several files in one): the
    # compiler would then generate the interpreter's code and fail on what a GPU compiles.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for module, names in MODULES.items():
        if hasattr(module, "interpreted"):
            monkeypatch.setattr(module, "interpreted", lambda: False)
        for name in names:
            monkeypatch.setattr(module, name, Recorder(getattr(module, name), recorded))
    return recorded


def describe(kernel, args: tuple, kwargs: dict) -> dict:
    """A launch as what the compiler takes: signature, constexprs and options (JSON)."""
    fn = kernel.fn
    names = list(inspect.signature(fn).parameters)
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    values = dict(zip(names, args, strict=False)) | kwargs
    assert set(values) == set(names), f"{fn.__name__}: launched without {set(names) - set(values)}"
    signature, constexprs = {}, {}
    for name in names:
        value = values[name]
        if name in kwargs:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            raise AssertionError(f"{fn.__name__}.{name}: a bool passed as a runtime argument")
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise AssertionError(f"{fn.__name__}.{name}: {type(value).__name__} is no kernel argument")
    return {
        "module": fn.__module__,
        "kernel": fn.__name__,
        "signature": signature,
        "constexprs": constexprs,
        "options": options,
    }


# Run in a fresh interpreter: a process that has run kernels under TRITON_INTERPRET (tests/test_kernels.py,
# in the same pytest-xdist worker) generates code the compiler then rejects.
COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for launch in json.load(sys.stdin):
    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    source = ASTSource(fn, launch["signature"], launch["constexprs"])
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    assert compiled.asm["cubin"], launch["kernel"]
    print(launch["kernel"])
"""


def compile_all(launches: list) -> set[str]:
    """Compile each distinct launch for sm_90 down to a cubin; the kernel names compiled."""
    distinct = {json.dumps(describe(*launch), sort_keys=True) for launch in launches}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE],
        input="[" + ",".join(sorted(distinct)) + "]",
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return set(done.stdout.split())


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_write_and_paged_attention_compile_for_hopper(launches, kv_dtype, dtype):
    # A step with decode rows and a prefill chunk, written and attended through a real cache, as a layer
    # calls it; sliding windows too.
    if dtype == torch.float32 and kv_dtype == torch.bfloat16:
        kv_dtype = torch.float32
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64)
    cache = KVCache(spec, num_pages=8, page_size=16, dtype=kv_dtype, device="cpu")
    meta = AttentionMetadata.build([[0, 1], [2], [3, 4]], [20, 5, 17], [1, 5, 1], 16)
    tokens = meta.num_tokens
    q = torch.randn(tokens, 8, 64, dtype=dtype)
    k, v = torch.randn(tokens, 2, 64, dtype=dtype), torch.randn(tokens, 2, 64, dtype=dtype)
    for window in (None, 8):
        PagedAttention(cache, meta)(0, q, k, v, scale=0.125, sliding_window=window)
    write = "_write_int8_kernel" if kv_dtype == torch.int8 else "_write_kv_kernel"
    assert compile_all(launches) == {write, "_decode_split_kernel", "_merge_splits_kernel"}


def test_decode_attention_compiles_for_every_tile_shape(launches):
    # Page size 16 (above) is one tile per page; pages narrower than a tile (each position's page and scales)
    # and pages of several tiles (the tile's offset in its page) are other code, with a window, per format.
    q = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    lens = torch.tensor([20, 5], dtype=torch.int32)
    for page_size in (4, 64):
        slots, tables = 4 * 64, torch.zeros(2, 64 // page_size, dtype=torch.int32)
        scales = torch.ones(slots // page_size)
        for k in (
            torch.zeros(slots, 2, 64, dtype=torch.bfloat16),
            torch.zeros(slots, 2, 64, dtype=torch.uint8),
            torch.zeros(slots, 2, 66, dtype=torch.int8),
        ):
            fp8 = (scales, scales) if k.dtype == torch.uint8 else (None, None)
            paged_attention_triton.paged_decode_attention_triton(
                q, k, k, tables, lens, page_size, 0.125, 8, *fp8
            )
    assert compile_all(launches) == {"_decode_split_kernel", "_merge_splits_kernel"}


def test_fused_decode_layer_kernels_compile_for_hopper(launches):
    # add + RMSNorm with and without a residual; SiLU x up; q/k/v rotated and written for BF16 and INT8 (Hadamard)
    # caches, from bf16 (what a GPU engine computes in) and fp32, a head size that is not a power of two.
    for dtype, kv_dtype, head_dim in [
        (torch.bfloat16, torch.bfloat16, 64),
        (torch.bfloat16, torch.int8, 96),
        (torch.float32, torch.float32, 64),
    ]:
        x = torch.randn(3, 320, dtype=dtype)
        weight = torch.ones(320, dtype=dtype)
        rms_norm_triton.add_rms_norm_triton(x, None, weight, 1e-6)
        rms_norm_triton.add_rms_norm_triton(x, x, weight, 1e-6)
        silu_mul_triton.silu_mul_triton(torch.randn(3, 2 * 200, dtype=dtype))
        spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=head_dim)
        cache = KVCache(spec, num_pages=8, page_size=16, dtype=kv_dtype, device="cpu")
        meta = AttentionMetadata.build([[0, 1], [2]], [20, 5], [1, 1], 16)
        qkv = torch.randn(2, 12 * head_dim, dtype=dtype)
        cos, sin = torch.randn(2, head_dim, dtype=dtype), torch.randn(2, head_dim, dtype=dtype)
        PagedAttention(cache, meta).rotate_and_attend(0, qkv, cos, sin, 8, 2, 0.125)
    assert compile_all(launches) == {
        "_add_rms_norm_kernel",
        "_silu_mul_kernel",
        "_rotate_write_kernel",
        "_decode_split_kernel",
        "_merge_splits_kernel",
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_gemms_compile_for_hopper(launches, dtype):
    w = torch.randn(96, 256)
    f8 = quantize_fp8_weight(w)
    for symmetric in (False, True):
        i4 = quantize_int4(w, 128, symmetric)
        # Each row-tile size of both kernels in bf16 (what a GPU engine computes in); fp32's dots (another
        # code path, tf32 off) at one size, to keep the compiles CI pays for few.
        for m in (1, 24, 40, 80) if dtype == torch.bfloat16 else (1,):
            x = torch.randn(m, 256, dtype=dtype)
            bias = torch.randn(96, dtype=dtype) if symmetric else None
            fp8_linear_triton.fp8_linear_triton(x, f8.weight, f8.weight_scale, bias)
            int4_linear_triton.int4_linear_triton(
                x, i4.weight_packed, i4.weight_scale, i4.weight_zero, 128, bias
            )
    i4 = quantize_int4(w, 32)  # GGUF's Q4_1: float16 scales and minimums
    int4_linear_triton.int4_linear_triton(
        torch.randn(1, 256, dtype=dtype),
        i4.weight_packed,
        i4.weight_scale.half(),
        None,
        32,
        weight_min=i4.weight_zero.half(),
    )
    i4 = quantize_int4(w, 48)  # groups narrower than a K step: per-column scales
    int4_linear_triton.int4_linear_triton(
        torch.randn(1, 256, dtype=dtype), i4.weight_packed, i4.weight_scale, i4.weight_zero, 48
    )
    assert compile_all(launches) == {"_fp8_gemm_kernel", "_int4_gemm_kernel"}


def test_fast_int4_gemm_compiles_for_hopper(launches):
    # bf16 (what a GPU engine computes in) at each row-tile size, with zero points and bias and symmetric;
    # fp16's codes and fp32's dequantised tile at one size; GGUF's minimums; K steps of 128, 32 and 16.
    w = torch.randn(96, 256)
    for symmetric in (False, True):
        i4 = quantize_int4(w, 128, symmetric)
        bias = None if symmetric else torch.randn(96, dtype=torch.bfloat16)
        for m in (1, 24, 40, 80):
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            int4_linear_triton.int4_linear_fast_triton(
                x, i4.weight_packed, i4.weight_scale, i4.weight_zero, 128, bias
            )
    for dtype in (torch.float16, torch.float32):
        int4_linear_triton.int4_linear_fast_triton(
            torch.randn(1, 256, dtype=dtype), i4.weight_packed, i4.weight_scale, None, 128
        )
    i4 = quantize_int4(w, 32)
    for dtype in (torch.bfloat16, torch.float32):
        int4_linear_triton.int4_linear_fast_triton(
            torch.randn(1, 256, dtype=dtype),
            i4.weight_packed,
            i4.weight_scale.half(),
            None,
            32,
            weight_min=i4.weight_zero.half(),
        )
    i4 = quantize_int4(w, 48)
    int4_linear_triton.int4_linear_fast_triton(
        torch.randn(1, 256, dtype=torch.bfloat16), i4.weight_packed, i4.weight_scale, i4.weight_zero, 48
    )
    assert compile_all(launches) == {"_int4_fast_gemm_kernel"}
