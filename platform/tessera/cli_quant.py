"""``tessera quantize``, ``tessera bench kernels`` and ``tessera bench weights``: weight formats from the
command line.

``add_commands`` registers ``quantize`` on the main parser's subcommands and the two benches under the
existing ``bench`` command; gpu_workers (and torch) load only when a command runs. User errors raise
ValueError, which the main CLI prints without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

FORMATS = ("bf16", "fp8", "int4")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``quantize`` and, under ``bench`` (which must already exist), ``kernels`` and ``weights``."""
    from tessera.cli import parse_ids

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
    quant.set_defaults(func=cmd_quantize)

    benches = next(
        a for a in subparsers.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    kernels = benches.add_parser(
        "kernels",
        help="weight GEMV/GEMM per format and paged decode attention per KV format: time, GB/s, speedup",
        description="On a CUDA device the Triton kernels run; without one the torch references run "
        "(the output says which), so CPU numbers are reference timings, not kernel numbers.",
    )
    kernels.add_argument(
        "--batch", type=parse_ids, default=[1, 8, 16, 32, 64], metavar="1,8,...", help="GEMM batch sizes"
    )
    kernels.add_argument(
        "--shape",
        action="append",
        type=_parse_shape,
        metavar="KxN",
        help="weight shape in x out; repeatable (default 4096x4096 and 4096x14336)",
    )
    kernels.add_argument(
        "--context",
        type=parse_ids,
        metavar="512,...",
        help="attention context lengths (default 1024,4096,16384 on GPU; 256,1024 on CPU)",
    )
    kernels.add_argument(
        "--attn-batch", type=int, metavar="B", help="decode sequences (default 16 GPU, 2 CPU)"
    )
    kernels.add_argument(
        "--peak-gbs",
        type=float,
        metavar="GB/s",
        help="memory bandwidth, GB/s, that %% of peak is reported against",
    )
    kernels.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    kernels.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's choice); on a small machine shared with other work, 1 "
        "avoids threads waiting on each other while one is descheduled",
    )
    kernels.add_argument("--json", action="store_true", help="print the results as JSON")
    kernels.set_defaults(func=cmd_bench_kernels)

    weights = benches.add_parser(
        "weights",
        help="quality and size of fp8/int4 weights vs the checkpoint: per-layer error, logit KL, top-1, ppl",
        description="Converts MODEL with `tessera quantize` into a temporary folder per format, then runs "
        "each converted model and the original (float32 compute, so only weight error shows) over the "
        "same text.",
    )
    weights.add_argument("--model", required=True, type=Path, help="unquantised checkpoint folder")
    weights.add_argument(
        "--formats", default="bf16,fp8,int4", help="formats to compare, comma-separated (default all)"
    )
    weights.add_argument("--group-size", type=int, default=128, help="int4 group size (default 128)")
    weights.add_argument("--symmetric", action="store_true", help="int4 without zero points")
    weights.add_argument(
        "--text",
        action="append",
        type=Path,
        metavar="FILE",
        help="evaluation text; repeatable (default: a few Python standard library modules)",
    )
    weights.add_argument("--max-tokens", type=int, default=4096, help="evaluation tokens (default 4096)")
    weights.add_argument("--per-layer", action="store_true", help="also print every layer's relative error")
    weights.add_argument("--json", action="store_true", help="print the results as JSON")
    weights.set_defaults(func=cmd_bench_weights)


