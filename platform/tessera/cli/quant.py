"""``tessera quantize``: convert a checkpoint's weights to int4 or fp8 (or bf16), once, for workers to load.

``add_commands`` registers it on the main parser's subcommands; gpu_workers (and torch) load only when it
runs. User errors raise ValueError, which ``tessera.cli.main`` prints without a traceback.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# What stays bf16 under each --only selection (gpu_workers.quant.config.SELECTIONS).
KEPT = {
    "all": "embeddings, lm_head, norms, biases, MoE routers",
    "routed-experts": "all but the routed experts: attention, shared experts, dense MLPs, embeddings, "
    "lm_head, norms, biases, MoE routers",
}


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    quant = subparsers.add_parser(
        "quantize",
        help="convert a checkpoint's weights to int4 or fp8 (or bf16), once, for workers to load",
        description="Write SRC converted to DST: linear weights in the new format (int4: groups along the "
        "input dimension with bf16 scales and zero points; fp8: e4m3 with a scale per output channel), "
        "embeddings, lm_head, norms and MoE routers in bf16, config.json with a quantization_config, and "
        "the tokenizer files. Loading DST needs no flags.",
    )
    quant.add_argument("src", type=Path, help="unquantised checkpoint folder (HF layout)")
    quant.add_argument("dst", type=Path, help="new folder to write")
    quant.add_argument("--weights", required=True, choices=("int4", "fp8", "bf16"), help="target format")
    quant.add_argument(
        "--group-size", type=int, default=128, metavar="G", help="int4 input channels per scale (default 128)"
    )
    quant.add_argument(
        "--symmetric", action="store_true", help="int4 without zero points (codes centred on 8)"
    )
    quant.add_argument(
        "--only",
        choices=("all", "routed-experts"),
        default="all",
        help="which linear layers to convert: all (default) or the MoE's routed experts alone "
        "(attention, shared experts, dense MLPs stay bf16; routers and norms never convert)",
    )
    quant.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> None:
    from gpu_workers.tools.quantize import quantize_checkpoint

    report = quantize_checkpoint(
        args.src, args.dst, args.weights, args.group_size, args.symmetric, progress=True, only=args.only
    )
    only = "" if args.only == "all" else f" ({args.only} only)"
    print(f"wrote {args.dst}: {_describe(args.weights, args.group_size, args.symmetric)}{only}")
    print(
        f"{report.converted_tensors} linear weights converted, {report.kept_tensors} tensors kept in bf16 "
        f"({KEPT[args.only]})"
    )
    print(
        f"weights: {_mb(report.source_bytes)} ({report.source_dtype}) -> {_mb(report.output_bytes)} "
        f"({report.ratio:.3f}x)"
    )
    if report.converted_tensors:
        print(
            f"linear weights: {_mb(report.converted_bf16_bytes)} in bf16 -> {_mb(report.converted_bytes)} "
            f"({report.converted_bytes / report.converted_bf16_bytes:.3f}x)"
        )


def _describe(weights: str, group_size: int, symmetric: bool) -> str:
    if weights == "int4":
        return f"int4, groups of {group_size}, {'symmetric' if symmetric else 'asymmetric'}, round to nearest"
    return {"fp8": "fp8 e4m3, one scale per output channel", "bf16": "bf16"}[weights]


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"
