"""``tessera db``, ``tenants``, ``keys``, ``deployments`` and ``audit``: the control plane's database from the
command line.

``add_commands`` registers them on the main parser's subcommands. Every command takes ``--database-url`` and
``--data-dir`` (default: the ``TESSERA_*`` settings). User errors raise ValueError, which ``tessera.cli.main``
prints without a traceback; results go to stdout (tables, or JSON with ``--json``), notes to stderr.

About 500 lines, kept as one module: the four groups share the database options, the migration-checked
session, the row builders and the table/JSON output, and each group alone is too small to stand apart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.cli.common import parse_bytes, parse_optional_int

if TYPE_CHECKING:  # imported inside the commands: SQLAlchemy, pydantic and rich would slow every `tessera`
    from sqlalchemy.orm import Session

    from tessera.auth import KeyVersion
    from tessera.models import ApiKey, AuditEvent, Deployment, DeploymentAudit, Tenant
    from tessera.settings import Settings


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database-url",
        metavar="URL",
        help="sqlite:///PATH or postgresql://USER@HOST/DB (default: TESSERA_DATABASE_URL, else SQLite "
        "under the data dir)",
    )
    common.add_argument(
        "--data-dir", type=Path, metavar="DIR", help="data folder (default: TESSERA_DATA_DIR, else .tessera)"
    )
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON instead of a table")

    database = subparsers.add_parser("db", help="create or migrate the database schema")
    db_commands = database.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    up = db_commands.add_parser("upgrade", parents=[common], help="migrate the schema up (to the newest)")
    up.add_argument("--revision", default="head", metavar="REV", help="target revision (default head)")
    up.set_defaults(func=cmd_db_upgrade)
    down = db_commands.add_parser("downgrade", parents=[common], help="migrate the schema down")
    down.add_argument("revision", metavar="REV", help="target revision; 'base' drops every table")
    down.set_defaults(func=cmd_db_downgrade)

    tenants = subparsers.add_parser("tenants", help="create, list, disable tenants")
    tenant_commands = tenants.add_subparsers(dest="tenants_command", required=True, metavar="ACTION")
    create = tenant_commands.add_parser("create", parents=[common, as_json], help="create a tenant")
    create.add_argument("name", help="1-64 letters, digits, '.', '_' or '-'")
    create.set_defaults(func=cmd_tenants_create)
    listing = tenant_commands.add_parser("list", parents=[common, as_json], help="list tenants")
    listing.set_defaults(func=cmd_tenants_list)
    for action, disabled in (("disable", True), ("enable", False)):
        toggle = tenant_commands.add_parser(
            action,
            parents=[common, as_json],
            help=f"{action} a tenant (its keys {'stop' if disabled else 'resume'} working)",
        )
        toggle.add_argument("name")
        toggle.set_defaults(func=cmd_tenants_toggle, disabled=disabled)

    keys = subparsers.add_parser("keys", help="create, list, revoke API keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = key_commands.add_parser(
        "create", parents=[common, as_json], help="create an API key (its secret is printed once)"
    )
    create.add_argument("--tenant", required=True, metavar="NAME", help="the tenant the key acts for")
    create.add_argument("--admin", action="store_true", help="also allow the admin API (scope 'admin')")
    create.add_argument("--name", default="", metavar="N", help="a label, e.g. where the key is used")
    create.set_defaults(func=cmd_keys_create)
    listing = key_commands.add_parser("list", parents=[common, as_json], help="list a tenant's keys")
    listing.add_argument("--tenant", required=True, metavar="NAME")
    listing.set_defaults(func=cmd_keys_list)
    revoke = key_commands.add_parser("revoke", parents=[common, as_json], help="revoke a key")
    revoke.add_argument("prefix", metavar="PREFIX", help="the key's prefix, as `keys list` shows it")
    revoke.set_defaults(func=cmd_keys_revoke)
    update = key_commands.add_parser(
        "update", parents=[common, as_json], help="rename a key or change its expiry (audited)"
    )
    update.add_argument("prefix", metavar="PREFIX", help="the key's prefix, as `keys list` shows it")
    update.add_argument("--name", default=None, metavar="N", help="a new label")
    update.add_argument(
        "--expires-at",
        type=parse_expiry,
        default=argparse.SUPPRESS,
        metavar="TIME",
        help="an ISO time with a zone, e.g. 2027-01-31T00:00:00Z; 'never': valid until revoked",
    )
    update.set_defaults(func=cmd_keys_update)

    audit = subparsers.add_parser("audit", help="who changed which tenant, key or quota, and how")
    audit_commands = audit.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    listing = audit_commands.add_parser(
        "list", parents=[common, as_json], help="tenant, key and quota changes, newest first"
    )
    listing.add_argument("--tenant", metavar="NAME", help="only this tenant's changes")
    listing.add_argument(
        "--target-type", choices=("tenant", "key", "quota"), help="only changes to this kind of target"
    )
    listing.add_argument(
        "--limit", type=parse_page_size, default=50, metavar="N", help="changes per page, 1-200 (default 50)"
    )
    listing.add_argument("--cursor", metavar="C", help="the next page, as the previous one printed it")
    listing.set_defaults(func=cmd_audit_list)

    deployments = subparsers.add_parser("deployments", help="create, list, show, update deployments")
    dep_commands = deployments.add_subparsers(dest="deployments_command", required=True, metavar="ACTION")
    create = dep_commands.add_parser(
        "create", parents=[common, as_json], help="create a deployment (a model tenants can call)"
    )
    create.add_argument("name", metavar="NAME", help="the model id tenants call, e.g. @tessera/demo")
    create.add_argument("--checkpoint", required=True, metavar="DIR", help="checkpoint folder on the workers")
    add_deployment_options(create)
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
        "update", parents=[common, as_json], help="change a deployment's config (validated and audited)"
    )
    update.add_argument("name", metavar="NAME")
    update.add_argument(
        "--checkpoint", default=argparse.SUPPRESS, metavar="DIR", help="checkpoint folder on the workers"
    )
    add_deployment_options(update)
    update.set_defaults(func=cmd_deployments_update)


def add_deployment_options(parser: argparse.ArgumentParser) -> None:
    """The editable deployment fields as flags. An unset flag leaves no attribute (create: the default;
    update: unchanged). Values are validated by ``tessera.tenancy``, which names the allowed ones."""
    unset = argparse.SUPPRESS
    option = parser.add_argument
    option("--mode", default=unset, help="disaggregated (prefill + decode pools; default) or colocated")
    option("--dtype", default=unset, help="compute dtype: auto (default), bfloat16, float16 or float32")
    option(
        "--prefill-kv",
        default=unset,
        help="KV format prefill computes in: auto (default), bf16, int8, fp8_e4m3",
    )
    option(
        "--decode-kv",
        default=unset,
        help="KV format the decode pool stores: int8 (default), fp8_e4m3, bf16, auto",
    )
    option("--prefill-weights", default=unset, help="prefill weight format: bf16 (default), fp8, int4")
    option("--decode-weights", default=unset, help="decode weight format: bf16 (default), fp8, int4")
    option("--page-size", type=int, default=unset, metavar="P", help="tokens per KV page, a power of two")
    option("--kv-budget-bytes", type=parse_bytes, default=unset, metavar="B", help="KV memory, e.g. 512MiB")
    option("--max-num-seqs", type=int, default=unset, metavar="N", help="requests a worker batches at most")
    option(
        "--max-model-len",
        type=parse_optional_int,
        default=unset,
        metavar="N",
        help="context length cap; 'auto' = the model's own",
    )
    option(
        "--max-tokens-limit", type=int, default=unset, metavar="N", help="most max_tokens one request may ask"
    )
    option(
        "--local-prefill-max-tokens",
        type=int,
        default=unset,
        metavar="N",
        help="prompts of at most N tokens skip the prefill pool: the decode pool prefills them (0: none)",
    )
    option(
        "--integrity-check",
        action=argparse.BooleanOptionalAction,
        default=unset,
        help="check KV page tags before cache reads",
    )
    option(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=unset,
        help="reuse a tenant's cached prompt pages",
    )
    enabled = parser.add_mutually_exclusive_group()
    enabled.add_argument(
        "--enable", dest="enabled", action="store_const", const=True, default=unset, help="serve requests"
    )
    enabled.add_argument(
        "--disable", dest="enabled", action="store_const", const=False, default=unset, help="refuse requests"
    )
    option(
        "--no-checkpoint-check",
        dest="check_checkpoint",
        action="store_false",
        help="skip checking the checkpoint folder (when it exists only on the worker hosts)",
    )


# --- commands --------------------------------------------------------------------------------------------


def cmd_db_upgrade(args: argparse.Namespace) -> None:
    from tessera import db

    url = settings_from(args).database_url
    before = migration_step(db.current_revision, url)
    after = migration_step(db.upgrade, url, args.revision)
    if before == after:
        print(f"{db.redact(url)}: already at revision {after}")
    else:
        print(f"{db.redact(url)}: upgraded from {before or 'an empty database'} to revision {after}")


def cmd_db_downgrade(args: argparse.Namespace) -> None:
    from tessera import db

    url = settings_from(args).database_url
    before = migration_step(db.current_revision, url)
    after = migration_step(db.downgrade, url, args.revision)
    print(f"{db.redact(url)}: downgraded from revision {before} to {after or 'base (no tables)'}")


def cmd_tenants_create(args: argparse.Namespace) -> None:
    from tessera import tenancy

    with open_session(args) as session:
        tenant = tenancy.create_tenant(session, args.name, actor=cli_actor())
        emit(args, [tenant_row(tenant)], title="Tenant created")


def cmd_tenants_list(args: argparse.Namespace) -> None:
    from tessera import tenancy

    with open_session(args) as session:
        emit(args, [tenant_row(t) for t in tenancy.list_tenants(session)], title="Tenants")


def cmd_tenants_toggle(args: argparse.Namespace) -> None:
    from tessera import tenancy

    with open_session(args) as session:
        with key_version(args) as version:
            tenant = tenancy.set_tenant_disabled(
                session, args.name, args.disabled, version=version, actor=cli_actor()
            )
        emit(args, [tenant_row(tenant)], title="Tenant disabled" if args.disabled else "Tenant enabled")


def cmd_keys_create(args: argparse.Namespace) -> None:
    from tessera import tenancy
    from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE

    scopes = [SCOPE_INFERENCE, SCOPE_ADMIN] if args.admin else [SCOPE_INFERENCE]
    with open_session(args) as session:
        key, secret = tenancy.create_key(
            session, args.tenant, scopes=scopes, name=args.name, actor=cli_actor()
        )
        row = key_row(key, tenant=args.tenant)
    if args.json:
        print(json.dumps({**row, "key": secret}, default=json_default))
    else:
        print(
            f"Created key {row['prefix']} for tenant {args.tenant} (scopes: {row['scopes']})", file=sys.stderr
        )
        print(secret)
    print(
        "Copy this key now: it is shown only once. Tessera stores only a salted hash and cannot show it again.",
        file=sys.stderr,
    )


def cmd_keys_list(args: argparse.Namespace) -> None:
    from tessera import tenancy

    with open_session(args) as session:
        rows = [key_row(k, tenant=args.tenant) for k in tenancy.list_keys(session, args.tenant)]
        emit(args, rows, title=f"API keys of {args.tenant}")


def cmd_keys_revoke(args: argparse.Namespace) -> None:
    from tessera import tenancy

    with open_session(args) as session:
        with key_version(args) as version:
            key = tenancy.revoke_key(session, args.prefix, version=version, actor=cli_actor())
        emit(args, [key_row(key, tenant=key.tenant.name)], title="Key revoked")


def cmd_keys_update(args: argparse.Namespace) -> None:
    from tessera import tenancy

    changes: dict[str, Any] = {}
    if args.name is not None:
        changes["name"] = args.name
    if hasattr(args, "expires_at"):
        changes["expires_at"] = args.expires_at
    if not changes:
        raise ValueError("nothing to update: pass --name or --expires-at (a time, or 'never')")
    with open_session(args) as session:
        with key_version(args) as version:
            key = tenancy.update_key(session, args.prefix, **changes, version=version, actor=cli_actor())
        emit(args, [key_row(key, tenant=key.tenant.name)], title="Key updated")


def cmd_audit_list(args: argparse.Namespace) -> None:
    from tessera.audit import audit_events_page

    with open_session(args) as session:
        page = audit_events_page(
            session, tenant=args.tenant, target_type=args.target_type, cursor=args.cursor, limit=args.limit
        )
        rows = [audit_event_row(e) for e in page.items]
    emit(args, rows, title="Changes (newest first)")
    if page.next_cursor is not None:
        print(f"More: --cursor {page.next_cursor}", file=sys.stderr)


def parse_page_size(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        size = 0
    if not 1 <= size <= 200:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to 200, got {value!r}")
    return size


def parse_expiry(value: str) -> datetime | None:
    if value.strip().lower() == "never":
        return None
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise argparse.ArgumentTypeError(
            f"expected an ISO time with a zone (e.g. 2027-01-31T00:00:00Z) or 'never', got {value!r}"
        )
    return when


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


# --- helpers ---------------------------------------------------------------------------------------------


def settings_from(args: argparse.Namespace) -> Settings:
    from tessera.settings import Settings

    given = {"database_url": args.database_url, "data_dir": args.data_dir}
    return Settings(**{k: v for k, v in given.items() if v is not None})


@contextlib.contextmanager
def key_version(args: argparse.Namespace) -> Iterator[KeyVersion | None]:
    """The API processes' key-version counter, to tell them a key changed: in TESSERA_REDIS_URL's Redis, or
    in the embedded one a `tessera up` on the data dir runs. None when there is neither."""
    from tessera.auth import KeyVersion

    version = KeyVersion.from_settings(settings_from(args))
    try:
        yield version
    finally:
        if version is not None:
            version.redis.close()


@contextlib.contextmanager
def open_session(args: argparse.Namespace) -> Iterator[Session]:
    """A session on a database that is reachable and at the newest migration, else a clear error."""
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from tessera import db

    url = settings_from(args).database_url
    current, head = migration_step(db.current_revision, url), db.head_revision()
    if current != head:
        state = "has no Tessera tables" if current is None else f"is at revision {current}, not {head}"
        raise ValueError(f"the database {db.redact(url)} {state}: run `tessera db upgrade` first")
    engine = db.make_engine(url)
    try:
        with db.session_factory(engine)() as session:
            yield session
    except (OperationalError, ProgrammingError) as exc:
        raise ValueError(database_error(url, exc)) from None
    finally:
        engine.dispose()


def migration_step(step, url: str, *args: Any) -> Any:
    """Run a ``tessera.db`` migration function; unreachable databases and unknown revisions become
    ValueErrors that say what to do."""
    from alembic.util import CommandError
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from tessera import db

    try:
        return step(url, *args)
    except (OperationalError, ProgrammingError) as exc:
        raise ValueError(database_error(url, exc)) from None
    except CommandError as exc:
        raise ValueError(f"{db.redact(url)}: {exc}") from None


def database_error(url: str, exc: Exception) -> str:
    from tessera import db

    detail = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
    return (
        f"database {db.redact(url)}: {detail}. Check that it is running and reachable "
        "(--database-url or TESSERA_DATABASE_URL), and that `tessera db upgrade` has run."
    )


def cli_actor() -> str:
    from tessera.audit import local_actor

    return local_actor()


def deployment_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The deployment fields given on the command line (unset flags left no attribute)."""
    from tessera import deployments

    return {name: getattr(args, name) for name in deployments.EDITABLE_FIELDS if hasattr(args, name)}


