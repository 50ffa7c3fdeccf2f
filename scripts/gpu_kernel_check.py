"""The Triton kernels against their torch references, compiled on a CUDA device (the GPU session's stage b).

tests/test_kernels.py proves the same equalities under Triton's CPU interpreter; this runs them on CUDA
tensors, at its small shapes and at serving shapes, then an engine's greedy tokens on the kernels against
the same engine on the references (int4 and fp8 weights, bf16 and fp8 KV). One JSON record per check;
exit status 1 if any fails. ``--smoke`` runs the fp32 cases on the CPU under the interpreter instead.

    python scripts/gpu_kernel_check.py --json OUT/kernel_check.json [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import torch  # noqa: E402

from gpu_workers import Engine, EngineConfig, SamplingParams  # noqa: E402
from gpu_workers.formats.fp8 import quantize_fp8  # noqa: E402
from gpu_workers.formats.weights import quantize_fp8_weight, quantize_int4  # noqa: E402
from gpu_workers.kernels import KERNELS_ENV  # noqa: E402
from gpu_workers.kernels.fp8_linear_triton import fp8_linear_triton  # noqa: E402
from gpu_workers.kernels.int4_linear_triton import int4_linear_fast_triton, int4_linear_triton  # noqa: E402
from gpu_workers.kernels.kv_write import write_kv_reference  # noqa: E402
from gpu_workers.kernels.kv_write_triton import write_kv_triton  # noqa: E402
from gpu_workers.kernels.paged_attention import paged_decode_attention_reference  # noqa: E402
from gpu_workers.kernels.paged_attention_triton import paged_decode_attention_triton  # noqa: E402
from gpu_workers.kernels.quant_linear import fp8_linear_reference, int4_linear_reference  # noqa: E402
from gpu_workers.kernels.silu_mul import silu_mul_reference  # noqa: E402
from gpu_workers.kernels.silu_mul_triton import silu_mul_triton  # noqa: E402
from gpu_workers.tools.demo_checkpoint import write_demo_checkpoint  # noqa: E402
from gpu_workers.tools.quantize import quantize_checkpoint  # noqa: E402

# Relative to the output's largest value: fp32 products summed in another order; bf16 activations round
# the dequantised weight (reference) or only the output (kernel) to bf16.
FP32_TOL, BF16_TOL = 1e-4, 2**-7
# (rows, out features, in features, group): tests/test_kernels.py's shapes, then decode GEMV/GEMM at serving
# shapes (W4A16 at batch 1, 8, 32 on 4096x4096 and 4096x14336).
GEMM_SHAPES = [(1, 96, 256, 128), (5, 40, 200, 64), (37, 72, 160, 32)]
SERVING_GEMM = [(m, n, 4096, 128) for n in (4096, 14336) for m in (1, 8, 32)]
# (heads, kv heads, head dim, page size, window, sequence lengths)
ATTENTION = [
    (4, 2, 32, 4, None, [1, 13, 150]),
    (8, 2, 24, 16, None, [1, 13, 150]),
    (4, 4, 16, 8, 7, [1, 13, 150]),
]
SERVING_ATTENTION = [(32, 8, 128, 16, None, [1, 300, 4096, 16384])]
# (rows, intermediate size) of SiLU x up: a ragged last block; then SmolLM2's, a 1B Llama's and an 8B's widths
SILU = [(3, 1100)]
SERVING_SILU = [(1, 1536), (32, 8192), (64, 14336)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True, help="write the checks here")
    p.add_argument(
        "--smoke", action="store_true", help="CPU, Triton's interpreter, fp32 cases at small shapes"
    )
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device (torch {torch.__version__}); --smoke runs the interpreter on CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtypes = [torch.float32] if args.smoke else [torch.float32, torch.bfloat16]
    checks: list[dict] = []

    def record(name: str, fn, *fn_args) -> None:
        start = time.perf_counter()
        try:
            result = fn(*fn_args)
        except Exception as exc:  # a kernel that fails to compile or launch is a failed check, not a crash
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result |= {"check": name, "seconds": round(time.perf_counter() - start, 3)}
        checks.append(result)
        print(json.dumps(result), flush=True)

    for m, n, k, group in GEMM_SHAPES + ([] if args.smoke else SERVING_GEMM):
        for dtype in dtypes:
            for symmetric in (False, True):
                for kernel in (int4_linear_triton, int4_linear_fast_triton):
                    fast = " fast" if kernel is int4_linear_fast_triton else ""
                    name = f"int4{fast} gemm {m}x{n}x{k} g{group} {dtype} {'sym' if symmetric else 'asym'}"
                    record(name, _int4_gemm, kernel, m, n, k, group, symmetric, dtype, device)
            record(f"fp8 gemm {m}x{n}x{k} {dtype}", _fp8_gemm, m, n, k, dtype, device)
    for case in ATTENTION + ([] if args.smoke else SERVING_ATTENTION):
        for kv in ("bf16", "fp8_e4m3"):
            for dtype in dtypes:
                name = f"paged decode {case[:5]} lens {case[5]} {kv} KV, {dtype} q"
                record(name, _decode, *case, kv, dtype, device)
    for rows, inter in SILU + ([] if args.smoke else SERVING_SILU):
        for dtype in dtypes:
            record(f"silu x up {rows}x{inter} {dtype}", _silu_mul, rows, inter, dtype, device)
    record("kv write bf16", _kv_write, False, device)
    if (
        not args.smoke
    ):  # the interpreter's fp32->fp8 cast drops a carry (tests/test_kernels.py); CUDA's does not
        record("kv write fp8", _kv_write, True, device)
    with tempfile.TemporaryDirectory() as tmp:
        write_demo_checkpoint(
            Path(tmp) / "src", hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=512
        )
        for weights in ("int4",) if args.smoke else ("int4", "fp8"):
            quantize_checkpoint(Path(tmp) / "src", Path(tmp) / weights, weights, group_size=64)
            for kv in ("bf16", "fp8_e4m3"):
                if args.smoke and kv != "bf16":
                    continue
                name = f"engine greedy tokens, {weights} weights, {kv} KV: kernels vs references"
                record(name, _engine, Path(tmp) / weights, kv, device, 2 if args.smoke else 8)
    failed = [c["check"] for c in checks if not c["ok"]]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "checks": checks,
        "failed": failed,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


def _compare(out: torch.Tensor, ref: torch.Tensor, tol: float) -> dict:
    scale = ref.float().abs().max().item()
    error = (out.float() - ref.float()).abs().max().item()
    ok = out.shape == ref.shape and out.dtype == ref.dtype and error <= tol * scale
    return {"ok": ok, "max_abs_error": error, "allowed": tol * scale}


def _int4_gemm(kernel, m, n, k, group, symmetric, dtype, device) -> dict:
    gen = torch.Generator().manual_seed(m + n)
    q = quantize_int4(torch.randn(n, k, generator=gen), group, symmetric)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    args = [t.to(device) if t is not None else None for t in (q.weight_packed, q.weight_scale, q.weight_zero)]
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    return _compare(kernel(x, *args, group), int4_linear_reference(x, *args, group), tol)


def _fp8_gemm(m, n, k, dtype, device) -> dict:
    gen = torch.Generator().manual_seed(m + n)
    q = quantize_fp8_weight(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen))
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w, s = q.weight.to(device), q.weight_scale.to(device)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    return _compare(fp8_linear_triton(x, w, s), fp8_linear_reference(x, w, s), tol)


def _decode(heads, kv_heads, head_dim, page_size, window, lens, kv, dtype, device) -> dict:
    """Queries and a shuffled page pool, as tests/test_kernels.py builds them; FP8 with per-page scales."""
    gen = torch.Generator().manual_seed(0)
    pages_per_seq = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(pages_per_seq), dtype=torch.int32)
    for b, count in enumerate(pages_per_seq):
        tables[b, :count] = torch.tensor([order.pop() for _ in range(count)])
    shape = (num_pages * page_size, kv_heads, head_dim)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    scales = (None, None)
    if kv == "bf16":
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    else:
        scales = (torch.rand(num_pages, generator=gen) + 0.01, torch.rand(num_pages, generator=gen) + 0.01)
        k, v = (
            quantize_fp8(x, s.repeat_interleave(page_size)[:, None, None])
            for x, s in zip((k, v), scales, strict=True)
        )
        scales = tuple(s.to(device) for s in scales)
    args = (
        k.to(device),
        v.to(device),
        tables.to(device),
        torch.tensor(lens, dtype=torch.int32, device=device),
        page_size,
        head_dim**-0.5,
        window,
        *scales,
    )
    q = q.to(device, dtype)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    return _compare(paged_decode_attention_triton(q, *args), paged_decode_attention_reference(q, *args), tol)


def _silu_mul(rows: int, inter: int, dtype: torch.dtype, device) -> dict:
    gate_up = (torch.randn(rows, 2 * inter, device=device) * 6).to(dtype)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    return _compare(silu_mul_triton(gate_up), silu_mul_reference(gate_up), tol)


def _kv_write(fp8: bool, device) -> dict:
    """The scatter (and FP8 quantisation) into a page pool: bit for bit the reference's."""
    gen = torch.Generator().manual_seed(1)
    page_size, pages = 4, 16
    mapping = torch.randperm(pages * page_size, generator=gen)[:20].to(device)
    x = (torch.randn(20, 2, 32, generator=gen) * 3).to(device)
    page_scale = torch.exp2(torch.randint(-4, 3, (pages,), generator=gen).float()).to(device) if fp8 else None
    dtype = torch.uint8 if fp8 else torch.bfloat16
    out = torch.zeros(pages * page_size, 2, 32, dtype=dtype, device=device)
    ref = out.clone()
    write_kv_triton(x if fp8 else x.to(torch.bfloat16), out, mapping, page_scale, page_size)
    write_kv_reference(x if fp8 else x.to(torch.bfloat16), ref, mapping, page_scale, page_size)
    mismatched = (out != ref).sum().item()
    return {"ok": mismatched == 0, "mismatched_values": mismatched}


def _engine(model_dir: Path, kv: str, device, max_tokens: int) -> dict:
    """Greedy tokens of the same engine config with TESSERA_KERNELS=reference and =triton (fp32 compute)."""
    config = EngineConfig(
        dtype="float32", device=device.type, kv_budget_bytes=4 * 2**20, page_size=4, kv_cache_dtype=kv
    )
    prompts = [[random.Random(s).randrange(16, 500) for _ in range(7 + 5 * s)] for s in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = {}
    before = os.environ.get(KERNELS_ENV)
    try:
        for mode in ("reference", "triton"):
            os.environ[KERNELS_ENV] = mode
            outputs = Engine.from_pretrained(model_dir, config).generate(prompts, params)
            tokens[mode] = [o.token_ids for o in outputs]
    finally:
        if before is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = before
    pairs = [
        (a, b)
        for ref, ker in zip(tokens["reference"], tokens["triton"], strict=True)
        for a, b in zip(ref, ker, strict=True)
    ]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    return {"ok": tokens["reference"] == tokens["triton"], "token_agreement": agreement}


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
