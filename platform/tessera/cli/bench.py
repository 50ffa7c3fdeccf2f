"""``tessera bench ...``: the benchmarks' flags, checked here; the measuring is ``tessera.bench``'s.

One module per group of benches registers each bench's flags and handler: bench_engine (the engine, KV
cache, kernels and weight formats in-process), bench_api (through the HTTP API) and bench_models (the
embedding path, GGUF and grammars on the bundled models). Each handler turns its flags into plain arguments
and calls one ``run_*`` driver; drivers (and through them gpu_workers and torch) load only when a bench runs.
"""

from __future__ import annotations

import argparse

from tessera.cli import bench_api, bench_engine, bench_models


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``bench`` and every bench under it."""
    bench = commands.add_parser("bench", help="benchmarks")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for add in (
        bench_engine.add_engine,
        bench_engine.add_integrity,
        bench_engine.add_prefix,
        bench_engine.add_kv_formats,
        bench_api.add_gateway,
        bench_engine.add_kernels,
        bench_engine.add_weights,
        bench_api.add_serving,
        bench_api.add_serve,
        bench_api.add_matrix,
        bench_api.add_usage,
        bench_models.add_embeddings,
        bench_models.add_gguf,
        bench_models.add_grammar,
        bench_models.add_grammar_engine,
    ):  # the order `tessera bench --help` lists them in
        add(benches)
