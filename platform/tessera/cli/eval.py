"""``tessera eval``: ``quality`` (a model's memory-format variants against its baseline), ``lm`` (held-out
loss of one or more models side by side, in bits per byte and by position) and ``completions`` (greedy
completions of fixed function and class heads: the share that parses, repeated 4-grams), ``tools`` (the
tool-call suite through a running API) and ``structured`` (answers under 20 JSON Schemas through the API).

``add_commands`` registers ``eval`` on the main parser's subcommands; gpu_workers (and torch) load only
when the command runs. User errors raise ValueError, which ``tessera.cli.main`` prints without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tessera import SHIPPED_MODEL_DIR
from tessera.cli.common import CliError, parse_positive_int

TOKEN_METRICS = (
    ("perplexity", "perplexity", "{:.3f}"),
    ("perplexity_delta_pct", "Δ ppl %", "{:+.3f}"),
    ("kl_mean", "KL mean", "{:.5f}"),
    ("kl_p99", "KL p99", "{:.4f}"),
    ("top1_agreement", "top-1 agree", "{:.4f}"),
)
ENGLISH_METRICS = (*TOKEN_METRICS, ("chat_exact_match", "chat exact", "{:.2f}"))
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
        help="perplexity, KL, top-1 agreement and greedy exact match per memory-format variant",
        description="Score a text with the baseline and each variant; every metric comes with a paired "
        "bootstrap 95%% interval. --text english (the default for a model with a chat template): chunks of "
        "the standard library's English prose, pydoc_data/topics.py (the reference manual's text that "
        "help() shows), and greedy answers to 20 fixed chat prompts in the model's chat template (how many "
        "change vs the baseline); intervals over chunks and over prompts. The baseline is fp32 on "
        "unquantised weights (a GGUF's Q4 blocks dequantised) and the default variants run in bf16, as "
        "served: dtype=bfloat16 alone is the bf16-vs-fp32 floor the others are read against. --text python "
        "(the default otherwise): the held-out standard-library files (the training split's rule), "
        "greedy continuations and the valid-Python share of sampled completions; intervals over files. "
        "A variant is KEY=VALUE[+KEY=VALUE] with KEY kv (auto, bf16, int8, fp8_e4m3), weights (bf16, fp8, int4: "
        "a GGUF's Q4_0/Q4_1 as stored, other weights quantised to int4 groups of 128) or dtype (bfloat16, "
        "float16, float32); a variant that cannot load reports its error and the others still run.",
    )
    q.add_argument(
        "--model",
        type=Path,
        default=SHIPPED_MODEL_DIR,
        metavar="PATH",
        help="checkpoint folder or GGUF file (default pycode-tiny)",
    )
    q.add_argument(
        "--text",
        choices=("english", "python"),
        help="english (pydoc topics and chat prompts) or python (held-out stdlib files); default english "
        "for a model with a chat template, else python",
    )
    q.add_argument(
        "--baseline", metavar="B", help="bf16, fp16 or fp32 (default fp32 for english, bf16 for python)"
    )
    q.add_argument(
        "--variants",
        metavar="V,V",
        help="comma-separated variants (default for english: dtype=bfloat16, then FP8 KV, INT4 weights and "
        "both, each +dtype=bfloat16; for python: kv=fp8_e4m3,weights=int4,weights=fp8)",
    )
    q.add_argument(
        "--chunks",
        type=parse_positive_int,
        metavar="N",
        help="english: pydoc topics scored, one chunk from the start of each (default 12)",
    )
    q.add_argument(
        "--chunk-tokens",
        type=parse_positive_int,
        metavar="T",
        help="english: tokens per chunk (default 512)",
    )
    q.add_argument(
        "--chat-prompts",
        type=parse_positive_int,
        metavar="N",
        help="english: the first N of the 20 fixed chat prompts (default all 20)",
    )
    q.add_argument(
        "--chat-tokens",
        type=parse_positive_int,
        metavar="T",
        help="english: greedy tokens per answer at most (default 48)",
    )
    q.add_argument("--max-files", type=int, metavar="N", help="python: only the first N held-out files")
    q.add_argument(
        "--max-tokens-per-file",
        type=int,
        metavar="T",
        help="python: score only the first T tokens of each file",
    )
    q.add_argument(
        "--seeds",
        type=int,
        default=3,
        metavar="S",
        help="python: sampling seeds for valid-Python (default 3)",
    )
    q.add_argument("--json", action="store_true", help="print one JSON object keyed by variant")
    q.set_defaults(func=cmd_eval_quality)

    lm = evals.add_parser(
        "lm",
        help="held-out loss per model: nats/token, perplexity, bits per byte, loss by position bucket",
        description="Score the held-out standard-library files (the training split's rule) with each "
        "model, each at its own context (max_position_embeddings) unless --context is given, in one run: "
        "nats per token, perplexity and bits per byte (tokenizer-independent) with bootstrap 95% "
        "intervals over files, the bits-per-byte change of every model against the first, and the mean "
        "loss at positions 0-512, 512-1024, 1024-2048, ... of the files longer than the longest context.",
    )
    add_model_args(lm)
    lm.add_argument(
        "--context",
        type=parse_positive_int,
        metavar="N",
        help="score every model at N tokens (default: each model's max_position_embeddings)",
    )
    lm.add_argument(
        "--max-files", type=parse_positive_int, metavar="N", help="only the first N held-out files"
    )
    lm.add_argument(
        "--split",
        choices=("stdlib", "dependencies"),
        default="stdlib",
        help="the held-out standard-library files (default), or the held-out files of the dependencies' "
        "sources `--with-dependencies` trains on (as installed here; no model saw them)",
    )
    lm.add_argument("--json", action="store_true", help="print one JSON object")
    lm.set_defaults(func=cmd_eval_lm)

    comp = evals.add_parser(
        "completions",
        help="greedy completions of 20 fixed function and class heads: parse share, repeated 4-grams",
        description="Complete each of 20 fixed Python function and class heads greedily (temperature 0, "
        "float32, through the Engine) with each model; report the share that parses as Python for at "
        "least two whole code lines after the head and the share of repeated 4-grams of tokens "
        "(gpu_workers/tools/eval/completions.py defines both).",
    )
    add_model_args(comp)
    comp.add_argument(
        "--max-tokens",
        type=parse_positive_int,
        default=128,
        metavar="N",
        help="tokens per completion (default 128)",
    )
    comp.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        metavar="F",
        help="greedy after the API's repetition guard (OpenAI frequency_penalty, -2..2; default 0: plain greedy)",
    )
    comp.add_argument("--json", action="store_true", help="print one JSON object with every completion")
    comp.set_defaults(func=cmd_eval_completions)
    tools = evals.add_parser(
        "tools",
        help="the 111-case tool-call suite through a running API: valid calls, right tool, right arguments",
        description="Send each case of the tool-call suite (gpu_workers/tools/eval/tool_suite.py: ten tools "
        "with nested objects, enums, arrays and optional fields, three or four offered per case, some "
        "conversations carrying an earlier call and its result) to each model through the API with the "
        "OpenAI SDK, and report the share of calls that parse and validate against their tool's schema, the "
        "share of cases calling the expected tool and the share whose call holds the expected arguments, "
        "each with a 95%% Wilson interval. Modes: unconstrained (tool_choice auto, tools strict: false: "
        "nothing enforced), auto (a call constrained once started), required (a call forced and "
        "constrained). --stream-check sends every case streamed too and counts the answers that equal the "
        "non-streamed ones.",
    )
    tools.add_argument("--api-url", required=True, metavar="URL", help="the API, e.g. http://127.0.0.1:8787")
    tools.add_argument("--api-key", required=True, metavar="KEY", help="a tenant's API key")
    tools.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="[LABEL=]ID",
        help="a model id to evaluate, optionally labelled (repeatable), e.g. 'int4=@eval/smollm2-int4'",
    )
    tools.add_argument(
        "--mode",
        default="unconstrained,auto,required",
        help="comma-separated modes: unconstrained, auto, required (default: all three)",
    )
    tools.add_argument("--concurrency", type=parse_positive_int, default=16, metavar="N")
    tools.add_argument("--max-tokens", type=parse_positive_int, default=128, metavar="N")
    tools.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    tools.add_argument("--seed", type=int, default=0, help="case i is sent with seed SEED + i")
    tools.add_argument(
        "--limit", type=parse_positive_int, default=None, metavar="N", help="the first N cases"
    )
    tools.add_argument("--stream-check", action="store_true", help="send every case streamed too and compare")
    tools.add_argument("--json", action="store_true", help="print one JSON object with every run")
    tools.set_defaults(func=cmd_eval_tools)
    st = evals.add_parser(
        "structured",
        help="answers under 20 JSON Schemas through a running API: the share that parses and validates",
        description="Ask a model for JSON under each of 20 schemas (gpu_workers/tools/eval/structured.py: "
        "nested objects, arrays of objects, enums, patterns, numeric ranges) with response_format json_schema "
        "(strict) through the OpenAI SDK, PER_SCHEMA prompts each, and validate every answer with jsonschema; "
        "report the share that parses and validates with a 95%% Wilson interval and every failure.",
    )
    st.add_argument("--api-url", required=True, metavar="URL")
    st.add_argument("--api-key", required=True, metavar="KEY")
    st.add_argument("--model", required=True, metavar="ID")
    st.add_argument(
        "--per-schema", type=parse_positive_int, default=25, metavar="N", help="prompts per schema"
    )
    st.add_argument("--concurrency", type=parse_positive_int, default=16, metavar="N")
    st.add_argument("--max-tokens", type=parse_positive_int, default=256, metavar="N")
    st.add_argument("--temperature", type=float, default=1.0)
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--json", action="store_true", help="print one JSON object with every failure")
    st.set_defaults(func=cmd_eval_structured)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        action="append",
        metavar="DIR",
        help="checkpoint folder; repeat to compare models, the first is the reference (default pycode-tiny)",
    )


def model_dirs(args: argparse.Namespace) -> list[Path]:
    """The --model folders, checked: each exists once and holds a config.json and a tokenizer.json."""
    dirs = args.model or [SHIPPED_MODEL_DIR]
    for d in dirs:
        missing = [name for name in ("config.json", "tokenizer.json") if not (d / name).is_file()]
        if not d.is_dir():
            raise CliError(f"--model {d}: no such directory; expected a checkpoint folder", exit_code=2)
        if missing:
            raise CliError(
                f"--model {d}: not a checkpoint folder (no {' or '.join(missing)} in it); expected a Hugging "
                "Face folder with config.json, tokenizer.json and model.safetensors",
                exit_code=2,
            )
    if len({str(d) for d in dirs}) < len(dirs):
        raise CliError("each --model may be given once", exit_code=2)
    return dirs


def cmd_eval_quality(args: argparse.Namespace) -> int:
    import torch

    from gpu_workers.tokenizer import load_tokenizer
    from gpu_workers.tools.eval.quality import DEFAULT_BASELINE, DEFAULT_VARIANTS, EvalSettings, run_quality

    for name in ("max_files", "max_tokens_per_file", "seeds"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise CliError(f"--{name.replace('_', '-')} must be positive, got {value}", exit_code=2)
    if not args.model.exists():
        raise CliError(
            f"--model {args.model}: no such file or folder; expected a checkpoint folder or a GGUF"
        )
    text = args.text
    if text is None:
        tokenizer = load_tokenizer(args.model)
        text = "english" if tokenizer is not None and tokenizer.has_chat_template else "python"
    torch.manual_seed(0)
    given = ("chunks", "chunk_tokens", "chat_prompts", "chat_tokens")
    settings = EvalSettings(
        text=text,
        max_files=args.max_files,
        max_tokens_per_file=args.max_tokens_per_file,
        seeds=args.seeds,
        **{name: getattr(args, name) for name in given if getattr(args, name) is not None},
    )
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    results = run_quality(
        args.model,
        args.baseline or DEFAULT_BASELINE[text],
        list(variants or DEFAULT_VARIANTS[text]),
        settings,
        log=lambda m: print(m, file=sys.stderr),
    )
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_table(results, text))
    return 0


def format_table(results: dict[str, dict], text: str = "python") -> str:
    """A markdown table, one row per variant, each number followed by its 95% interval."""
    metrics = ENGLISH_METRICS if text == "english" else TABLE_METRICS
    extra = ["chat answers changed"] if text == "english" else []
    labels = [label for _, label, _ in metrics] + extra
    lines = ["| variant | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |")
            continue
        cells = []
        for key, _, fmt in metrics:
            lo, hi = r[f"{key}_ci95"]
            cells.append(f"{fmt.format(r[key])} [{fmt.format(lo)}, {fmt.format(hi)}]")
        if text == "english":
            cells.append(f"{r['chat_answers_changed']}/{r['chat_prompts']}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    first = next(r for r in results.values() if "error" not in r)
    if text == "english":
        lines.append(
            f"\n{first['chunks']} chunks of {first['text']}, {first['tokens']} scored tokens; "
            f"{first['chat_prompts']} chat prompts, greedy; [95% bootstrap interval over chunks, "
            "over prompts for chat exact match]"
        )
    else:
        lines.append(
            f"\n{first['files']} files, {first['tokens']} scored tokens, {first['greedy_prompts']} greedy "
            f"prompts, {first['completions']} sampled completions per variant; [95% bootstrap interval over files]"
        )
    return "\n".join(lines)


def cmd_eval_lm(args: argparse.Namespace) -> int:
    from gpu_workers.tools.eval.heldout import heldout_texts
    from gpu_workers.tools.eval.lm import run_lm

    dirs = model_dirs(args)
    texts = heldout_texts(dirs, args.max_files, args.split)
    results = run_lm(dirs, texts, args.context, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(results, indent=2) if args.json else format_lm(results))
    return 0


def format_lm(results: dict) -> str:
    """Two markdown tables, one row per model: the held-out loss, and the loss by position bucket."""
    models = results["models"]
    lines = [
        "| model | context | targets | nats/token | perplexity | bits/byte | Δ bpb vs first |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in models.items():
        change = _with_ci(r, "bpb_change_pct", "{:+.2f}%") if "bpb_change_pct" in r else "(reference)"
        cells = [
            str(r["context"]),
            str(r["targets"]),
            _with_ci(r, "nats_per_token", "{:.4f}"),
            _with_ci(r, "perplexity", "{:.2f}"),
            _with_ci(r, "bits_per_byte", "{:.4f}"),
            change,
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        f"\n{results['files']} held-out files, {results['bytes']} bytes; [95% bootstrap interval over files]"
    )
    if not results["bucket_files"]:
        lines.append(
            f"\nloss by position: no held-out file is longer than {results['bucket_context']} tokens"
        )
        return "\n".join(lines)
    ranges = max((r["position_buckets"] for r in models.values()), key=len)
    header = [f"{b['positions'][0]}–{b['positions'][1]}" for b in ranges]
    lines += [
        "\n| model | " + " | ".join(header) + " | last − first |",
        "|---" * (len(header) + 2) + "|",
    ]
    for name, r in models.items():
        buckets = r["position_buckets"]
        cells = [_with_ci(b, "loss", "{:.4f}") for b in buckets] + [""] * (len(header) - len(buckets))
        last = buckets[-1]
        cells.append(_with_ci(last, "minus_first", "{:+.4f}") if "minus_first" in last else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        f"\nmean loss (nats/token) by position in the file, over the first window of the "
        f"{len(results['bucket_files'])} files longer than {results['bucket_context']} tokens: "
        + ", ".join(results["bucket_files"])
    )
    return "\n".join(lines)


def _with_ci(r: dict, key: str, fmt: str) -> str:
    lo, hi = r[f"{key}_ci95"]
    return f"{fmt.format(r[key])} [{fmt.format(lo)}, {fmt.format(hi)}]"


def head_label(head: str) -> str:
    """A head on one line: its class, decorator and def lines (the first line if it has none)."""
    keep = [
        line.strip()
        for line in head.splitlines()
        if line.strip().startswith(("def ", "async def ", "class ", "@"))
    ]
    label = " ".join(keep or head.splitlines()[:1])
    return (label if len(label) <= 70 else label[:69] + "…").replace("|", "\\|")


def cmd_eval_structured(args: argparse.Namespace) -> int:
    from gpu_workers.tools.eval.structured import run_structured_eval

    result = run_structured_eval(
        args.api_url, args.api_key, args.model, args.per_schema, args.concurrency, args.max_tokens,
        args.temperature, args.seed, progress=lambda m: print(m, file=sys.stderr),
    )  # fmt: skip
    print(
        json.dumps(result, indent=2)
        if args.json
        else f"{result['valid_of_finished']}/{result['answers']} valid"
    )
    return 0 if result["valid_of_finished"] == result["answers"] else 1


def cmd_eval_tools(args: argparse.Namespace) -> int:
    from gpu_workers.tools.eval.tool_calls import format_row, run_tool_eval

    models = {}
    for spec in args.model:
        label, _, model = spec.rpartition("=")
        models[label or model] = model
    results = run_tool_eval(
        args.api_url,
        args.api_key,
        models,
        [m.strip() for m in args.mode.split(",") if m.strip()],
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        stream_check=args.stream_check,
        limit=args.limit,
        progress=lambda m: print(m, file=sys.stderr),
    )
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for row in results["runs"]:
            print(f"{row['label']:<16} {row['mode']:<14} {format_row(row)}")
    return 0


def cmd_eval_completions(args: argparse.Namespace) -> int:
    from gpu_workers.tools.eval.completions import run_completions

    if not -2.0 <= args.frequency_penalty <= 2.0:
        raise CliError(f"--frequency-penalty must be in [-2, 2], got {args.frequency_penalty}")
    results = run_completions(
        model_dirs(args),
        args.max_tokens,
        log=lambda m: print(m, file=sys.stderr),
        frequency_penalty=args.frequency_penalty,
    )
    print(json.dumps(results, indent=2) if args.json else format_completions(results))
    return 0


def format_completions(results: dict) -> str:
    """A summary table with one column per model, then each head's outcome per model."""
    models = results["models"]
    names = list(models)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    rows = (
        ("parses (≥ 2 code lines)", lambda r: f"{r['parses']}/{r['heads']} ({r['parse_share']:.0%})"),
        ("repeated 4-grams", lambda r: f"{r['repeated_4gram_share']:.3f}"),
        ("tokens per completion", lambda r: f"{r['tokens_mean']:.1f}"),
        ("ended by end-of-file", lambda r: f"{r['ended_by_eos']}/{r['heads']}"),
    )
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(models[n]) for n in names) + " |")
    lines += ["\n| head | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for i, completion in enumerate(models[names[0]]["completions"]):
        cells = []
        for n in names:
            c = models[n]["completions"][i]
            share = c["repeated_4grams"] / c["4grams"] if c["4grams"] else 0.0
            cells.append(f"{'✓' if c['parses'] else '✗'} {c['lines_parsed']} lines, rep {share:.2f}")
        lines.append(f"| {i + 1}. `{head_label(completion['head'])}` | " + " | ".join(cells) + " |")
    lines.append(
        f"\n{len(models[names[0]]['completions'])} heads, greedy"
        + (
            f" with frequency_penalty {results['frequency_penalty']}"
            if results.get("frequency_penalty")
            else ""
        )
        + f", up to {results['max_tokens']} tokens; "
        "lines = code lines after the head that still parse; rep = repeated 4-gram share of the completion"
    )
    return "\n".join(lines)
