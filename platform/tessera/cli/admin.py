"""``tessera tenants``, ``keys`` and ``audit``: tenants, their API keys and the log of their changes from the
command line.

``add_commands`` registers them on the main parser's subcommands. Every command takes ``--database-url`` and
``--data-dir`` (default: the ``TESSERA_*`` settings). User errors raise ValueError, which ``tessera.cli.main``
prints without a traceback; results go to stdout (tables, or JSON with ``--json``), notes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tessera.cli.database import cli_actor, database_options, key_version, open_session
from tessera.cli.output import emit, json_default, json_option

if TYPE_CHECKING:  # imported inside the commands: SQLAlchemy, pydantic and rich would slow every `tessera`
    from tessera.models import ApiKey, AuditEvent, Tenant


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    common, as_json = database_options(), json_option()
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


# --- commands --------------------------------------------------------------------------------------------


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


# --- rows ------------------------------------------------------------------------------------------------


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
