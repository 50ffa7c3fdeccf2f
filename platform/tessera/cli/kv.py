"""``tessera calibrate`` and ``tessera capacity``: KV-cache formats from the command line.

``add_commands`` registers both on the main parser's subcommands; gpu_workers (and torch) load only when
a command runs. Bad arguments exit 2 (argparse, or CliError); a model that fits nowhere exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from tessera.cli.common import (
    CliError,
    parse_non_negative_float,
    parse_positive_float,
    parse_positive_int,
)


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    cal = subparsers.add_parser(
        "calibrate",
        help="measure static FP8 KV scales (per layer, K and V) for a checkpoint over sample text",
        description="Run the model over sample text, record each layer's K and V amax and write "
        "scale = amax / 448 to a JSON file for EngineConfig(kv_cache_dtype='fp8_e4m3', kv_scales=FILE).",
    )
    cal.add_argument("model", type=Path, help="checkpoint folder (HF layout, with tokenizer.json)")
    cal.add_argument("--out", required=True, type=Path, help="JSON file to write the scales to")
    cal.add_argument(
        "--text",
        action="append",
        type=Path,
        metavar="FILE",
        help="sample text file; repeatable (default: a few Python standard library modules)",
    )
    cal.add_argument(
        "--max-tokens", type=parse_positive_int, default=8192, help="sample tokens to run (default 8192)"
    )
    cal.add_argument("--dtype", default="float32", help="bfloat16, float16 or float32 (default float32)")
    cal.set_defaults(func=cmd_calibrate)

    cap = subparsers.add_parser(
        "capacity",
        help="tokens of KV cache that fit in GPU memory, per KV format and weight format",
        description="Weights from real tensor shapes (a checkpoint's safetensors headers or a published "
        "config); the rest of --memory-gib per GPU (minus --reserve-gib) holds KV cache.",
    )
    source = cap.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="checkpoint folder (config.json + safetensors)")
    source.add_argument("--config", metavar="NAME", help="a published model config; see --list")
    source.add_argument("--list", action="store_true", help="list the named configs and exit")
    cap.add_argument("--memory-gib", type=parse_positive_float, help="accelerator memory per GPU, GiB")
    cap.add_argument("--gpus", type=parse_positive_int, default=1, help="tensor-parallel GPUs (default 1)")
    cap.add_argument(
        "--reserve-gib",
        type=parse_non_negative_float,
        default=0.0,
        help="per-GPU memory kept for activations, CUDA graphs and workspace (default 0)",
    )
    cap.add_argument(
        "--page-size", type=parse_positive_int, default=16, help="KV page size in tokens (default 16)"
    )
    cap.add_argument("--json", action="store_true", help="print the result as JSON")
    cap.set_defaults(func=cmd_capacity)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from gpu_workers.engine.params import DTYPES
    from gpu_workers.tools.calibrate import calibrate

    if args.dtype not in DTYPES:
        raise CliError(f"--dtype must be one of {', '.join(sorted(DTYPES))}, got {args.dtype!r}", exit_code=2)
    texts = [path.read_text(encoding="utf-8") for path in args.text] if args.text else None
    with contextlib.redirect_stdout(sys.stderr):
        scales = calibrate(args.model, texts, args.max_tokens, DTYPES[args.dtype], progress=True)
    scales.save(args.out)
    print(f"wrote {args.out}: {scales.num_layers} layers, {scales.tokens} tokens")
    print(f"K amax per layer: {', '.join(f'{a:.4g}' for a in scales.k_amax)}")
    print(f"V amax per layer: {', '.join(f'{a:.4g}' for a in scales.v_amax)}")


def cmd_capacity(args: argparse.Namespace) -> None:
    from gpu_workers.tools import capacity as cap

    if args.list:
        for name, config in cap.NAMED_CONFIGS.items():
            print(f"{name:<14}{config['architectures'][0]}")
        return
    if args.memory_gib is None:
        raise CliError("--memory-gib is required: the accelerator memory of one GPU, in GiB", exit_code=2)
    if args.model:
        model = cap.checkpoint_model(args.model)
    else:
        try:
            model = cap.named_model(args.config)
        except ValueError as exc:  # the one thing it refuses: a name it does not know
            raise CliError(f"--config: {exc} (see --list)", exit_code=2) from None
    rows = cap.capacity(model, args.memory_gib, args.gpus, args.reserve_gib, args.page_size)
    if args.json:
        print(json.dumps(cap.report(model, rows, args.memory_gib, args.gpus, args.reserve_gib), indent=2))
    else:
        print(cap.format_table(model, rows, args.memory_gib, args.gpus, args.reserve_gib))
    reason = cap.does_not_fit(model, rows, args.memory_gib, args.gpus, args.reserve_gib)
    if reason:
        raise CliError(reason)
