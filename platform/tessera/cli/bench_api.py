"""``tessera bench gateway|serving|serve|matrix|usage``: the benches that send requests through the HTTP
API, to a gateway or `tessera up` they start or to a server already running, and measure what clients see.

Each ``add_*`` registers one bench's flags and its ``cmd_*`` checks them and calls a ``tessera.bench``
driver, loaded only when the bench runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tessera.bench.gateway_harness import DEFAULT_REDIS_URL
from tessera.cli.common import CliError, parse_ids, parse_positive_float, parse_positive_int, require_positive


def add_gateway(benches: argparse._SubParsersAction) -> None:
    """Register ``bench gateway``."""
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


def cmd_gateway(args: argparse.Namespace) -> None:
    from tessera.bench.gateway import run_gateway

    require_positive(args, "requests", "concurrency", "rounds")
    run_gateway(args.requests, args.concurrency, args.rounds, args.redis_url, args.json)


def add_serving(benches: argparse._SubParsersAction) -> None:
    """Register ``bench serving``."""
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


def cmd_serving(args: argparse.Namespace) -> None:
    from tessera.bench.serving import run_serving

    require_positive(args, "concurrency", "max_tokens", "rounds")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads needs a positive integer, got {args.threads}", exit_code=2)
    if args.local_prefill_max_tokens is not None and args.local_prefill_max_tokens < 0:
        raise CliError("--local-prefill-max-tokens needs 0 or more tokens", exit_code=2)
    run_serving(
        args.concurrency, args.max_tokens, args.rounds, args.threads, args.json, args.local_prefill_max_tokens
    )


def add_serve(benches: argparse._SubParsersAction) -> None:
    """Register ``bench serve``."""
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


def add_matrix(benches: argparse._SubParsersAction) -> None:
    """Register ``bench matrix``."""
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


def add_usage(benches: argparse._SubParsersAction) -> None:
    """Register ``bench usage``."""
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
