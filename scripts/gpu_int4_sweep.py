"""W4A16 on a GPU: the kernel's own launch choice against a sweep of tile widths and K splits, BF16's
F.linear, and (``--baseline FILE``) another version of the kernel, on a decoder's shapes.

Every timing is a CUDA graph replayed over rotated copies of the weights (``kernel_bench.time_ms``: the
kernel's own time, weights read from HBM, not L2). Each (shape, batch) row reports GB/s of weight bytes
moved and the ratio to BF16; the sweep says how far the chosen launch is from the best one tried.

Usage: python scripts/gpu_int4_sweep.py [--json OUT] [--baseline .ab/int4_linear_before.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_workers.formats.weights import quantize_int4
from gpu_workers.kernels.int4_linear_triton import int4_linear_triton, int4_tiles
from gpu_workers.tools.kernel_bench import rotated, time_ms

# (in, out): Llama-3-8B's q/o projection, its gate/up, its down projection.
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
BATCHES = [1, 8, 32, 64]
GROUP = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--baseline", type=Path, help="a file defining int4_linear_triton (the same contract)"
    )
    parser.add_argument("--batch", default=",".join(map(str, BATCHES)))
    parser.add_argument("--shape", action="append", help="INxOUT (repeatable); default: a Llama-3-8B layer's")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shape] if args.shape else SHAPES
    baseline = _load(args.baseline).int4_linear_triton if args.baseline else None
    rows = []
    for k, n in shapes:
        gen = torch.Generator(device="cpu").manual_seed(0)
        w = torch.randn(n, k, generator=gen) * 0.02
        q = quantize_int4(w, GROUP)
        stored = (q.weight_packed.to(device), q.weight_scale.to(device), q.weight_zero.to(device))
        int4_bytes = sum(t.numel() * t.element_size() for t in stored)
        int4_copies = rotated(stored, device)
        w16 = w.to(device, torch.bfloat16)
        bf16_copies = rotated((w16,), device)
        for m in map(int, args.batch.split(",")):
            x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
            bf16_ms = time_ms([partial(F.linear, x, *c) for c in bf16_copies], device, 20, eager=False)[0]

            def int4_ms(fn, x=x, copies=int4_copies) -> float:
                return time_ms([partial(fn, x, *c, GROUP) for c in copies], device, 20, eager=False)[0]

            chosen = int4_tiles(m, n, k, GROUP, device)
            row = {"k": k, "n": n, "batch": m, "bf16_ms": bf16_ms, "chosen": asdict(chosen)}
            row["chosen_ms"] = int4_ms(lambda *a, t=chosen: int4_linear_triton(*a, tiles=t))
            if baseline is not None:
                row["baseline_ms"] = int4_ms(baseline)
            sweep = []
            for block_n in (32, 64, 128):
                for split_k in (1, 2, 4, 8, 16):
                    tiles = replace(chosen, block_n=block_n, split_k=split_k)
                    ms = int4_ms(lambda *a, t=tiles: int4_linear_triton(*a, tiles=t))
                    sweep.append({"block_n": block_n, "split_k": split_k, "ms": ms})
            best = min(sweep, key=lambda s: s["ms"])
            row.update(sweep=sweep, best=best)
            row["int4_gbs"] = int4_bytes / row["chosen_ms"] / 1e6
            row["bf16_gbs"] = w16.numel() * 2 / bf16_ms / 1e6
            rows.append(row)
            base = f" before {row['baseline_ms'] * 1e3:7.1f} us" if baseline else ""
            print(
                f"{k:>5}x{n:<5} M={m:<3} bf16 {bf16_ms * 1e3:7.1f} us  int4 {row['chosen_ms'] * 1e3:7.1f} us "
                f"({row['int4_gbs']:5.0f} GB/s, {bf16_ms / row['chosen_ms']:.2f}x bf16){base}  "
                f"best {best['ms'] * 1e3:7.1f} us (n {best['block_n']}, split {best['split_k']}; "
                f"chosen n {chosen.block_n}, split {chosen.split_k})",
                flush=True,
            )
    if args.json:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=2) + "\n")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("int4_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