def _parse_shape(value: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in value.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 4096x14336, got {value!r}") from None
    return k, n


def cmd_quantize(args: argparse.Namespace) -> None:
    from gpu_workers.quant.checkpoint import quantize_checkpoint

    report = quantize_checkpoint(
        args.src, args.dst, args.weights, args.group_size, args.symmetric, progress=True
    )
    print(f"wrote {args.dst}: {_describe(args.weights, args.group_size, args.symmetric)}")
    print(
        f"{report.converted_tensors} linear weights converted, {report.kept_tensors} tensors kept in bf16 "
        "(embeddings, lm_head, norms, biases, MoE routers)"
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


def cmd_bench_kernels(args: argparse.Namespace) -> None:
    import torch

    from gpu_workers.kernels import bench

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads needs a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    shapes = args.shape or [(4096, 4096), (4096, 14336)]
    contexts = args.context or ([1024, 4096, 16384] if gpu else [256, 1024])
    attn_batch = args.attn_batch or (16 if gpu else 2)
    peak = args.peak_gbs or bench.peak_gbs(device)
    name = torch.cuda.get_device_name(device) if gpu else "CPU"
    gemm = [row for k, n in shapes for row in bench.bench_gemm(k, n, args.batch, device)]
    attention = bench.bench_attention(contexts, attn_batch, device)
    if args.json:
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
    print(f"{'K x N':<13}{'batch':>6}{'weights':>9}{'ms':>10}{'GB/s':>10}{'% peak':>8}{'vs bf16':>9}")
    for r in gemm:
        print(
            f"{f'{r.k}x{r.n}':<13}{r.batch:>6}{r.weights:>9}{r.ms:>10.4f}{r.gbs:>10.3g}"
            f"{_percent(r.gbs, peak):>8}{r.speedup:>8.2f}x"
        )
    print()
    print(f"paged decode attention, 32 query / 8 KV heads x 128, page 16, batch {attn_batch}")
    print(f"{'context':<9}{'KV':>10}{'ms':>10}{'GB/s':>10}{'% peak':>8}{'vs bf16':>9}")
    for r in attention:
        print(
            f"{r.context:<9}{r.kv:>10}{r.ms:>10.4f}{r.gbs:>10.3g}{_percent(r.gbs, peak):>8}{r.speedup:>8.2f}x"
        )


def _percent(gbs: float, peak: float | None) -> str:
    return f"{100 * gbs / peak:.0f}%" if peak else "-"


def cmd_bench_weights(args: argparse.Namespace) -> None:
    import torch

    from gpu_workers.kv.calibrate import default_sample_texts
    from gpu_workers.model import load_model, load_tokenizer
    from gpu_workers.quant.checkpoint import quantize_checkpoint
    from gpu_workers.quant.quality import compare_models, token_windows

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(
            f"--formats takes a comma-separated subset of {', '.join(FORMATS)}, got {args.formats!r}"
        )
    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json, so evaluation text cannot be tokenized")
    texts = [p.read_text(encoding="utf-8") for p in args.text] if args.text else default_sample_texts()
    windows = token_windows([tokenizer.encode(t) for t in texts], 512, args.max_tokens)
    reference = load_model(args.model, dtype=torch.float32, weights="bf16")
    results = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        for fmt in formats:
            symmetric = args.symmetric and fmt == "int4"
            conversion = quantize_checkpoint(
                args.model, Path(tmp) / fmt, fmt, args.group_size, symmetric, True
            )
            quality = compare_models(reference, load_model(Path(tmp) / fmt, dtype=torch.float32), windows)
            results.append((fmt, conversion, quality))
    if args.json:
        print(json.dumps([_weights_row(label, c, q, per_layer=True) for label, c, q in results], indent=2))
        return
    print(
        f"{args.model}: {results[0][2].tokens} evaluation tokens, float32 compute; reference = the "
        f"checkpoint's own weights (perplexity {results[0][2].reference_perplexity:.3f})"
    )
    print(
        f"{'weights':<10}{'MB':>8}{'x src':>7}{'linear x bf16':>15}{'layer err mean':>16}{'max':>8}"
        f"{'KL (nats)':>11}{'top-1':>8}{'ppl':>9}{'Δppl':>8}"
    )
    for label, c, q in results:
        row = _weights_row(label, c, q, per_layer=False)
        errors = list(q.layer_errors.values())
        mean = f"{sum(errors) / len(errors):.4f}" if errors else "-"
        peak = f"{max(errors):.4f}" if errors else "-"
        linear = f"{row['linear_ratio_vs_bf16']:.3f}" if row["linear_ratio_vs_bf16"] else "-"
        print(
            f"{label:<10}{c.output_bytes / 1e6:>8.2f}{c.ratio:>7.3f}{linear:>15}{mean:>16}{peak:>8}"
            f"{q.kl:>11.2e}{q.top1:>8.4f}{q.perplexity:>9.3f}{q.perplexity - q.reference_perplexity:>+8.3f}"
        )
    if args.per_layer:
        for label, _, q in results:
            for name, err in q.layer_errors.items():
                print(f"{label:<10}{name:<45}{err:.5f}")


def _weights_row(label, conversion, quality, per_layer: bool) -> dict:
    ratio = (
        conversion.converted_bytes / conversion.converted_bf16_bytes
        if conversion.converted_bf16_bytes
        else None
    )
    row = {
        "weights": label,
        "bytes": conversion.output_bytes,
        "source_bytes": conversion.source_bytes,
        "linear_ratio_vs_bf16": ratio,
        "kl": quality.kl,
        "top1": quality.top1,
        "perplexity": quality.perplexity,
        "reference_perplexity": quality.reference_perplexity,
        "tokens": quality.tokens,
    }
    if per_layer:
        row["layer_errors"] = quality.layer_errors
    return row
