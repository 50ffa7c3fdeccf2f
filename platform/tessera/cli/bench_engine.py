"""``tessera bench engine|integrity|prefix|kv-formats|kernels|weights``: the benches that run the engine,
its KV cache, its kernels or its weight formats in-process on a checkpoint folder.

Each ``add_*`` registers one bench's flags and its ``cmd_*`` checks them and calls a ``tessera.bench``
driver, which (with gpu_workers and torch) loads only when the bench runs.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from tessera.cli.common import (
    CliError,
    add_engine_args,
    engine_config,
    parse_ids,
    parse_shape,
    require_positive,
)

WEIGHT_FORMATS = ("bf16", "fp8", "int4")


def add_engine(benches: argparse._SubParsersAction) -> None:
    """Register ``bench engine``."""
    engine = benches.add_parser("engine", help="this engine vs HF transformers generate, output tokens/s")
    engine.add_argument(
        "--model", required=True, type=Path, metavar="DIR", help="checkpoint folder (HF layout)"
    )
    engine.add_argument(
        "--concurrency", type=parse_ids, default=[1, 8, 32], metavar="1,8,32", help="concurrent requests"
    )
    engine.add_argument(
        "--max-tokens", type=int, default=128, metavar="N", help="longest output per request (default 128)"
    )
    engine.add_argument("--min-tokens", type=int, metavar="N", help="shortest output (default max-tokens/4)")
    engine.add_argument(
        "--repeat", type=int, default=3, metavar="N", help="runs per point; the median counts (default 3)"
    )
    add_engine_args(engine, default_dtype=None)
    engine.add_argument("--json", action="store_true", help="print the results as JSON")
    engine.set_defaults(func=cmd_engine)


def cmd_engine(args: argparse.Namespace) -> None:
    from tessera.bench.engine import run_engine_bench

    if not args.concurrency or min(args.concurrency) < 1 or args.max_tokens < 1 or args.repeat < 1:
        raise CliError("--concurrency, --max-tokens and --repeat need positive integers", exit_code=2)
    if args.min_tokens is not None and not 1 <= args.min_tokens <= args.max_tokens:
        raise CliError("--min-tokens must be in 1..--max-tokens", exit_code=2)
    run_engine_bench(
        args.model,
        engine_config(args),
        args.concurrency,
        args.max_tokens,
        args.repeat,
        args.json,
        args.min_tokens,
    )


def add_integrity(benches: argparse._SubParsersAction) -> None:
    """Register ``bench integrity``."""
    integrity = benches.add_parser(
        "integrity",
        help="KV integrity check on vs off: output tokens/s and p50/p95 step time",
        description="Same greedy requests on two engines, one checking page generations before every "
        "step and one not, stepped alternately so both see the same machine load.",
    )
    _kv_bench_args(integrity)
    integrity.add_argument(
        "--concurrency", type=parse_ids, default=[1, 8, 32], metavar="1,8,32", help="concurrent requests"
    )
    integrity.add_argument(
        "--prompt-tokens", type=int, default=256, help="longest prompt; prompts span half to all of it"
    )
    integrity.add_argument(
        "--max-tokens", type=int, default=32, help="output tokens per request (default 32)"
    )
    integrity.add_argument("--reps", type=int, default=5, help="repetitions per concurrency (default 5)")
    integrity.set_defaults(func=cmd_integrity)


def cmd_integrity(args: argparse.Namespace) -> None:
    from tessera.bench.integrity import run_integrity

    require_positive(args, "concurrency", "prompt_tokens", "max_tokens", "reps")
    config = _kv_bench_config(args)
    run_integrity(
        args.model,
        config,
        args.threads,
        args.concurrency,
        args.prompt_tokens,
        args.max_tokens,
        args.reps,
        args.json,
    )


def add_prefix(benches: argparse._SubParsersAction) -> None:
    """Register ``bench prefix``."""
    prefix = benches.add_parser(
        "prefix",
        help="prefix cache: time to first token, hit vs miss, on a long shared system prompt",
        description="One tenant sends a long system prompt with short different suffixes (first request "
        "misses, later ones hit), then another tenant sends the same system prompt (must miss).",
    )
    _kv_bench_args(prefix)
    prefix.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt (default 1024)")
    prefix.add_argument("--suffix-tokens", type=int, default=32, help="user part of each prompt (default 32)")
    prefix.add_argument("--rounds", type=int, default=10, help="rounds, each with fresh tenants (default 10)")
    prefix.set_defaults(func=cmd_prefix)


def cmd_prefix(args: argparse.Namespace) -> None:
    from tessera.bench.prefix import run_prefix

    require_positive(args, "system_tokens", "suffix_tokens", "rounds")
    config = _kv_bench_config(args)
    run_prefix(
        args.model, config, args.threads, args.system_tokens, args.suffix_tokens, args.rounds, args.json
    )


def add_kv_formats(benches: argparse._SubParsersAction) -> None:
    """Register ``bench kv-formats``."""
    formats = benches.add_parser(
        "kv-formats",
        help="FP8-e4m3 vs BF16 KV cache: decode tokens/s per concurrency under one KV budget",
        description="Both formats get the same kv_budget_bytes, sized so that BF16 runs out of pages "
        "below the highest concurrency while FP8, at half the bytes per token, keeps admitting.",
    )
    _kv_bench_args(formats, budget_help="bytes of KV cache for both formats (default: see --fit-requests)")
    formats.add_argument(
        "--concurrency",
        type=parse_ids,
        default=[1, 8, 16, 32, 64],
        metavar="1,8,16,32,64",
        help="concurrent requests",
    )
    formats.add_argument("--prompt-tokens", type=int, default=192, help="prompt length (default 192)")
    formats.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    formats.add_argument(
        "--fit-requests",
        type=int,
        default=40,
        help="without --kv-budget-bytes, size the budget so BF16 holds this many whole requests (default 40)",
    )
    formats.add_argument("--reps", type=int, default=2, help="repetitions per concurrency (default 2)")
    formats.set_defaults(func=cmd_kv_formats)


def cmd_kv_formats(args: argparse.Namespace) -> None:
    from tessera.bench.kv_formats import run_kv_formats

    require_positive(args, "concurrency", "prompt_tokens", "max_tokens", "fit_requests", "reps")
    config = _kv_bench_config(args)
    run_kv_formats(
        args.model,
        config,
        args.threads,
        args.concurrency,
        args.prompt_tokens,
        args.max_tokens,
        args.fit_requests if args.kv_budget_bytes is None else None,
        args.reps,
        args.json,
    )


def _kv_bench_args(parser: argparse.ArgumentParser, budget_help: str = "bytes of KV cache (default 256 MiB)"):
    parser.add_argument("--model", required=True, type=Path, help="checkpoint folder (HF layout)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    parser.add_argument("--kv-budget-bytes", type=int, help=budget_help)
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's choice); on a small machine shared with other work, 1 "
        "avoids threads waiting on each other while one is descheduled",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="where the model and the KV cache live (default cpu)"
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=None,
        help="replay decode steps from CUDA graphs (EngineConfig.cuda_graphs)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _kv_bench_config(args: argparse.Namespace):
    """The engine config the KV benches' flags describe (``--threads`` checked first)."""
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads needs a positive integer, got {args.threads}", exit_code=2)
    if args.device is None:
        return engine_config(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device cuda: torch {torch.__version__} sees no CUDA device", exit_code=2)
    return replace(engine_config(args), device=args.device)


def add_kernels(benches: argparse._SubParsersAction) -> None:
    """Register ``bench kernels``."""
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
        type=parse_shape,
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
    kernels.set_defaults(func=cmd_kernels)


def cmd_kernels(args: argparse.Namespace) -> None:
    from tessera.bench.kernels import run_kernels

    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads needs a positive integer, got {args.threads}", exit_code=2)
    run_kernels(
        args.batch,
        args.shape,
        args.context,
        args.attn_batch,
        args.peak_gbs,
        args.device,
        args.threads,
        args.json,
    )


def add_weights(benches: argparse._SubParsersAction) -> None:
    """Register ``bench weights``."""
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
    # decode speed per weight format
    weights.add_argument(
        "--decode-tokens",
        type=int,
        default=64,
        help="greedy tokens per decode-speed run (0: skip; default 64)",
    )
    weights.add_argument("--decode-batch", type=int, default=1, help="requests decoded at once (default 1)")
    weights.add_argument("--rounds", type=int, default=3, help="decode-speed rounds (default 3)")
    weights.add_argument(
        "--reference-kernels",
        action="store_true",
        help="also time the quantised formats on the per-call dequantising references",
    )
    weights.add_argument("--json", action="store_true", help="print the results as JSON")
    weights.set_defaults(func=cmd_weights)


def cmd_weights(args: argparse.Namespace) -> None:
    from tessera.bench.weights import run_weights

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in WEIGHT_FORMATS]
    if unknown or not formats:
        raise CliError(
            f"--formats takes a comma-separated subset of {', '.join(WEIGHT_FORMATS)}, got {args.formats!r}",
            exit_code=2,
        )
    require_positive(args, "decode_batch", "rounds")
    if args.decode_tokens < 0:
        raise CliError(f"--decode-tokens must be 0 or more, got {args.decode_tokens}", exit_code=2)
    run_weights(
        args.model,
        formats,
        args.group_size,
        args.symmetric,
        args.text,
        args.max_tokens,
        args.per_layer,
        args.json,
        args.decode_tokens,
        args.decode_batch,
        args.rounds,
        args.reference_kernels,
    )
