"""``tessera deployments``: create, list, show and update deployments (validated and audited by
``tessera.deployments``) from the command line; results go to stdout (tables, or JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, get_args

from tessera.cli.common import parse_bytes, parse_optional_int
from tessera.cli.database import cli_actor, database_options, open_session
from tessera.cli.output import cell, emit, json_default, json_option, rich_console

if TYPE_CHECKING:  # imported inside the commands: SQLAlchemy, pydantic and rich would slow every `tessera`
    from tessera.deployments import Deployment, DeploymentAudit


class DeploymentParser(argparse.ArgumentParser):
    """A ``tessera deployments`` command. With ``deployment_flags`` it takes the deployment fields as flags,
    added when the command is parsed: they are derived from ``DeploymentConfig``, whose pydantic and
    SQLAlchemy imports every other ``tessera`` command goes without."""

    def __init__(
        self, *args: Any, deployment_flags: bool = False, checkpoint_required: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.deployment_flags, self.checkpoint_required = deployment_flags, checkpoint_required

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.deployment_flags:
            add_deployment_options(self, checkpoint_required=self.checkpoint_required)
            self.deployment_flags = False
        return super().parse_known_args(args, namespace)


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    common, as_json = database_options(), json_option()
    deployments = subparsers.add_parser("deployments", help="create, list, show, update deployments")
    dep_commands = deployments.add_subparsers(
        dest="deployments_command", required=True, metavar="ACTION", parser_class=DeploymentParser
    )
    create = dep_commands.add_parser(
        "create",
        parents=[common, as_json],
        help="create a deployment (a model tenants can call)",
        deployment_flags=True,
        checkpoint_required=True,
    )
    create.add_argument("name", metavar="NAME", help="the model id tenants call, e.g. @tessera/demo")
    create.set_defaults(func=cmd_deployments_create)
    listing = dep_commands.add_parser("list", parents=[common, as_json], help="list deployments")
    listing.set_defaults(func=cmd_deployments_list)
    show = dep_commands.add_parser(
        "show", parents=[common, as_json], help="a deployment's config and changes"
    )
    show.add_argument("name", metavar="NAME")
    show.add_argument(
        "--audit", type=int, default=10, metavar="N", help="recent changes to show (default 10)"
    )
    show.set_defaults(func=cmd_deployments_show)
    update = dep_commands.add_parser(
        "update",
        parents=[common, as_json],
        help="change a deployment's config (validated and audited)",
        deployment_flags=True,
    )
    update.add_argument("name", metavar="NAME")
    update.set_defaults(func=cmd_deployments_update)


def add_deployment_options(parser: argparse.ArgumentParser, checkpoint_required: bool = False) -> None:
    """A flag per editable ``DeploymentConfig`` field: its name with dashes, its description (and default)
    as help. An unset flag leaves no attribute (create: the default; update: unchanged). Values are
    validated by ``tessera.deployments``, which lists every problem and names the allowed values."""
    from tessera.deployments import EDITABLE_FIELDS, DeploymentConfig

    unset = argparse.SUPPRESS
    for name in EDITABLE_FIELDS:
        field = DeploymentConfig.model_fields[name]
        flag, help_ = f"--{name.replace('_', '-')}", field.description
        if field.default is not None and not field.is_required():
            help_ = f"{help_} (default: {str(field.default).lower()})"
        if name == "enabled":  # --enable / --disable read better than --enabled / --no-enabled
            enabled = parser.add_mutually_exclusive_group()
            enabled.add_argument(
                "--enable", dest=name, action="store_const", const=True, default=unset, help="serve requests"
            )
            enabled.add_argument(
                "--disable",
                dest=name,
                action="store_const",
                const=False,
                default=unset,
                help="refuse requests",
            )
        elif field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=unset, help=help_)
        elif name == "checkpoint":
            parser.add_argument(flag, required=checkpoint_required, default=unset, metavar="DIR", help=help_)
        else:
            parser.add_argument(flag, default=unset, help=help_, **_value_options(name, field.annotation))
    parser.add_argument(
        "--no-checkpoint-check",
        dest="check_checkpoint",
        action="store_false",
        help="skip checking the checkpoint folder (when it exists only on the worker hosts)",
    )


def _value_options(name: str, annotation: Any) -> dict[str, Any]:
    """How a flag reads its value. A choice is not checked here, so that a bad one is reported with every
    other problem of the config."""
    if annotation is int and name.endswith("_bytes"):
        return {"type": parse_bytes, "metavar": "B"}
    if annotation is int:
        return {"type": int, "metavar": "N"}
    if annotation == int | None:
        return {"type": parse_optional_int, "metavar": "N"}  # auto: null
    return {"metavar": "{" + ",".join(get_args(annotation)) + "}"}


def cmd_deployments_create(args: argparse.Namespace) -> None:
    from tessera import deployments

    with open_session(args) as session:
        deployment = deployments.create_deployment(
            session,
            {"name": args.name, **deployment_changes(args)},
            actor=cli_actor(),
            check_checkpoint_files=args.check_checkpoint,
        )
        emit_deployment(
            args, deployment, deployments.deployment_audit(session, args.name, limit=1), "Deployment created"
        )


LIST_COLUMNS = (
    "name",
    "mode",
    "prefill_kv",
    "decode_kv",
    "decode_weights",
    "page_size",
    "enabled",
    "checkpoint",
)


def cmd_deployments_list(args: argparse.Namespace) -> None:
    from tessera import deployments

    with open_session(args) as session:
        rows = [deployment_row(d) for d in deployments.list_deployments(session)]
    if not args.json:
        rows = [{k: row[k] for k in LIST_COLUMNS} for row in rows]
    emit(args, rows, title="Deployments")


def cmd_deployments_show(args: argparse.Namespace) -> None:
    from tessera import deployments

    with open_session(args) as session:
        deployment = deployments.get_deployment(session, args.name)
        audit = deployments.deployment_audit(session, args.name, limit=args.audit)
        emit_deployment(args, deployment, audit, title=f"Deployment {args.name}")


def cmd_deployments_update(args: argparse.Namespace) -> None:
    from tessera import deployments

    changes = deployment_changes(args)
    if not changes:
        raise ValueError(
            "nothing to update: pass the fields to change, e.g. --decode-kv fp8_e4m3 or --disable "
            "(`tessera deployments update --help` lists them)"
        )
    with open_session(args) as session:
        before = deployments.deployment_config(deployments.get_deployment(session, args.name))
        deployment = deployments.update_deployment(
            session, args.name, changes, actor=cli_actor(), check_checkpoint_files=args.check_checkpoint
        )
        changed = deployments.deployment_config(deployment) != before
        if not changed:
            print("No change: the deployment already has these values.", file=sys.stderr)
        latest = deployments.deployment_audit(session, args.name, limit=1) if changed else []
        emit_deployment(args, deployment, latest, title=f"Deployment {args.name}")


def deployment_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The deployment fields given on the command line (unset flags left no attribute)."""
    from tessera import deployments

    return {name: getattr(args, name) for name in deployments.EDITABLE_FIELDS if hasattr(args, name)}


def deployment_row(deployment: Deployment) -> dict[str, Any]:
    from tessera import deployments

    return {
        "name": deployment.name,
        **deployments.deployment_config(deployment).model_dump(exclude={"name"}),
        "created_at": deployment.created_at,
        "updated_at": deployment.updated_at,
    }


def audit_row(entry: DeploymentAudit) -> dict[str, Any]:
    return {"at": entry.created_at, "actor": entry.actor, "action": entry.action, "changes": entry.changes}


def emit_deployment(
    args: argparse.Namespace, deployment: Deployment, audit: list[DeploymentAudit], title: str
) -> None:
    row = deployment_row(deployment)
    if args.json:
        print(json.dumps({**row, "audit": [audit_row(a) for a in audit]}, default=json_default))
        return
    from rich.table import Table

    console = rich_console()
    table = Table(title=title)
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in row.items():
        table.add_row(key, cell(value))
    console.print(table)
    if audit:
        changes = Table("at", "actor", "action", "changes", title="Changes (newest first)")
        for entry in audit:
            summary = (
                "initial config"
                if entry.action == "create"
                else ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in entry.changes.items())
            )
            changes.add_row(cell(entry.created_at), entry.actor, entry.action, summary)
        console.print(changes)
