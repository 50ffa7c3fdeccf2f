"""``tessera billing prices set|show``: the price book (``billing.prices``), in integer micro-USD per million
tokens. A new price is a new version, effective from ``--effective-from`` (default: now); requests already
in the ledger keep the version they were priced with."""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tessera.cli.admin import emit, open_session
from tessera.cli.common import CliError


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database-url", metavar="URL", help="default: TESSERA_DATABASE_URL, else SQLite under the data dir"
    )
    common.add_argument(
        "--data-dir", type=Path, metavar="DIR", help="data folder (default: TESSERA_DATA_DIR, else .tessera)"
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")

    group = subparsers.add_parser("billing", help="the price book (usage is at GET /v1/usage)")
    commands = group.add_subparsers(dest="billing_command", required=True, metavar="COMMAND")
    prices = commands.add_parser("prices", help="set or show model prices")
    actions = prices.add_subparsers(dest="prices_command", required=True, metavar="ACTION")
    setter = actions.add_parser("set", parents=[common], help="add a new version of a model's price")
    setter.add_argument("model", help="the model id ('*': the default for models without a price)")
    for flag, what in (("fresh", "fresh input"), ("cached", "cached input"), ("output", "output")):
        setter.add_argument(
            f"--{flag}",
            type=micro_usd,
            required=True,
            metavar="MICRO_USD",
            help=f"micro-USD per million {what} tokens (a whole number; 950000 = $0.95)",
        )
    setter.add_argument(
        "--effective-from",
        type=aware_datetime,
        metavar="ISO8601",
        help="when it takes effect (default: now; UTC unless the time names a zone)",
    )
    setter.set_defaults(func=cmd_prices_set)
    show = actions.add_parser("show", parents=[common], help="every version of every price (or one model's)")
    show.add_argument("model", nargs="?", help="only this model")
    show.set_defaults(func=cmd_prices_show)


def micro_usd(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of micro-USD >= 0, got {value!r}")
    return number


def aware_datetime(value: str) -> datetime:
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an ISO 8601 date or time, got {value!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def cmd_prices_set(args: argparse.Namespace) -> None:
    import billing

    try:
        spec = billing.PriceSpec(fresh_input=args.fresh, cached_input=args.cached, output=args.output)
    except ValueError as exc:
        raise CliError(str(exc), exit_code=2) from None
    with open_session(args) as session:
        price = billing.set_price(session, args.model, spec, effective_from=args.effective_from)
        rows = [price_row(price)]
    emit(args, rows, title=f"New price of {args.model}")


def cmd_prices_show(args: argparse.Namespace) -> None:
    import billing

    with open_session(args) as session:
        rows = [price_row(p) for p in billing.list_prices(session, args.model)]
    emit(args, rows, title="Prices (micro-USD per million tokens)")


def price_row(price: Any) -> dict[str, Any]:
    return {
        "model": price.model,
        "version": price.version,
        "effective_from": price.effective_from,
        "fresh_input": price.fresh_input_per_mtok,
        "cached_input": price.cached_input_per_mtok,
        "output": price.output_per_mtok,
    }
