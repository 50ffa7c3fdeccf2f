"""The ``tessera`` command line: ``main`` builds the parser from one module per command group and runs the
command. Commands import ``gpu_workers`` (and so torch) only when they run."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tessera.cli import admin, bench, billing, database, deployments, kv, model, quant, quotas, serve
from tessera.cli import eval as eval_
from tessera.cli.common import run_command


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera: multi-tenant LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (
        model,
        bench,
        kv,
        database,
        admin,
        deployments,
        quotas,
        billing,
        serve,
        eval_,
        quant,
    ):  # the order `tessera --help` lists them in
        group.add_commands(commands)
    return parser
