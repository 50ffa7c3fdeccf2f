"""``tessera quotas set|show``: a tenant's quota limits and its keys' overrides (``tessera.quota_config``).

Every API process applies a change within about a second, without a restart. The spend budget is given and
shown in USD (``--monthly-spend-usd 25.50``) and stored in micro-USD.
"""

from __future__ import annotations

import argparse
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from tessera.cli.common import CliError
from tessera.cli.database import open_session
from tessera.cli.output import emit
from tessera.limits import LIMITS, Limits

UNLIMITED = ("none", "unlimited")
_HELP = {
    "rpm": "requests per minute (sliding window)",
    "tpm": "tokens per minute: prompt + max_tokens reserved at admission, settled to the actual use",
    "concurrency": "requests in flight at once",
    "daily_tokens": "tokens per UTC day",
    "monthly_tokens": "tokens per UTC month",
}
SPEND = "monthly_spend"  # micro-USD in the database, USD on the command line
MICRO = 1_000_000


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database-url", metavar="URL", help="default: TESSERA_DATABASE_URL, else SQLite under the data dir"
    )
    common.add_argument(
        "--data-dir", type=Path, metavar="DIR", help="data folder (default: TESSERA_DATA_DIR, else .tessera)"
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common.add_argument("--tenant", required=True, metavar="NAME", help="the tenant (name or id)")

    quotas = subparsers.add_parser("quotas", help="set or show a tenant's quota limits")
    actions = quotas.add_subparsers(dest="quotas_command", required=True, metavar="ACTION")
    setter = actions.add_parser(
        "set",
        parents=[common],
        help="change limits (unnamed ones stay as they are; 'none' makes one unlimited)",
    )
    setter.add_argument(
        "--key",
        metavar="PREFIX",
        help="override the tenant's limits for this key only (`keys list` shows it)",
    )
    for name in LIMITS:
        if name == SPEND:
            continue
        setter.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=parse_limit,
            default=argparse.SUPPRESS,
            metavar="N",
            help=f"{_HELP[name]}; a whole number, or 'none'",
        )
    setter.add_argument(
        "--monthly-spend-usd",
        dest=SPEND,
        type=parse_usd,
        default=argparse.SUPPRESS,
        metavar="USD",
        help="spend per UTC month in USD (e.g. 25.50): each request reserves its prompt at the fresh price "
        "plus max_tokens at the output price, settled to its real cost; or 'none'",
    )
    setter.set_defaults(func=cmd_quotas_set)
    show = actions.add_parser("show", parents=[common], help="the tenant's limits and its keys' overrides")
    show.set_defaults(func=cmd_quotas_show)


def parse_limit(value: str) -> int | None:
    if value.strip().lower() in UNLIMITED:
        return None
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0 or 'none', got {value!r}")
    return number


def parse_usd(value: str) -> int | None:
    """USD (at most 6 decimals) as micro-USD, or None for 'none'."""
    if value.strip().lower() in UNLIMITED:
        return None
    try:
        number = Decimal(value.strip())
    except InvalidOperation:
        number = Decimal(-1)
    if not number.is_finite() or number < 0 or (number * MICRO) % 1:
        raise argparse.ArgumentTypeError(
            f"expected an amount in USD >= 0 with at most 6 decimals (e.g. 25.50), or 'none'; got {value!r}"
        )
    return int(number * MICRO)


def cmd_quotas_set(args: argparse.Namespace) -> None:
    from tessera import quota_config

    changes = {name: getattr(args, name) for name in LIMITS if hasattr(args, name)}
    if not changes:
        flags = ", ".join(f"--{n.replace('_', '-')}" + ("-usd" if n == SPEND else "") for n in LIMITS)
        raise CliError(f"name at least one limit to set: {flags}", exit_code=2)
    with open_session(args) as session:
        if args.key is None:
            current = quota_config.get_limits(session, args.tenant)
        else:
            current = quota_config.get_key_limits(session, args.key) or Limits()
        updated = Limits(**{name: changes.get(name, getattr(current, name)) for name in LIMITS})
        quota_config.set_limits(session, args.tenant, updated, key_prefix=args.key)
        rows = quota_rows(session, args.tenant)
    emit(args, rows, title=f"Quotas of {args.tenant}")


def cmd_quotas_show(args: argparse.Namespace) -> None:
    with open_session(args) as session:
        rows = quota_rows(session, args.tenant)
    emit(args, rows, title=f"Quotas of {args.tenant}")


def quota_rows(session, tenant: str) -> list[dict[str, Any]]:
    """The tenant's row, then one per key override (an unset key limit shows the tenant's, which applies)."""
    from tessera import quota_config

    limits = quota_config.get_limits(session, tenant)
    rows = [{"scope": "tenant", **limits_row(limits)}]
    for prefix, override in quota_config.list_key_limits(session, tenant).items():
        rows.append({"scope": f"key tsk_{prefix}", **limits_row(limits.merged(override))})
    return rows


def limits_row(limits: Limits) -> dict[str, Any]:
    row: dict[str, Any] = {name: getattr(limits, name) for name in LIMITS if name != SPEND}
    spend = limits.monthly_spend
    row["monthly_spend_usd"] = None if spend is None else spend / MICRO
    return row
