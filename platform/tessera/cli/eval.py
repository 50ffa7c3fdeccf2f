"""``tessera eval quality``: a model's memory-format variants measured against its baseline.

``add_commands`` registers ``eval`` on the main parser's subcommands; gpu_workers (and torch) load only
when the command runs. User errors raise ValueError, which ``tessera.cli.main`` prints without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tessera import SHIPPED_MODEL_DIR
from tessera.cli.common import CliError

DEFAULT_VARIANTS = "kv=fp8_e4m3,weights=int4,weights=fp8"
TABLE_METRICS = (
    ("perplexity", "perplexity", "{:.3f}"),
    ("perplexity_delta_pct", "Δ ppl %", "{:+.3f}"),
    ("kl_mean", "KL mean", "{:.5f}"),
    ("kl_p99", "KL p99", "{:.4f}"),
    ("top1_agreement", "top-1 agree", "{:.4f}"),
    ("exact_match_32", "exact@32", "{:.3f}"),
    ("exact_match_128", "exact@128", "{:.3f}"),
    ("valid_python", "valid Python", "{:.3f}"),
)


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    ev = subparsers.add_parser("eval", help="evaluations")
    evals = ev.add_subparsers(dest="eval", required=True, metavar="EVAL")
    q = evals.add_parser(
        "quality",
        help="perplexity, KL, top-1 agreement, greedy exact match and valid-Python share per format variant",
        description="Score the held-out standard-library files (the training split's rule) with the "
        "baseline and each variant; every metric comes with a bootstrap 95%% interval over files. "
        "A variant is KEY=VALUE[+KEY=VALUE] with KEY kv (auto, bf16, fp8_e4m3), weights (bf16, fp8, int4) "
        "or dtype; a variant that cannot load reports its error and the others still run.",
    )
    q.add_argument(
        "--model",
        type=Path,
        default=SHIPPED_MODEL_DIR,
        metavar="DIR",
        help="checkpoint (default pycode-tiny)",
    )
    q.add_argument("--baseline", default="bf16", metavar="B", help="bf16 (default), fp16 or fp32")
    q.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        metavar="V,V",
        help=f"comma-separated variants (default {DEFAULT_VARIANTS})",
    )
    q.add_argument("--max-files", type=int, metavar="N", help="only the first N held-out files")
    q.add_argument(
        "--max-tokens-per-file", type=int, metavar="T", help="score only the first T tokens of each file"
    )
    q.add_argument(
        "--seeds", type=int, default=3, metavar="S", help="sampling seeds for valid-Python (default 3)"
    )
    q.add_argument("--json", action="store_true", help="print one JSON object keyed by variant")
    q.set_defaults(func=cmd_eval_quality)


def cmd_eval_quality(args: argparse.Namespace) -> int:
    import torch

    from gpu_workers.tools.eval.quality import EvalSettings, run_quality

    for name in ("max_files", "max_tokens_per_file", "seeds"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise CliError(f"--{name.replace('_', '-')} must be positive, got {value}", exit_code=2)
    if not (args.model / "tokenizer.json").exists():
        raise ValueError(f"{args.model} has no tokenizer.json; the evaluation encodes text with it")
    torch.manual_seed(0)
    settings = EvalSettings(
        max_files=args.max_files, max_tokens_per_file=args.max_tokens_per_file, seeds=args.seeds
    )
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    results = run_quality(
        args.model, args.baseline, variants, settings, log=lambda m: print(m, file=sys.stderr)
    )
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_table(results))
    return 0


def format_table(results: dict[str, dict]) -> str:
    """A markdown table, one row per variant, each number followed by its 95% interval."""
    lines = [
        "| variant | " + " | ".join(label for _, label, _ in TABLE_METRICS) + " |",
        "|---" * (len(TABLE_METRICS) + 1) + "|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |")
            continue
        cells = []
        for key, _, fmt in TABLE_METRICS:
            lo, hi = r[f"{key}_ci95"]
            cells.append(f"{fmt.format(r[key])} [{fmt.format(lo)}, {fmt.format(hi)}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    first = next(r for r in results.values() if "error" not in r)
    lines.append(
        f"\n{first['files']} files, {first['tokens']} scored tokens, {first['greedy_prompts']} greedy prompts, "
        f"{first['completions']} sampled completions per variant; [95% bootstrap interval over files]"
    )
    return "\n".join(lines)
