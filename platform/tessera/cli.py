"""The ``tessera`` command line. Commands import ``gpu_workers`` (and so torch) only when they run."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tessera import (
    SHIPPED_MODEL_DIR,
    bench_gateway,
    bench_kv,
    cli_admin,
    cli_eval,
    cli_kv,
    cli_quant,
    cli_serve,
)


class CliError(Exception):
    """A problem the user can fix; printed without a traceback. Exit code 2 for bad input, 1 otherwise."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except CliError as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (ValueError, OSError) as exc:  # bad parameters and unloadable checkpoints say what to fix
        print(f"tessera: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera: multi-tenant LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    init = commands.add_parser("init-model", help="write a tiny random-weight demo checkpoint")
    init.add_argument("dir", type=Path, help="folder to write the checkpoint to")
    init.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed for the random weights (default 0)"
    )
    init.add_argument(
        "--arch", default="llama", metavar="ARCH", help="llama (default), mistral, qwen2 or qwen3"
    )
    init.add_argument(
        "--no-tokenizer", action="store_true", help="omit tokenizer files (prompts must be ids)"
    )
    init.set_defaults(func=cmd_init_model)

    gen = commands.add_parser("generate", help="generate text from a checkpoint folder, offline")
    gen.add_argument(
        "--model",
        type=Path,
        default=SHIPPED_MODEL_DIR,
        metavar="DIR",
        help="checkpoint folder (HF layout; default: the shipped pycode-tiny model)",
    )
    prompts = gen.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT", help="prompt text; repeat for a batch")
    prompts.add_argument(
        "--prompt-ids", action="append", type=parse_ids, metavar="1,2,3", help="prompt token ids; repeatable"
    )
    gen.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="tokens to generate at most (default 64)"
    )
    gen.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 is greedy (default 1.0)")
    gen.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1] (default 1)"
    )
    gen.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="sample from the k likeliest tokens; 0 is off"
    )
    gen.add_argument("--seed", type=int, metavar="S", help="per-request seed: same seed, same output")
    gen.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string; repeatable")
    add_engine_args(gen, default_dtype=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.set_defaults(func=cmd_generate)

    bench = commands.add_parser("bench", help="benchmarks")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
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
    engine.add_argument(
        "--repeat", type=int, default=3, metavar="N", help="runs per point; the median counts (default 3)"
    )
    add_engine_args(engine, default_dtype="float32")
    engine.add_argument("--json", action="store_true", help="print the results as JSON")
    engine.set_defaults(func=cmd_bench_engine)
    bench_kv.add_commands(benches)
    bench_gateway.add_commands(benches)
    cli_kv.add_commands(commands)
    cli_admin.add_commands(commands)
    cli_serve.add_commands(commands)
    cli_eval.add_commands(commands)
    cli_quant.add_commands(commands)
    return parser


def add_engine_args(parser: argparse.ArgumentParser, default_dtype: str | None) -> None:
    parser.add_argument(
        "--dtype",
        default=default_dtype,
        metavar="D",
        help=f"bfloat16, float16 or float32 (default {default_dtype or 'bfloat16'})",
    )
    parser.add_argument(
        "--kv-budget-bytes", type=int, metavar="B", help="bytes of KV cache (default 256 MiB)"
    )
    parser.add_argument(
        "--page-size", type=int, metavar="P", help="tokens per KV page, a power of two (default 16)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "bf16", "fp8_e4m3"),
        help="KV cache format (default auto: the model dtype, unquantised)",
    )
    parser.add_argument("--kv-scales", metavar="FILE", help="static FP8 KV scales from `tessera calibrate`")
    parser.add_argument(
        "--weights",
        choices=("auto", "bf16", "fp8", "int4"),
        help="weight format (default auto: what the checkpoint holds; fp8/int4 quantise an unquantised "
        "checkpoint as it loads)",
    )
    parser.add_argument(
        "--no-integrity-check",
        dest="integrity_check",
        action="store_false",
        default=None,
        help="skip the per-step KV page integrity check",
    )


def parse_ids(value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,2,3, got {value!r}"
        ) from None


def engine_config(args: argparse.Namespace):
    """EngineConfig from the flags that were given; the rest keep EngineConfig's defaults."""
    from gpu_workers import EngineConfig

    given = {
        "dtype": args.dtype,
        "kv_budget_bytes": args.kv_budget_bytes,
        "page_size": args.page_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_scales": args.kv_scales,
        "weights": args.weights,
        "integrity_check": args.integrity_check,
    }
    try:
        return EngineConfig(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise CliError(str(exc), exit_code=2) from None


def load_engine(args: argparse.Namespace):
    """The engine for ``--model``, loaded with a progress bar on stderr: stdout carries only results."""
    from gpu_workers import Engine

    return Engine.from_pretrained(args.model, engine_config(args), progress=True)


def cmd_init_model(args: argparse.Namespace) -> None:
    from gpu_workers.model.demo_checkpoint import write_demo_checkpoint

    written = write_demo_checkpoint(
        args.dir, arch=args.arch, seed=args.seed, with_tokenizer=not args.no_tokenizer
    )
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    print("Its weights are random, so it generates gibberish; it exists to try the pipeline.")
    hint = '--prompt "def fib(n):"' if not args.no_tokenizer else "--prompt-ids 1,2,3"
    print(f"Try: tessera generate --model {args.dir} {hint}")


def cmd_generate(args: argparse.Namespace) -> int:
    from gpu_workers.engine import InvalidRequest, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    try:
        params.validate()
    except InvalidRequest as exc:
        raise CliError(exc.message, exit_code=2) from None
    if (args.prompt or args.stop) and args.model.is_dir() and not (args.model / "tokenizer.json").is_file():
        raise CliError(
            f"{args.model} has no tokenizer.json, so --prompt and --stop cannot be used; "
            "pass prompts as token ids with --prompt-ids",
            exit_code=2,
        )
    prompts = args.prompt or args.prompt_ids
    engine = load_engine(args)
    if args.json:
        outputs = engine.generate(prompts, params)
        for out in outputs:
            print(json.dumps(out.to_dict(), ensure_ascii=False))
        return 1 if any(out.error for out in outputs) else 0
    if len(prompts) == 1:
        return stream_one(engine, prompts[0], params)
    failed = False
    for i, out in enumerate(engine.generate(prompts, params)):
        print(f"--- prompt {i}: {out.finish_reason}, {len(out.token_ids)} tokens ---")
        print(out.text if engine.tokenizer is not None else " ".join(map(str, out.token_ids)))
        if out.error:
            failed = True
            print(f"tessera: error: prompt {i}: {out.error.message}", file=sys.stderr)
    return 1 if failed else 0


def stream_one(engine, prompt, params) -> int:
    """Print tokens as they are generated: text with a tokenizer, token ids without one."""
    for event in engine.stream(prompt, params):
        if event.error:
            print(f"tessera: error: {event.error.message}", file=sys.stderr)
            return 1
        chunk = event.text if engine.tokenizer is not None else "".join(f"{t} " for t in event.token_ids)
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> None:
    from tessera.bench_engine import run_engine_bench

    run_engine_bench(args)


if __name__ == "__main__":
    sys.exit(main())