def tenant_row(tenant: Tenant) -> dict[str, Any]:
    return {
        "name": tenant.name,
        "id": tenant.id,
        "disabled": tenant.disabled,
        "created_at": tenant.created_at,
    }


def key_row(key: ApiKey, tenant: str) -> dict[str, Any]:
    return {
        "prefix": f"tsk_{key.prefix}",
        "tenant": tenant,
        "name": key.name,
        "scopes": ",".join(key.scope_list),
        "created_at": key.created_at,
        "last_used_at": key.last_used_at,
        "revoked_at": key.revoked_at,
    }


def deployment_row(deployment: Deployment) -> dict[str, Any]:
    from tessera import deployments

    return {
        "name": deployment.name,
        **deployments.deployment_config(deployment).model_dump(exclude={"name"}),
        "created_at": deployment.created_at,
        "updated_at": deployment.updated_at,
    }


def audit_event_row(event: AuditEvent) -> dict[str, Any]:
    return {
        "id": event.id,
        "at": event.created_at,
        "actor": event.actor,
        "action": event.action,
        "target_type": event.target_type,
        "target": event.target,
        "before": event.before,
        "after": event.after,
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


def emit(args: argparse.Namespace, rows: list[dict[str, Any]], title: str) -> None:
    if args.json:
        for row in rows:
            print(json.dumps(row, default=json_default))
        return
    if not rows:
        print(f"{title}: none", file=sys.stderr)
        return
    from rich.table import Table

    table = Table(title=title)
    for i, column in enumerate(rows[0]):
        table.add_column(column, no_wrap=i == 0)  # the first column names the row: never cut it
    for row in rows:
        table.add_row(*(cell(v) for v in row.values()))
    rich_console().print(table)


def rich_console():
    """A console for tables: the terminal's width, or unlimited when piped, so no value is cut."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=1000)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M UTC")
    return str(value)


def json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")
